"""``varlen_cli.loader``: consume a ``varlen plan`` in a PyTorch trainer.

Imports only torch, numpy and pyarrow. The one-line path::

    from varlen_cli.loader import Plan, dataloader_for_plan, VariableBatchSizeLR

    plan = Plan.open("plan.parquet")
    loader = dataloader_for_plan(dataset, plan)          # rank from torch.distributed / env
    scheduler = VariableBatchSizeLR(base_scheduler, plan)
    for epoch in range(loader.epoch, plan.epochs):
        loader.set_epoch(epoch)
        for batch in loader:                              # grad_accum microbatches per step
            ...

See ``docs/loader.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .collate import IGNORE_INDEX, PadCollate, PlanDataset, Samples, causal_padding_mask, pad_collate
from .dataloader import PlanDataLoader
from .guard import ConsumptionGuard, PlanRow, batch_position, check_batch
from .lr import VariableBatchSizeLR
from .memory import predicted_memory
from .model_inputs import BOOKKEEPING_KEYS, to_model_inputs
from .packed import PackedCollate, PackedLayoutError, block_causal_mask, collate_packed, packed_layout
from .plan_file import Microbatch, Plan, PlanError
from .sampler import MicrobatchIndices, PlanBatchSampler, resolve_rank
from .source_dataset import SourceDataset

__all__ = [
    "BOOKKEEPING_KEYS", "ConsumptionGuard", "PlanDataLoader", "PlanRow", "batch_position", "check_batch",
    "to_model_inputs",
    "IGNORE_INDEX", "Microbatch", "MicrobatchIndices", "PackedCollate", "PackedLayoutError", "PadCollate", "Plan",
    "PlanBatchSampler", "PlanDataset", "PlanError", "Samples", "SourceDataset", "VariableBatchSizeLR",
    "block_causal_mask", "causal_padding_mask", "collate_packed", "dataloader_for_plan", "packed_layout",
    "pad_collate", "predicted_memory", "resolve_rank",
]


def dataloader_for_plan(dataset, plan: Plan | str, rank: int | None = None,
                        world_size: int | None = None, collate_fn: Callable[[Any], Any] | None = None,
                        num_workers: int = 0, pin_memory: bool = False, epoch: int = 0, check_length: bool = True,
                        stateful: bool = False, all_epochs: bool = False, read_ahead: int = 4, **kwargs):
    """A :class:`PlanDataLoader` over ``dataset`` that yields this rank's microbatches of ``plan``, collated.

    The loader has ``set_epoch``, ``state_dict``/``load_state_dict`` (the position after the last
    batch it handed out: exact with workers) and checks that batches are consumed in plan order
    (``loader.guard``; ``VariableBatchSizeLR.step()`` checks each step's micros against it).
    ``stateful=True`` builds it over torchdata's ``StatefulDataLoader`` instead (torchdata's own
    state). ``all_epochs=True``: one iteration runs every remaining epoch of the plan.

    The dataset is wrapped in :class:`PlanDataset` so that ``collate_fn`` (default
    :class:`PadCollate`, or ``PackedCollate`` for a packed plan) sees each microbatch's plan row.
    ``loader.batch_sampler`` is the
    :class:`PlanBatchSampler` (``set_epoch``, ``state_dict``, ``load_state_dict``). With
    ``check_length`` the plan is validated against ``len(dataset)``. Extra keyword arguments
    go to ``DataLoader`` (``prefetch_factor``, ``persistent_workers``, ...). A dataset with a
    ``prefetch(sample_ids)`` method (:class:`SourceDataset`) is told the sample ids of the next
    ``read_ahead`` microbatches each DataLoader worker (or the main process) fetches.
    """
    plan = plan if isinstance(plan, Plan) else Plan.open(plan)
    sampler = PlanBatchSampler(plan, rank, world_size, num_samples=len(dataset) if check_length else None,
                               epoch=epoch)
    if hasattr(dataset, "prefetch"):
        sampler.read_ahead, sampler.read_ahead_stride = max(0, int(read_ahead)), max(1, int(num_workers))
    if collate_fn is None:
        if plan.packing:  # packed plans: rows of concatenated samples, cu_seqlens, position ids
            collate_fn = PackedCollate()
        else:
            collate_fn = PadCollate()
    from .dataloader import stateful_loader_class

    cls = stateful_loader_class() if stateful else PlanDataLoader
    return cls(PlanDataset(dataset), sampler, collate_fn=collate_fn, num_workers=num_workers, pin_memory=pin_memory,
               all_epochs=all_epochs, **kwargs)
