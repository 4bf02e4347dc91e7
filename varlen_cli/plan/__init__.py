"""``varlen plan``: a Parquet batch plan from a metrics or sorted directory, or a mixture of them.

One planner, the chunked engine (:mod:`.chunked`), plans every plan in bounded memory on one process,
``--nproc`` workers or a torchrun job, with the same bytes for any worker count: the input is cut
into chunks of ``--chunk-samples`` samples (a mixture's *virtual rows*, one per copy of a sample,
likewise: :mod:`.chunked.sources`); each chunk's microbatches are formed under the budget by a
*former* (:mod:`.orders`: greedy consecutive for curriculum/reverse/bucket-shuffle, fixed-size for the
random baseline, shape-grouped for ``--same-shape-per-step``, packed rows for ``--packing``); then the
epochs are laid out as steps x ranks x micro (the tail rule, :mod:`.tail`; compile warm-up and cost
balancing across ranks, :mod:`.layout`), LR scales and statistics computed, and the plan streamed into
a file swapped in atomically. ``varlen replan`` (:mod:`.replan`) and ``--extend`` (:mod:`.extend`)
continue a plan with the same planner. See ``docs/plan.md`` and ``docs/formats.md``.

    from varlen_cli.plan import PlanConfig, plan
    result = plan(PlanConfig(input="sorted", output="plan.parquet", max_tokens=16384, dp=8))

The pieces work on plain arrays too, with no file: the budget (:class:`varlen_cli.budget.Budget`, from
options by :func:`.cost_model.resolve_budget`; the limits it sets, :mod:`.cost_model`), the formers
(``orders.Formers().for_epoch(config, mode).form(orders.EpochInputs(...), mode, rng)`` on a length
array), the tail rule (:func:`.tail.fix_padded`, :func:`.tail.fix_packed`) and the rank layout
(:func:`.layout.layout_epoch`, :func:`.layout.assign_ranks`; packed rows under an attention cost,
:func:`.balance.balance_rows`).
"""

from __future__ import annotations

from .core import ORDERS, TAILS, PlanConfig, PlanResult, check, plan

__all__ = ["ORDERS", "TAILS", "PlanConfig", "PlanResult", "check", "plan"]
