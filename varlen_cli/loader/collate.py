"""Padding collate: samples of one microbatch to a ``B x T`` batch at the plan's shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import PlanError
from .batch import IGNORE_INDEX, finish_batch, labels_mode
from .fetch import FetchOrder
from .microbatch import Microbatch
from .seq2seq import LABEL_CONVENTION as SEQ2SEQ
from .seq2seq import decoder_side, pad_rows, target_seqlen


class Samples(list):
    """The dataset items of one microbatch, with the plan row as ``.info`` (see :class:`PlanDataset`)."""

    info: Microbatch | None

    def __init__(self, items, info: Microbatch | None = None):
        super().__init__(items)
        self.info = info


class PlanDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset so that the collate function receives the microbatch's plan row.

    ``DataLoader`` calls ``__getitems__`` with the sampler's :class:`MicrobatchIndices`; this
    returns the items as :class:`Samples` carrying the same ``.info``. Indexing and ``len()``
    pass through to the wrapped dataset (its own ``__getitems__`` is used when it has one).
    """

    def __init__(self, dataset, check_order: bool = True):
        self.dataset = dataset
        self.check_order = check_order
        self._fetched = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> Samples:
        if self.check_order:  # a wrapper that re-shards or reorders the batch sampler fails here (fetch.py)
            if self._fetched is None:
                self._fetched = FetchOrder()
            self._fetched.check(indices)
        prefetch, ahead = getattr(self.dataset, "prefetch", None), getattr(indices, "ahead", None)
        if prefetch is not None and ahead:  # read-ahead hook (SourceDataset): the next microbatches' ids
            prefetch(np.concatenate(ahead))
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(indices) if getitems else [self.dataset[i] for i in indices]  # a list, with its .info
        return Samples(items, getattr(indices, "info", None))


def sample_array(item: Any, key: str) -> np.ndarray:
    """One sample's tokens as a flat numpy array (``item[key]`` for a dict sample)."""
    if isinstance(item, dict):
        item = item[key]
    if isinstance(item, torch.Tensor):
        return item.detach().cpu().numpy().reshape(-1)
    return np.asarray(item).reshape(-1)


def causal_padding_mask(lengths, seqlen: int, batch_size: int | None = None) -> torch.Tensor:
    """A ``B x T x T`` boolean mask (True = may attend): causal, and keys limited to real tokens.

    Padding positions (and every position of a padding row) attend to themselves only, so that
    softmax over a row never sees all ``-inf`` (no NaN); their outputs are excluded from the loss.
    Use with ``scaled_dot_product_attention(attn_mask=mask[:, None])``.
    """
    lengths = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
    b = len(lengths) if batch_size is None else batch_size
    if b > len(lengths):
        lengths = torch.cat([lengths, torch.zeros(b - len(lengths), dtype=torch.int64)])
    pos = torch.arange(seqlen)
    causal = pos[None, :] <= pos[:, None]  # [query, key]
    key_real = pos[None, :] < lengths[:, None]  # B x T
    mask = causal[None] & key_real[:, None, :]
    return mask | torch.eye(seqlen, dtype=torch.bool)[None]


class PadCollate:
    """Collate the samples of a microbatch into padded tensors at the plan's shape.

    Each item is a sequence of token ids (list, numpy array or 1-D tensor) or a dict holding one
    under ``key``. With a plan row (``Samples.info``, set by :class:`PlanDataset`) the batch is
    padded to the plan's ``seqlen`` T and ``batch_size`` B (for static-shape plans B can exceed
    the sample count: the extra rows are padding rows, fully masked); without one, to the longest
    sample rounded up to ``pad_multiple`` and to the number of samples.

    Returns a dict:

    ``input_ids`` (B x T long), ``attention_mask`` (B x T bool, True on real tokens),
    ``labels`` (B x T long: next-token targets with ``shift_labels``, else the input ids; ``-100``
    wherever there is no target), ``loss_mask`` (``labels != -100``), ``position_ids`` (B x T),
    ``sample_ids`` (B long, -1 on padding rows), optionally ``attention_mask_3d`` (B x T x T bool,
    see :func:`causal_padding_mask`), and the counts ``num_samples``, ``num_tokens`` (real tokens),
    ``loss_tokens`` (targets in this microbatch) and, from the plan, ``step_samples``,
    ``step_tokens`` and ``step_loss_tokens`` (targets in the whole step over all ranks and micros,
    :attr:`Microbatch.step_targets`:
    divide the summed token losses by it, times the world size under DDP's gradient averaging,
    to get the exact per-token mean of the step with no extra communication), plus ``info``.

    Encoder-decoder batches (:mod:`varlen_cli.loader.seq2seq`): for a plan row with a
    ``target_seqlen`` (``varlen plan --max-target-tokens``), or any batch with ``seq2seq=True``, each
    item is a dict with the source under ``key`` and the target under ``target_key``; the source is
    the encoder's ``input_ids``/``attention_mask`` (B x T), the target padded to ``target_seqlen``:
    ``decoder_input_ids`` (``decoder_start_token_id``, default ``pad_id``, then the target shifted
    right), ``decoder_attention_mask`` and ``labels`` (the target, -100 after it), all B x T_target;
    ``loss_tokens`` counts the targets, ``step_loss_tokens`` those of the step.
    """

    def __init__(self, pad_id: int = 0, key: str = "input_ids", shift_labels: bool = True,
                 attention_mask_3d: bool = False, pad_multiple: int = 1, dtype: torch.dtype = torch.long,
                 labels: str | None = None, model_shifts_labels: bool | None = None, *, seq2seq: bool = False,
                 target_key: str = "labels", decoder_start_token_id: int | None = None):
        if pad_multiple < 1:
            raise ValueError("pad_multiple must be >= 1")
        self.pad_id = pad_id
        self.key = key
        self.labels = labels_mode(shift_labels, labels, model_shifts_labels)
        self.shift_labels = self.labels == "shifted"
        self.attention_mask_3d = attention_mask_3d
        self.pad_multiple = pad_multiple
        self.dtype = dtype
        self.seq2seq = seq2seq
        self.target_key = target_key
        self.decoder_start_token_id = pad_id if decoder_start_token_id is None else decoder_start_token_id

    def _shape(self, info: Microbatch | None, lengths: np.ndarray) -> tuple[int, int]:
        """``(T, B)`` of the batch: the plan row's (its samples checked against it), else the longest sample's."""
        n = len(lengths)
        longest = int(lengths.max()) if n else 0
        if info is None:
            return -(-longest // self.pad_multiple) * self.pad_multiple, n
        if info.sample_rows is not None:
            raise PlanError(f"step {info.step} comes from a packed plan (--packing): collate it with "
                            f"varlen_cli.loader.packed.PackedCollate, not PadCollate")
        if n != info.num_samples:
            raise PlanError(f"step {info.step} micro {info.micro}: the plan has {info.num_samples} samples, "
                            f"the collate received {n}")
        if longest > info.seqlen:
            i = int(np.argmax(lengths))
            raise PlanError(f"sample {int(info.sample_ids[i])} has {longest} tokens but its microbatch "
                            f"(step {info.step}) is planned at seqlen {info.seqlen}: the plan was made for "
                            f"different lengths (another dataset, column or tokenizer)")
        if int(lengths.sum()) != info.tokens:  # shorter items would make step_loss_tokens wrong
            ids = ", ".join(str(int(i)) for i in info.sample_ids[:4]) + (", ..." if n > 4 else "")
            raise PlanError(f"step {info.step} micro {info.micro}: the dataset items of samples {ids} hold "
                            f"{int(lengths.sum())} tokens but the plan counted {info.tokens}: the plan was made "
                            f"for different lengths (another dataset, column or tokenizer)")
        return info.seqlen, max(info.batch_size, n)

    def __call__(self, samples: Sequence[Any]) -> dict:
        info: Microbatch | None = getattr(samples, "info", None)
        arrays = [sample_array(item, self.key) for item in samples]  # one per sample of the microbatch
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        n = len(arrays)
        seqlen, batch = self._shape(info, lengths)
        total = int(lengths.sum())
        ids = pad_rows(arrays, lengths, batch, seqlen, self.pad_id)
        lengths_b = np.zeros(batch, dtype=np.int64)
        lengths_b[:n] = lengths
        pos = np.arange(seqlen)
        attention = pos[None, :] < lengths_b[:, None]
        sample_ids = np.full(batch, -1, dtype=np.int64)
        if info is not None:
            sample_ids[:n] = info.sample_ids
        out = {"input_ids": torch.from_numpy(ids) if self.dtype == torch.long else torch.from_numpy(ids).to(self.dtype),
               "attention_mask": torch.from_numpy(attention), "position_ids": _positions(batch, seqlen),
               "sample_ids": torch.from_numpy(sample_ids), "num_samples": n, "num_tokens": total, "info": info,
               "step_samples": None, "step_tokens": None, "step_loss_tokens": None}
        if info is not None:
            out["step_samples"] = info.step_samples
            out["step_tokens"] = info.step_tokens
            # targets in the whole step, in either label convention (exact: counted from the lengths)
            out["step_loss_tokens"] = info.step_targets
        if self.seq2seq or (info is not None and info.target_seqlen is not None):
            return self._decoder(samples, info, batch, out)
        if self.shift_labels:
            labels = np.full((batch, seqlen), IGNORE_INDEX, dtype=np.int64)
            labels[:, :-1] = ids[:, 1:]
            labels[pos[None, :] >= lengths_b[:, None] - 1] = IGNORE_INDEX
        else:  # unshifted (the model shifts): the first token of each sample is never a target
            labels = np.where(attention, ids, IGNORE_INDEX)
            labels[:, 0] = IGNORE_INDEX
        out.update(labels=torch.from_numpy(labels), loss_mask=torch.from_numpy(labels != IGNORE_INDEX),
                   loss_tokens=total - int(np.count_nonzero(lengths)))
        if self.attention_mask_3d:
            out["attention_mask_3d"] = causal_padding_mask(lengths, seqlen, batch)
        return finish_batch(out, info, self.labels)

    def _decoder(self, samples: Sequence[Any], info: Microbatch | None, batch: int, out: dict) -> dict:
        """The encoder-decoder batch's decoder side (:mod:`varlen_cli.loader.seq2seq`)."""
        bad = next((i for i, item in enumerate(samples) if not isinstance(item, dict) or self.target_key not in item),
                   None)
        if bad is not None:
            who = f"sample {int(info.sample_ids[bad])}" if info is not None else f"item {bad}"
            raise PlanError(f"an encoder-decoder batch (a plan with target_seqlen, or seq2seq=True) needs dataset "
                            f"items that are dicts holding the source under {self.key!r} and the target under "
                            f"{self.target_key!r}; {who} has no {self.target_key!r}")
        targets = [sample_array(item, self.target_key) for item in samples]
        lengths = np.fromiter((len(a) for a in targets), dtype=np.int64, count=len(targets))
        seqlen = target_seqlen(info, lengths, self.pad_multiple, required=self.seq2seq)
        side = decoder_side(targets, lengths, batch, seqlen, self.pad_id, self.decoder_start_token_id)
        out.update({name: torch.from_numpy(values) for name, values in side.items()})
        out["loss_mask"] = out["decoder_attention_mask"].clone()
        out["loss_tokens"] = int(lengths.sum())
        if self.attention_mask_3d:
            out["attention_mask_3d"] = causal_padding_mask(lengths, seqlen, batch)  # the decoder's self-attention
        return finish_batch(out, info, SEQ2SEQ)


_POSITIONS: dict = {}


def _positions(batch: int, seqlen: int) -> torch.Tensor:
    """``B x T`` position ids (a read-only expanded view of one cached ``arange`` per T)."""
    row = _POSITIONS.get(seqlen)
    if row is None:
        row = _POSITIONS[seqlen] = torch.arange(seqlen)
    return row.expand(batch, seqlen)


def pad_collate(samples: Sequence[Any]) -> dict:
    """:class:`PadCollate` with its defaults (pad id 0, shifted next-token labels)."""
    return PadCollate()(samples)
