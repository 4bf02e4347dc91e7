"""Packed collate: the samples of a packed microbatch into ``R x T`` rows with no padding between them.

A packed plan (``varlen plan --packing``, see ``docs/formats.md``) gives, for each microbatch, the
entries of its ``R`` rows: ``sample_ids`` with ``sample_lengths``, ``sample_rows`` and
``sample_starts``. Row ``r`` is the concatenation of the entries with ``sample_rows == r``, each
entry being tokens ``[start, start + length)`` of its sample; the rest of the row is padding.

:class:`PackedCollate` turns the dataset items of such a microbatch (as :class:`PlanDataset`
delivers them, with the plan row as ``.info``) into:

* ``input_ids`` ``R x T``; ``position_ids`` restarting at 0 for every entry (and for the padding
  tail of a row); ``segment_ids`` ``R x T`` int32, 1, 2, ... for the entries of a row and 0 on
  padding;
* ``cu_seqlens`` (int32) and ``max_seqlen`` over the flattened ``R * T`` tokens in the
  FlashAttention varlen convention: one segment per non-empty entry, plus one per padding tail, so
  ``cu_seqlens[-1] == R * T`` and ``flash_attn_varlen_func(q.view(R * T, H, D), ..., cu_seqlens,
  cu_seqlens, max_seqlen, max_seqlen, causal=True)`` runs directly on the flattened batch;
* ``labels`` / ``loss_mask`` that never cross an entry boundary, and the token counts for loss
  normalisation;
* optionally ``attention_mask_3d``: :func:`block_causal_mask` for backends without varlen
  kernels (``scaled_dot_product_attention(attn_mask=mask[:, None])``).

Imports only numpy and torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import PlanError
from .batch import IGNORE_INDEX, finish_batch, labels_mode
from .collate import sample_array


class PackedLayoutError(ValueError):
    """A packed microbatch does not fit its row length, or the dataset does not fit the plan."""


def packed_layout(sample_lengths, sample_rows, seq_len: int, rows: int) -> dict:
    """Positions of a packed microbatch, without the tokens (numpy arrays).

    Entries must be in row order (``sample_rows`` non-decreasing), as packed plans store them.
    Returns ``flat_index`` (int64, the first flattened ``row * T + column`` of each entry),
    ``position_ids`` and ``segment_ids`` (``rows x seq_len``), ``cu_seqlens`` (int32) and
    ``max_seqlen`` (see the module docstring), and ``row_tokens`` (real tokens per row).
    Zero-length entries occupy no token and get no segment.
    """
    lengths = np.asarray(sample_lengths, dtype=np.int64).reshape(-1)
    erow = np.asarray(sample_rows, dtype=np.int64).reshape(-1)
    n = len(lengths)
    if len(erow) != n:
        raise PackedLayoutError(f"packed microbatch: {n} sample lengths but {len(erow)} sample rows")
    if n and (erow.min() < 0 or erow.max() >= rows):
        raise PackedLayoutError(f"packed microbatch: a sample row is outside 0..{rows - 1}")
    if n and np.any(np.diff(erow) < 0):
        raise PackedLayoutError("packed microbatch: entries are not in row order")
    if n and lengths.min() < 0:
        raise PackedLayoutError("packed microbatch: negative sample length")
    row_tokens = np.bincount(erow, weights=lengths, minlength=rows).astype(np.int64)
    if rows and row_tokens.max(initial=0) > seq_len:
        r = int(np.argmax(row_tokens))
        raise PackedLayoutError(f"packed microbatch: row {r} holds {int(row_tokens[r])} tokens, more than "
                                f"the row length {seq_len}")
    csum = np.cumsum(lengths) - lengths  # exclusive prefix over all entries
    row_prefix = np.cumsum(row_tokens) - row_tokens  # tokens in the rows before each row
    col = csum - row_prefix[erow]  # column of each entry in its row
    flat_index = erow * seq_len + col

    # segments over the flattened rows: every non-empty entry, then each row's padding tail
    nz = lengths > 0
    pad = seq_len - row_tokens
    has_pad = pad > 0
    seg_start = np.concatenate((flat_index[nz], (np.arange(rows) * seq_len + row_tokens)[has_pad]))
    seg_len = np.concatenate((lengths[nz], pad[has_pad]))
    o = np.argsort(seg_start, kind="stable")
    seg_start, seg_len = seg_start[o], seg_len[o]
    cu = np.zeros(len(seg_len) + 1, dtype=np.int32)
    np.cumsum(seg_len, out=cu[1:])
    total = rows * seq_len
    # position ids: index within the segment (entries and padding tails alike)
    pos = np.arange(total, dtype=np.int64) - np.repeat(seg_start, seg_len)
    # real tokens: their entry and flattened position
    nl = lengths[nz]
    tok_entry = np.repeat(np.flatnonzero(nz), nl)
    tok_flat = np.repeat(flat_index[nz], nl) + (np.arange(len(tok_entry), dtype=np.int64) -
                                                np.repeat(np.cumsum(nl) - nl, nl))
    # segment ids: 1, 2, ... over the non-empty entries of a row, 0 on padding
    seg = np.zeros(total, dtype=np.int32)
    if n:
        row_first = np.searchsorted(erow, erow, side="left")  # first entry of each entry's row
        nz_before = np.cumsum(nz) - nz
        within = nz_before - nz_before[row_first]
        seg[tok_flat] = (within[tok_entry] + 1).astype(np.int32)
    return {
        "flat_index": flat_index,
        "token_flat": tok_flat,
        "token_entry": tok_entry,
        "position_ids": pos.reshape(rows, seq_len),
        "segment_ids": seg.reshape(rows, seq_len),
        "cu_seqlens": cu,
        "max_seqlen": int(seg_len.max()) if len(seg_len) else 0,
        "row_tokens": row_tokens,
    }


def block_causal_mask(segment_ids, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``R x T x T`` attention mask of packed rows: query ``i`` may attend key ``j`` iff both are in
    the same entry (equal non-zero segment id) and ``j <= i``. Padding queries attend to themselves
    only, so no softmax row is empty (no NaN); exclude them from the loss.

    ``dtype=None`` gives a boolean mask (True = may attend); a floating dtype gives an additive mask
    (0 where allowed, ``-inf`` elsewhere). Use ``scaled_dot_product_attention(q, k, v,
    attn_mask=mask[:, None])`` with ``q, k, v`` of shape ``R x H x T x D``. Memory is ``R * T * T``:
    prefer a varlen kernel with ``cu_seqlens`` for long rows.
    """
    seg = torch.as_tensor(segment_ids)
    if seg.dim() == 1:
        seg = seg[None]
    t = seg.shape[-1]
    pos = torch.arange(t, device=seg.device)
    causal = pos[None, :] <= pos[:, None]  # [query, key]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    mask = (same & causal[None]) | torch.eye(t, dtype=torch.bool, device=seg.device)[None]
    if dtype is None or dtype == torch.bool:
        return mask
    out = torch.zeros(mask.shape, dtype=dtype, device=seg.device)
    return out.masked_fill_(~mask, float("-inf"))


def _info_fields(info: Any, n: int):
    lengths = getattr(info, "sample_lengths", None)
    rows = getattr(info, "sample_rows", None)
    if lengths is None or rows is None:
        raise PackedLayoutError("this plan is not packed (no sample_lengths / sample_rows): use PadCollate, "
                                "or make the plan with `varlen plan --packing`")
    starts = getattr(info, "sample_starts", None)
    starts = np.zeros(n, dtype=np.int64) if starts is None else np.asarray(starts, dtype=np.int64)
    return np.asarray(lengths, dtype=np.int64), np.asarray(rows, dtype=np.int64), starts


def collate_packed(samples: Sequence[Any], sample_lengths, sample_rows, sample_starts=None, *, seq_len: int,
                   rows: int, sample_ids=None, pad_id: int = 0, key: str = "input_ids", shift_labels: bool = True,
                   attention_mask_3d: bool = False, dtype: torch.dtype = torch.long) -> dict:
    """Collate the items of one packed microbatch (one item per entry, in entry order).

    Each item is the *whole* sample's token ids (list, numpy array, 1-D tensor, or a dict holding
    them under ``key``); entry ``i`` takes tokens ``[sample_starts[i], sample_starts[i] +
    sample_lengths[i])`` of item ``i``. See :class:`PackedCollate` for the returned dict.
    """
    lengths = np.asarray(sample_lengths, dtype=np.int64).reshape(-1)
    n = len(lengths)
    starts = np.zeros(n, dtype=np.int64) if sample_starts is None else np.asarray(sample_starts, dtype=np.int64)
    if len(samples) != n or len(starts) != n:
        raise PackedLayoutError(f"packed microbatch: {n} planned entries but {len(samples)} dataset items")
    lay = packed_layout(lengths, sample_rows, seq_len, rows)
    arrays = [sample_array(item, key) for item in samples]
    full = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=n)
    ends = starts + lengths
    # an entry must lie inside its sample; an unsplit entry (start 0, sample fits a row) must be the sample
    bad = (ends > full) | ((starts == 0) & (full <= seq_len) & (full != lengths))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        sid = int(sample_ids[i]) if sample_ids is not None else i
        raise PackedLayoutError(
            f"sample {sid} has {int(full[i])} tokens but the plan packs tokens {int(starts[i])}..{int(ends[i])} of "
            f"it: the plan was made for different lengths (another dataset, column or tokenizer)")
    # next token after each entry, when the sample continues (split chunks): the chunk's last label
    nxt = np.full(n, IGNORE_INDEX, dtype=np.int64)
    flat_tokens = np.concatenate([a[s:e] for a, s, e in zip(arrays, starts.tolist(), ends.tolist())]) if n else \
        np.zeros(0, dtype=np.int64)
    cont = np.flatnonzero((ends < full) & (lengths > 0))
    for i in cont.tolist():  # only split chunks: a handful per microbatch
        nxt[i] = int(arrays[i][ends[i]])
    total = rows * seq_len
    ids = np.full(total, pad_id, dtype=np.int64)
    ids[lay["token_flat"]] = flat_tokens
    labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
    tf, te = lay["token_flat"], lay["token_entry"]
    if len(tf):
        last = np.zeros(len(tf), dtype=bool)  # last token of each non-empty entry
        last[np.cumsum(lengths[lengths > 0]) - 1] = True
        if shift_labels:
            labels[tf[~last]] = ids[tf[~last] + 1]
            labels[tf[last]] = nxt[te[last]]
        else:
            first = np.zeros(len(tf), dtype=bool)
            first[np.cumsum(lengths[lengths > 0]) - lengths[lengths > 0]] = True
            labels[tf] = ids[tf]
            labels[tf[first]] = IGNORE_INDEX
    labels_t = torch.from_numpy(labels.reshape(rows, seq_len))
    out = {
        "input_ids": torch.from_numpy(ids.reshape(rows, seq_len)).to(dtype),
        "position_ids": torch.from_numpy(lay["position_ids"]),
        "segment_ids": torch.from_numpy(lay["segment_ids"]),
        "attention_mask": torch.from_numpy(lay["segment_ids"] != 0),
        "cu_seqlens": torch.from_numpy(lay["cu_seqlens"]),
        "max_seqlen": lay["max_seqlen"],
        "labels": labels_t,
        "loss_mask": labels_t != IGNORE_INDEX,
        "sample_ids": torch.from_numpy(np.array(sample_ids, dtype=np.int64)) if sample_ids is not None else None,
        "num_samples": n,
        "num_tokens": int(lengths.sum()),
        "loss_tokens": int(np.count_nonzero(labels != IGNORE_INDEX)),
    }
    if attention_mask_3d:
        out["attention_mask_3d"] = block_causal_mask(out["segment_ids"])
    return out


class PackedCollate:
    """Collate function for packed plans: use with :class:`PlanDataset` (``dataloader_for_plan(dataset,
    plan, collate_fn=PackedCollate())``), which hands it each microbatch's items with the plan row.

    Returns a dict: ``input_ids`` (R x T), ``position_ids`` (R x T, restarting at 0 per entry),
    ``segment_ids`` (R x T int32, 0 on padding), ``attention_mask`` (``segment_ids != 0``),
    ``cu_seqlens`` (int32, over the flattened R*T tokens, padding tails as their own segments) and
    ``max_seqlen`` for varlen kernels, ``labels`` (next-token targets with ``shift_labels``: the
    last token of a ``--split-long`` chunk gets the first token of the next chunk; without
    ``shift_labels``, the input ids with the first token of each entry masked, for models that
    shift internally; ``-100`` wherever there is no target), ``loss_mask``, ``sample_ids``, the counts
    ``num_samples``, ``num_tokens`` and ``loss_tokens``, and from the plan ``step_samples``,
    ``step_tokens``, ``step_loss_tokens`` (the plan's exact count of the step's targets,
    :attr:`Microbatch.step_targets`) and ``info``; with ``attention_mask_3d`` also the
    R x T x T :func:`block_causal_mask`.
    """

    def __init__(self, pad_id: int = 0, key: str = "input_ids", shift_labels: bool = True,
                 attention_mask_3d: bool = False, dtype: torch.dtype = torch.long, labels: str | None = None,
                 model_shifts_labels: bool | None = None):
        self.pad_id = pad_id
        self.key = key
        self.labels = labels_mode(shift_labels, labels, model_shifts_labels)
        self.shift_labels = self.labels == "shifted"
        self.attention_mask_3d = attention_mask_3d
        self.dtype = dtype

    def __call__(self, samples: Sequence[Any]) -> dict:
        info = getattr(samples, "info", None)
        if info is None:
            raise PackedLayoutError("PackedCollate needs the plan row of each microbatch: wrap the dataset in "
                                    "PlanDataset (dataloader_for_plan does)")
        lengths, rows, starts = _info_fields(info, len(samples))
        if not self.shift_labels and np.any(starts > 0):
            raise PlanError(f"step {info.step}: labels='unshifted' cannot keep the target across a --split-long "
                            f"chunk boundary (the model shifts within a row); collate with labels='shifted' (Hugging "
                            f"Face models take them as shift_labels: to_model_inputs does it)")
        out = collate_packed(samples, lengths, rows, starts, seq_len=int(info.seqlen), rows=int(info.batch_size),
                             sample_ids=info.sample_ids, pad_id=self.pad_id, key=self.key,
                             shift_labels=self.shift_labels, attention_mask_3d=self.attention_mask_3d,
                             dtype=self.dtype)
        out["step_samples"] = info.step_samples
        out["step_tokens"] = info.step_tokens
        # targets in the whole step, in either label convention (exact: counted from the lengths)
        out["step_loss_tokens"] = info.step_targets
        return finish_batch(out, info, self.labels)
