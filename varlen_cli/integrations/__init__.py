"""Glue for training frameworks (optional extras; the core loader never imports these).

* :mod:`varlen_cli.integrations.hf`: ``PlanTrainer`` / ``PlanTrainerMixin`` for ``transformers.Trainer``
  (and TRL's ``SFTTrainer``) — ``pip install varlen-cli[hf]``;
* :mod:`varlen_cli.integrations.accelerate`: ``prepare_plan_dataloader(accelerator, loader)``;
* :mod:`varlen_cli.integrations.lightning`: ``PlanDataModule`` and ``PlanLRCallback`` —
  ``pip install varlen-cli[lightning]``;
* :mod:`varlen_cli.integrations.torchtitan`: ``PlanDataLoader``, a torchtitan ``BaseDataLoader`` —
  ``pip install varlen-cli[torchtitan]``;
* :mod:`varlen_cli.integrations.megatron`: ``IndexedDocuments`` (a Megatron ``.bin``/``.idx`` corpus) and
  ``plan_iterator`` (Megatron's external loader, THD microbatches) — ``pip install varlen-cli[megatron]``;
* :mod:`varlen_cli.integrations.stream`: what those two share (one rank's stream over every epoch,
  the data-parallel change refused naming ``varlen replan``);
* :mod:`varlen_cli.integrations.deepspeed`: ``initialize``, ``backward``, ``save_checkpoint``,
  ``load_checkpoint`` for the DeepSpeed engine (ZeRO 0-3, the pipeline engine) —
  ``pip install varlen-cli[deepspeed]``.

See docs/integrations.md.
"""

from __future__ import annotations

import os

from ..loader.plan_file import Plan, PlanError


def open_plan(plan: Plan | str | os.PathLike) -> Plan:
    """A :class:`Plan` from a plan or a path."""
    return plan if isinstance(plan, Plan) else Plan.open(plan)


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group (else from the environment, else 0/1)."""
    from ..loader.sampler import resolve_rank

    return resolve_rank()


__all__ = ["PlanError", "open_plan", "world"]
