"""torchtitan on a varlen plan: ``PlanDataLoader``, a torchtitan ``BaseDataLoader`` built by its ``Config``.

    from varlen_cli.integrations.torchtitan import PlanDataLoader

    config.dataloader = PlanDataLoader.Config(plan="plan.parquet", dataset="corpus_text_document")
    # the Trainer calls config.dataloader.build(dp_world_size=..., dp_rank=..., tokenizer=..., seq_len=...,
    # local_batch_size=..., ...) and iterates it; its CheckpointManager saves it with the model (DCP)

Each microbatch of this data-parallel rank, in plan order, every plan epoch in one pass (torchtitan
counts steps, not epochs), as ``({"input": input_ids, "positions": positions}, labels)``:

* packed plans (``varlen plan --packing``): ``B x T`` rows of whole documents; ``positions``
  restart at 0 at every document and at each row's padding tail (torchtitan's flex and varlen
  attention find the documents there); ``labels`` are next-token targets that never cross a
  document, -100 (torchtitan's ``IGNORE_INDEX``) on each document's last token and on padding;
* padded plans: ``B x T`` with ``positions`` 0..T-1 per row and -100 on padding.

``state_dict()``/``load_state_dict()`` carry the plan position and the ledger in torchtitan's DCP
checkpoint, under one key shared by every rank (all ranks hold the same position), so a checkpoint
loads on any number of ranks: one saved on D ranks and loaded on M != D with the same plan is
refused in one line naming ``varlen replan PLAN --from-step N --dp M``, and accepted with the plan
that command writes. torchtitan's trainer counts each step's loss targets itself (labels != -100,
all-reduced): ``loader.last.step_loss_tokens`` is the same count from the plan, per microbatch.

Also checked, in one line each: ``training.seq_len`` below the plan's longest row; an optimizer
step (a global optimizer hook) after other than exactly one plan step of microbatches (torchtitan's
gradient accumulation is not the plan's ``--grad-accum``), before the update is applied.
torchtitan's LR schedule has no per-step scale: a plan whose ``lr_scale`` is not all 1 meets the
loader's LR-coverage check (varlen_cli.loader.guard); plan with ``--lr-scaling none``, or pass
``Config(lr_scale="ignore")`` to train without the scale on purpose.

torchtitan's main branch (the Grain-based loader, pytorch/torchtitan#4088) builds the loader with
``max_context_length`` and ``num_tokens_per_batch`` instead of ``seq_len``; given those, each
microbatch is folded to 1-D and padded to ``num_tokens_per_batch`` token slots (docs/integrations.md).
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..loader import PadCollate
from ..loader.batch import IGNORE_INDEX
from ..loader.packed import PackedCollate
from ..loader.plan_file import Plan, PlanError
from . import open_plan
from .stream import PlanStream

try:  # torchtitan 0.3 (PyPI)
    from torchtitan.components.dataloader import BaseDataLoader
except ImportError:  # torchtitan main: the Grain-based data package
    from torchtitan.components.data.loader import BaseDataLoader

STATE_KEY = "varlen"  # the loader's state (JSON) inside torchtitan's checkpoint


def open_dataset(dataset: Any):
    """``Config.dataset``: a map-style dataset (item i = sample i), or a path: a Megatron ``PREFIX``
    (``PREFIX.bin``/``.idx``) read by :class:`~varlen_cli.integrations.megatron.IndexedDocuments`,
    else a metrics or sorted directory of ``varlen analyze`` read by :class:`~varlen_cli.loader.SourceDataset`."""
    if not isinstance(dataset, (str, os.PathLike)):
        return dataset
    path = os.fspath(dataset)
    if os.path.isfile(path + ".idx") or path.endswith(".idx"):
        from .megatron import IndexedDocuments

        return IndexedDocuments(path)
    from ..loader import SourceDataset

    return SourceDataset(path)


def longest_row(plan: Plan) -> int:
    """The longest padded sequence length T of the plan (its shapes)."""
    return max((t for _, t in plan.shapes), default=0)


class PlanDataLoader(BaseDataLoader):
    """A torchtitan ``BaseDataLoader`` over a varlen plan (see the module docstring).

    ``Config(plan=..., dataset=...)``: the plan file, and the dataset (an object whose item ``i`` is
    sample ``i``'s token ids, or a path, see :func:`open_dataset`); ``pad_id`` fills padding;
    ``num_workers`` DataLoader workers; ``lr_scale="ignore"`` trains a plan whose ``lr_scale`` is
    not all 1 without it (the loader's LR-coverage check otherwise stops it).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        plan: str = ""  # a plan file (or a Plan)
        dataset: str = ""  # a path (see open_dataset), or a dataset object
        pad_id: int = 0
        num_workers: int = 0
        lr_scale: str = "check"

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int | None = None,
                 max_context_length: int | None = None, num_tokens_per_batch: int | None = None, **kwargs: Any):
        if isinstance(config.plan, str) and not config.plan:
            raise PlanError("PlanDataLoader.Config needs plan= (a plan file made by `varlen plan`)")
        dataset = config.dataset
        if isinstance(dataset, str) and not dataset:
            dataset = getattr(config, "dataset_path", None)  # torchtitan 0.3's own field
        if dataset is None or (isinstance(dataset, str) and not dataset):
            raise PlanError("PlanDataLoader.Config needs dataset= (a dataset whose item i is sample i of the plan, or "
                            "a path: a Megatron PREFIX or a varlen analyze metrics directory)")
        plan = open_plan(config.plan)
        context = max_context_length if max_context_length is not None else seq_len
        longest = longest_row(plan)
        if context is not None and longest > context:
            raise PlanError(f"the plan has rows of {longest} tokens but torchtitan's context length is {context}: set "
                            f"training.seq_len (max_context_length on torchtitan main) to at least {longest}")
        self.num_tokens_per_batch = num_tokens_per_batch  # torchtitan main: fold to 1-D, pad to this
        self.pad_id = int(config.pad_id)
        collate = PackedCollate(pad_id=self.pad_id) if plan.packing else PadCollate(pad_id=self.pad_id)
        self.stream = PlanStream(open_dataset(dataset), plan, collate_fn=collate, rank=dp_rank,
                                 world_size=dp_world_size, num_workers=config.num_workers, lr_scale=config.lr_scale)
        self.plan = plan
        self.dp_rank, self.dp_world_size = int(dp_rank), int(dp_world_size)
        self._since, self._stepped_at = 0, None  # microbatches since the last optimizer step; where it was
        _watch_optimizer_steps()

    @property
    def last(self):
        """The plan row (``PlanRow``) of the microbatch handed out last: ``step_loss_tokens``,
        ``step_tokens``, its position (``epoch``, ``step``, ``rank``, ``micro``), ``sample_ids``."""
        return self.stream.last

    def __iter__(self):
        global _ACTIVE
        for batch in self.stream:
            self._since += 1
            _ACTIVE = weakref.ref(self)  # the loader that handed out the latest batch: the one being trained
            yield self.trainer_batch(batch)

    def trainer_batch(self, batch: dict) -> tuple[dict, torch.Tensor]:
        """``({"input", "positions"}, labels)`` of a collated batch (1-D on torchtitan main)."""
        inputs, positions, labels = batch["input_ids"], batch["position_ids"].contiguous(), batch["labels"]
        if self.num_tokens_per_batch is None:
            return {"input": inputs, "positions": positions}, labels
        slots = inputs.numel()
        if slots > self.num_tokens_per_batch:
            row = batch["info"]
            raise PlanError(f"the plan's microbatch at step {row.step} (rank {row.rank}, micro {row.micro}) has "
                            f"{row.batch_size} x {row.seqlen} = {slots} token slots, more than "
                            f"training.num_tokens_per_microbatch_per_dp_rank {self.num_tokens_per_batch}")
        pad = self.num_tokens_per_batch - slots
        inputs = torch.nn.functional.pad(inputs.reshape(-1), (0, pad), value=self.pad_id)
        labels = torch.nn.functional.pad(labels.reshape(-1), (0, pad), value=IGNORE_INDEX)
        positions = torch.cat([positions.reshape(-1), torch.arange(pad, dtype=positions.dtype)])
        return {"input": inputs, "positions": positions}, labels

    def check_optimizer_step(self) -> None:
        """Run before every optimizer step in this process while this loader handed out the latest batch
        (a global optimizer hook): the microbatches handed out since the previous step must be exactly one
        plan step (torchtitan's gradient accumulation is the plan's)."""
        row, ga = self.stream.last, self.plan.grad_accum
        if row is None or (row.step, row.micro) == self._stepped_at:
            return  # no data yet, or another optimizer of the same step (torchtitan's containers hold several)
        if self._since != ga or row.micro != ga - 1:
            raise PlanError(f"an optimizer step follows {self._since} microbatch(es) up to micro {row.micro} of the "
                            f"plan's step {row.step}, whose steps have {ga}: torchtitan's gradient accumulation is "
                            f"not the plan's --grad-accum {ga} (set training.global_batch_size = local_batch_size x "
                            f"dp x {ga})")
        self._stepped_at, self._since = (row.step, row.micro), 0

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: json.dumps(self.stream.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # a checkpoint without the loader (torchtitan allows an empty state)
            return
        state = _parse_state(state_dict)
        if not state:  # the state of a loader that had handed out nothing: no position
            return
        self.stream.load_state_dict(state)  # checked there (format.loader_state_problem)
        self._since, self._stepped_at = 0, None

    def close(self) -> None:
        """Stop checking optimizer steps against this loader (torchtitan main calls it)."""
        global _ACTIVE
        if _ACTIVE is not None and _ACTIVE() is self:
            _ACTIVE = None


def _parse_state(state_dict: Any) -> dict:
    """The loader state inside torchtitan's ``{"varlen": JSON text}``, or one PlanError line."""
    text = state_dict.get(STATE_KEY) if isinstance(state_dict, dict) else None
    try:
        state = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        state = None
    if not isinstance(state, dict):
        raise PlanError(f"invalid loader state: torchtitan's data loader state must be {{{STATE_KEY!r}: the JSON "
                        f"text PlanDataLoader.state_dict() wrote}}, not {str(state_dict)[:80]}")
    return state


_ACTIVE: weakref.ref | None = None  # the PlanDataLoader that handed out the latest batch in this process
_HOOK = None


def _check_active(optimizer, args, kwargs) -> None:
    """A global optimizer pre-step hook: the loader being trained checks the step (see check_optimizer_step)."""
    loader = _ACTIVE() if _ACTIVE is not None else None
    if loader is not None:
        loader.check_optimizer_step()


def _watch_optimizer_steps() -> None:
    global _HOOK
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_check_active)
