"""``varlen_cli.loader``: consume a ``varlen plan`` in a PyTorch trainer.

Imports only torch, numpy and pyarrow. The one-line path::

    from varlen_cli.loader import Plan, dataloader_for_plan, VariableBatchSizeLR

    plan = Plan.open("plan.parquet")
    loader = dataloader_for_plan(dataset, plan)          # rank from torch.distributed / env
    scheduler = VariableBatchSizeLR(base_scheduler, plan)
    for epoch in range(loader.epoch, plan.epochs):       # right after loader.load_state_dict(...) too
        loader.set_epoch(epoch)
        for batch in loader:                              # grad_accum microbatches per step
            ...                                           # then optimizer.step(); scheduler.step()

See ``docs/loader.md``.
"""

from __future__ import annotations

from .batch import IGNORE_INDEX
from .collate import PadCollate, PlanDataset, Samples, causal_padding_mask, pad_collate
from .dataloader import PlanDataLoader, dataloader_for_plan
from .guard import ConsumptionGuard
from .ledger import Ledger
from .lr import VariableBatchSizeLR
from .memory import predicted_memory
from .microbatch import Microbatch
from .model_inputs import BOOKKEEPING_KEYS, to_model_inputs
from .packed import PackedCollate, PackedLayoutError, block_causal_mask, collate_packed, packed_layout
from .plan_file import Plan, PlanError
from .position import PlanRow, batch_position, check_batch
from .sampler import MicrobatchIndices, PlanBatchSampler, resolve_rank
from .source_dataset import SourceDataset
from .step_figures import StepFigures, plan_metric_events, plan_metrics

__all__ = [
    "BOOKKEEPING_KEYS", "ConsumptionGuard", "IGNORE_INDEX", "Ledger", "Microbatch", "MicrobatchIndices",
    "PackedCollate", "PackedLayoutError", "PadCollate", "Plan", "PlanBatchSampler", "PlanDataLoader", "PlanDataset",
    "PlanError", "PlanRow", "Samples", "SourceDataset", "StepFigures", "VariableBatchSizeLR", "batch_position",
    "block_causal_mask", "causal_padding_mask", "check_batch", "collate_packed", "dataloader_for_plan",
    "packed_layout", "pad_collate", "plan_metric_events", "plan_metrics", "predicted_memory", "resolve_rank",
    "to_model_inputs",
]
