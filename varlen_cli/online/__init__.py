"""``varlen_cli.online``: the planner in-process, one optimizer step at a time, for data made while the
model trains (streams read once, RL rollouts). See ``docs/online.md``.

* :func:`plan_step` (:mod:`.step`): one step over a buffer of samples, padded (``max_tokens``) or packed
  (``seq_len``), by the planner's own pieces (:mod:`.form`: formers, budget, tail rule, rank layout;
  :mod:`.refine`: the last swaps between ranks), returning a :class:`StepPlan`;
* :class:`OnlinePlanner` (:mod:`.planner`): steps from a stream, a bounded buffer, a token or sample
  target, group runs kept whole, an exact-resume state;
* :func:`dataloader_for_stream` (:mod:`.loader`, imports torch when called): this rank's collated
  microbatches of a stream every rank reads, with the plan loaders' collates, and ``StreamLR``.

Imports numpy only (and the planner's numpy modules): no torch.

    from varlen_cli.online import plan_step
    step = plan_step(lengths, dp=8, seq_len=32768, attention_cost=1 / 49152)
    step.ranks[rank]      # this rank's microbatches: arrays of indices into lengths
"""

from __future__ import annotations

from .planner import OnlinePlanner, Step
from .step import StepPlan, plan_step

__all__ = ["OnlinePlanner", "Step", "StepPlan", "dataloader_for_stream", "plan_step"]


def dataloader_for_stream(iterable, planner, collate=None, **kwargs):
    """This rank's collated microbatches of ``iterable`` planned by ``planner``: see
    :func:`varlen_cli.online.loader.dataloader_for_stream` (imported here, with torch, when called)."""
    from .loader import dataloader_for_stream as make

    return make(iterable, planner, collate, **kwargs)
