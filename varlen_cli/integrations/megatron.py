"""Megatron-core on a varlen plan: ``IndexedDocuments(prefix)`` and ``plan_iterator(plan, dataset)``.

    varlen analyze corpus_text_document -o metrics        # PREFIX of PREFIX.bin + PREFIX.idx
    varlen plan metrics -o plan.parquet --packing --seq-len 4096 --max-tokens 8192 --dp 8 --grad-accum 4

    # Megatron-LM, --dataloader-type external: the dataset provider returns the iterator
    def train_valid_test_datasets_provider(num_samples):
        it = plan_iterator("plan.parquet", IndexedDocuments("corpus_text_document"),
                           rank=mpu.get_data_parallel_rank(), world_size=mpu.get_data_parallel_world_size(),
                           iteration=get_args().iteration)
        return it, None, None

:class:`IndexedDocuments` is the corpus as ``varlen analyze PREFIX`` numbers it: item ``i`` is the
int64 tokens of sequence ``i`` of the ``.idx``. :func:`plan_iterator` yields this data-parallel
rank's microbatches in plan order, every plan epoch in one pass, one per ``next()`` (Megatron's
schedules call it ``num_microbatches`` times a step):

* packed plans as THD (padding-free) batches: ``tokens``, ``labels``, ``loss_mask``,
  ``position_ids`` (each ``1 x N``, N the microbatch's real tokens: its documents back to back,
  in plan order), ``cu_seqlens`` (int32, the documents' boundaries) and ``max_seqlen``;
  :func:`packed_seq_params` makes the ``PackedSeqParams(qkv_format="thd", ...)`` of one;
* padded plans as Megatron's usual ``B x T`` batch (``attention_mask`` None: causal attention
  never sees the right padding);
* labels are next-token targets that never cross a document (-100 where there is none, which
  Megatron's vocab-parallel cross entropy masks); ``loss_mask`` is 1 exactly on the targets;
  ``loss_tokens`` (this microbatch) and ``step_loss_tokens`` (the step, all ranks and micros) are the
  counts for ``calculate_per_token_loss``.

The plan's ``grad_accum`` must be Megatron's number of microbatches (``--global-batch-size`` =
``--micro-batch-size`` x dp x grad_accum): checked at every step against
``get_num_microbatches()`` once Megatron set it up (else ``num_microbatches=``, the value given to
``forward_backward_func``; ``it.num_microbatches`` is the plan's), refused in one line when they differ.
The iterator's state (position + ledger) is ``state_dict()`` (also ``save_state()``, what Megatron-LM's
``--dataloader-save`` stores per DP rank); resume with ``state=`` or ``iteration=`` (the checkpoint's
iteration, no file needed). A checkpoint of another number of data-parallel ranks is refused naming
``varlen replan PLAN --from-step N --dp M``; the plan it writes resumes from the same checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..analyze.formats import megatron as megatron_format
from ..errors import InputError
from ..loader import PadCollate
from ..loader.batch import IGNORE_INDEX
from ..loader.packed import PackedCollate
from ..loader.plan_file import Plan, PlanError
from ..loader.replan import first_step
from . import open_plan
from .stream import PlanStream, other_dp_error

BOOKKEEPING = ("info", "plan_position", "sample_ids", "num_samples", "num_tokens", "loss_tokens", "step_samples",
               "step_tokens", "step_loss_tokens", "num_items_in_batch", "label_convention")


# -- the corpus ------------------------------------------------------------------------------------
def _prefix(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if "://" in path:
        raise InputError(f"{path}: IndexedDocuments reads local files (copy the .bin/.idx pair to a local disk)")
    return path[:-4] if path.endswith((".idx", ".bin")) else path


class _Pair:
    """One ``PREFIX.idx`` + ``PREFIX.bin``, memory-mapped, the ``.bin`` checked against the index by the
    reader contract (:func:`varlen_cli.analyze.formats.megatron.check_bin`)."""

    def __init__(self, prefix: str):
        idx, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx, bin_path):
            if not os.path.isfile(path):
                raise InputError(f"{path} does not exist (IndexedDocuments takes the PREFIX of PREFIX.bin and "
                                 f"PREFIX.idx)")
        index = megatron_format.read_index(idx, os.path.getsize(idx))  # header, and the .bin's size against it
        n = index.sequences
        self.prefix, self.size, self.dtype = prefix, n, np.dtype(index.dtype)
        self.lengths = np.memmap(idx, np.int32, "r", megatron_format.HEADER_BYTES, (n,)) if n else np.zeros(0, np.int32)
        self.pointers = np.memmap(idx, np.int64, "r", index.pointers_at, (n,)) if n else np.zeros(0, np.int64)
        have = os.path.getsize(bin_path)
        self.data = np.memmap(bin_path, self.dtype, "r") if have else np.zeros(0, self.dtype)

    def tokens(self, i: int) -> np.ndarray:
        pointer, length = int(self.pointers[i]), int(self.lengths[i])
        start, rest = divmod(pointer, self.dtype.itemsize)
        if rest or length < 0 or start < 0 or start + length > len(self.data):
            raise InputError(f"{self.prefix}.idx: sequence {i} (byte {pointer}, {length} tokens) lies outside "
                             f"{self.prefix}.bin: the index is damaged")
        return np.asarray(self.data[start:start + length], dtype=np.int64)


class IndexedDocuments(torch.utils.data.Dataset):
    """A Megatron ``PREFIX.bin``/``PREFIX.idx`` pair as a map-style dataset: item ``i`` is the int64
    tokens of sequence ``i``, the ``sample_id`` that ``varlen analyze PREFIX`` gives it.

    Several prefixes are numbered as ``varlen analyze`` numbers several sources: the ``.idx`` files
    in sorted path order, sequences in file order. The ``.bin`` must be the size its ``.idx``
    describes (else a one-line :class:`~varlen_cli.errors.InputError`). Reads memory-mapped; pickles
    as its paths (DataLoader workers reopen the files).
    """

    def __init__(self, prefix: str | os.PathLike | Sequence[str | os.PathLike]):
        prefixes = [prefix] if isinstance(prefix, (str, os.PathLike)) else list(prefix)
        if not prefixes:
            raise InputError("IndexedDocuments needs at least one PREFIX")
        self.prefixes = sorted({os.path.abspath(_prefix(p)) for p in prefixes}, key=lambda p: p + ".idx")
        self._open()

    def _open(self) -> None:
        self.pairs = [_Pair(p) for p in self.prefixes]
        self.starts = np.concatenate([[0], np.cumsum([pair.size for pair in self.pairs])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is outside 0..{len(self) - 1}")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.pairs[k].tokens(i - int(self.starts[k]))

    @property
    def lengths(self) -> np.ndarray:
        """Every sequence's length (int32), in sample_id order."""
        return np.concatenate([np.asarray(pair.lengths) for pair in self.pairs])

    def __getstate__(self) -> dict:
        return {"prefixes": self.prefixes}

    def __setstate__(self, state: dict) -> None:
        self.prefixes = state["prefixes"]
        self._open()


# -- batches -----------------------------------------------------------------------------------------
class THDCollate:
    """A packed microbatch as one padding-free THD sequence (see the module docstring)."""

    def __init__(self, pad_id: int = 0):
        self.packed = PackedCollate(pad_id=pad_id)

    def __call__(self, samples) -> dict:
        batch = self.packed(samples)
        real = batch["segment_ids"].reshape(-1) != 0  # entries are in row order: flattened, they are in plan order
        labels = batch["labels"].reshape(-1)[real]
        lengths = np.asarray(samples.info.sample_lengths, dtype=np.int64)
        lengths = lengths[lengths > 0]
        cu = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        out = {"tokens": batch["input_ids"].reshape(-1)[real][None], "labels": labels[None],
               "loss_mask": (labels != IGNORE_INDEX).float()[None],
               "position_ids": batch["position_ids"].reshape(-1)[real][None], "attention_mask": None,
               "cu_seqlens": torch.from_numpy(cu), "max_seqlen": torch.tensor([int(lengths.max(initial=0))],
                                                                            dtype=torch.int32)}
        out.update({key: batch[key] for key in BOOKKEEPING if key in batch})
        return out


class BSHDCollate:
    """A padded microbatch as Megatron's ``B x T`` batch dict."""

    def __init__(self, pad_id: int = 0):
        self.padded = PadCollate(pad_id=pad_id)

    def __call__(self, samples) -> dict:
        batch = self.padded(samples)
        out = {"tokens": batch["input_ids"], "labels": batch["labels"], "loss_mask": batch["loss_mask"].float(),
               "position_ids": batch["position_ids"].contiguous(), "attention_mask": None}
        out.update({key: batch[key] for key in BOOKKEEPING if key in batch})
        return out


def packed_seq_params(batch: dict):
    """megatron-core's ``PackedSeqParams`` (``qkv_format="thd"``) of a THD batch from :func:`plan_iterator`,
    on the device of its ``cu_seqlens``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if "cu_seqlens" not in batch:
        raise PlanError("this batch is not THD (a padded plan's B x T batch): PackedSeqParams is for packed plans "
                        "(`varlen plan --packing`)")
    cu = batch["cu_seqlens"].to(torch.int32)
    longest = int(torch.as_tensor(batch["max_seqlen"]).reshape(-1)[0])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


# -- the iterator --------------------------------------------------------------------------------------
def megatron_num_microbatches() -> int | None:
    """Megatron's configured number of microbatches per step (None when Megatron did not set it up)."""
    try:
        from megatron.core import num_microbatches_calculator as calculator
    except ImportError:
        return None
    if getattr(calculator, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is None:
        return None
    return int(calculator.get_num_microbatches())


def check_num_microbatches(plan: Plan, num_microbatches: int | None) -> None:
    """Refuse a Megatron number of microbatches other than the plan's ``grad_accum`` (None: nothing
    configured to check against)."""
    if num_microbatches is not None and int(num_microbatches) != plan.grad_accum:
        raise PlanError(f"Megatron runs {int(num_microbatches)} microbatches a step but the plan was made with "
                        f"--grad-accum {plan.grad_accum}: set --global-batch-size to --micro-batch-size x dp x "
                        f"{plan.grad_accum} (no --rampup-batch-size), or re-plan with --grad-accum "
                        f"{int(num_microbatches)}")


def iteration_state(plan: Plan, iteration: int) -> dict:
    """The loader state of a checkpoint taken after Megatron's global ``iteration`` (no ledger: every
    position before it was trained)."""
    step = int(iteration) - first_step(plan)
    if step < 0:
        raise PlanError(f"iteration {int(iteration)} is before {plan.path}'s first step {first_step(plan)} (made by "
                        f"`varlen replan`): resume from the checkpoint it was made from")
    if step > plan.num_steps:
        raise PlanError(f"iteration {int(iteration)} is past the plan's end (step {first_step(plan) + plan.num_steps})")
    epoch = plan.epochs if step == plan.num_steps else plan.epoch_of(step)
    return {"plan": plan.fingerprint, "epoch": epoch, "step": step, "micro": 0, "dp": plan.dp}


class PlanIterator:
    """Megatron's external-loader iterator over a plan (made by :func:`plan_iterator`)."""

    def __init__(self, stream: PlanStream, num_microbatches: int | None):
        self.stream = stream
        self.plan = stream.plan
        self.configured = num_microbatches  # what the caller said Megatron runs (None: Megatron's calculator)
        self._batches = None

    @property
    def num_microbatches(self) -> int:
        """Microbatches per optimizer step: the plan's ``grad_accum`` (what ``forward_backward_func`` gets)."""
        return self.plan.grad_accum

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._batches is None:
            self._batches = iter(self.stream)
        batch = next(self._batches)
        if batch["info"].micro == 0:  # every step: Megatron's count may change (batch-size ramp-up)
            self.check_num_microbatches()
        return batch

    def check_num_microbatches(self) -> None:
        """The given ``num_microbatches`` and Megatron's configured one must be the plan's ``grad_accum``."""
        check_num_microbatches(self.plan, self.configured)
        check_num_microbatches(self.plan, megatron_num_microbatches())

    @property
    def last(self):
        """The plan row of the microbatch handed out last."""
        return self.stream.last

    def state_dict(self) -> dict:
        """The position after the last microbatch handed out, and the ledger."""
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)
        self._batches = None

    save_state = state_dict  # Megatron-LM's --dataloader-save calls iterator.iterable.save_state()
    restore_state = load_state_dict


def plan_iterator(plan: Plan | str | os.PathLike, dataset, *, rank: int | None = None, world_size: int | None = None,
                  num_microbatches: int | None = None, state: dict | None = None, iteration: int | None = None,
                  pad_id: int = 0, num_workers: int = 0, lr_scale: str = "check", **loader_kwargs: Any) -> PlanIterator:
    """Megatron's external loader over ``plan`` (see the module docstring).

    ``rank``/``world_size``: the data-parallel rank and size (default: the process group; with
    tensor or pipeline parallelism pass Megatron's ``mpu.get_data_parallel_rank()`` and size).
    ``num_microbatches`` and Megatron's ``get_num_microbatches()`` (once its calculator is set up) are
    checked against the plan's ``grad_accum``. ``state`` (a ``state_dict()``) or ``iteration``
    (Megatron's ``args.iteration``) resumes. Other keyword arguments go to
    :func:`~varlen_cli.loader.dataloader_for_plan` (``lr_scale="ignore"``: a plan whose ``lr_scale``
    is not all 1 trained without ``VariableBatchSizeLR``).
    """
    plan = open_plan(plan)
    collate = THDCollate(pad_id) if plan.packing else BSHDCollate(pad_id)
    stream = PlanStream(dataset, plan, collate_fn=collate, rank=rank, world_size=world_size, num_workers=num_workers,
                        lr_scale=lr_scale, **loader_kwargs)
    if state is not None and iteration is not None:
        raise PlanError("plan_iterator takes state= or iteration=, not both")
    if iteration is not None:
        if stream.world_size != plan.dp:
            raise other_dp_error(plan, {"plan": plan.fingerprint, "step": int(iteration) - first_step(plan),
                                        "dp": plan.dp}, stream.world_size)
        state = iteration_state(plan, iteration)
    it = PlanIterator(stream, num_microbatches)
    it.check_num_microbatches()
    if state is not None:
        it.load_state_dict(state)
    return it
