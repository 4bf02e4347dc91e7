"""The fetch-order check: the microbatches a DataLoader fetches must be its batch sampler's, in order.

:class:`~varlen_cli.loader.collate.PlanDataset` runs :meth:`FetchOrder.check` on every microbatch
it fetches. A wrapper that re-shards or reorders the batch sampler (``accelerator.prepare(loader)``)
fails on its first out-of-place microbatch, before anything is trained.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

from ..errors import PlanError
from .position import describe

_ITERATIONS = itertools.count()
_NONCE = os.urandom(4).hex()


def new_iteration_id() -> str:
    """A process-unique id for one iteration of a batch sampler."""
    return f"{_NONCE}-{os.getpid()}-{next(_ITERATIONS)}"


class FetchOrder:
    """Per-process record of the microbatches a DataLoader fetched, for :meth:`check`."""

    def __init__(self):
        self.last: dict[str, int] = {}

    def check(self, indices: Any) -> None:
        order = getattr(indices, "order", None)
        info = getattr(indices, "info", None)
        if order is None or info is None:
            return
        iteration, k = order
        worker = torch.utils.data.get_worker_info()
        stride = 1 if worker is None else worker.num_workers
        last = self.last.get(iteration)
        ok = (k == 0) if (last is None and worker is None) else (last is None or k == last + stride)
        if not ok:
            raise PlanError(f"desync: the DataLoader fetched the microbatch at "
                            f"{describe((info.epoch, info.step, info.rank, info.micro))} out of the plan's order "
                            f"(its batch sampler was re-sharded or wrapped, e.g. by accelerator.prepare(): use "
                            f"varlen_cli.integrations.accelerate.prepare_plan_dataloader)")
        if len(self.last) > 64:
            self.last.clear()
        self.last[iteration] = k
