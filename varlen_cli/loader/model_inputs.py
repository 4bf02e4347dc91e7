"""Model-ready batches: one label convention across padded and packed batches, and ``to_model_inputs``.

Label conventions (``PadCollate(labels=...)``, ``PackedCollate(labels=...)``):

* ``"shifted"`` (default): ``labels[t]`` is the target of position ``t`` (the next token). For a
  loss you compute yourself, or for Hugging Face models as ``shift_labels``.
* ``"unshifted"`` (``model_shifts_labels=True``): ``labels[t]`` is the token at ``t`` itself, for
  models that shift internally (Hugging Face ``*ForCausalLM(labels=...)``); the first token of
  every sample (every packed entry) is ``-100``, so no target crosses a sample boundary.
* ``"seq2seq"`` (a two-budget plan's encoder-decoder batches, :mod:`varlen_cli.loader.seq2seq`):
  ``labels[t]`` is the target the decoder predicts at ``t`` from ``decoder_input_ids[: t + 1]``.

In both, ``loss_tokens`` and ``loss_mask`` count the real targets of the microbatch, and
``step_loss_tokens`` (also ``num_items_in_batch``) those of the whole step over all ranks and
micros: divide the summed token losses by it (times the world size under DDP's averaging).
"""

from __future__ import annotations

from typing import Literal

import torch

from .batch import IGNORE_INDEX, LabelMode, finish_batch, labels_mode
from .packed import block_causal_mask
from .position import POSITION_KEY

__all__ = ["BOOKKEEPING_KEYS", "IGNORE_INDEX", "LabelMode", "Style", "finish_batch", "labels_mode", "to_model_inputs"]

Style = Literal["hf", "flash", "sdpa"]

#: Keys of a collated batch that are bookkeeping, never model inputs.
BOOKKEEPING_KEYS = frozenset({
    "info", POSITION_KEY, "sample_ids", "num_samples", "num_tokens", "loss_tokens", "step_samples",
    "step_tokens", "step_loss_tokens", "num_items_in_batch", "loss_mask", "label_convention", "segment_ids",
    "cu_seqlens", "max_seqlen", "attention_mask_3d",
})


def is_packed(batch: dict) -> bool:
    return batch.get("cu_seqlens") is not None


def _unshift(shifted: torch.Tensor) -> torch.Tensor:
    """Labels for a model that shifts them itself, from next-token targets (the last column's target is lost)."""
    out = torch.full_like(shifted, IGNORE_INDEX)
    out[..., 1:] = shifted[..., :-1]
    return out


def to_model_inputs(batch: dict, style: Style = "hf", *, labels: bool = True, mask_dtype: torch.dtype = torch.float32,
                    keep: tuple = ()) -> dict:
    """The keyword arguments of a Hugging Face-style model call for one collated batch.

    Bookkeeping keys are dropped (``keep`` names any to pass anyway). Labels: ``labels`` for a
    model that shifts them; from a ``"shifted"`` batch also ``shift_labels`` (the exact targets,
    used by transformers' causal LM loss instead of shifting, so targets across ``--split-long``
    chunks survive). ``labels=False`` leaves them out.

    Padded batches: ``input_ids``, ``attention_mask`` (2D), labels, in every style. Encoder-decoder
    batches (label convention ``"seq2seq"``): those and ``decoder_input_ids``, ``decoder_attention_mask``.

    Packed batches never get the 2D mask (it would let samples in a row attend to each other):

    * ``"hf"``: ``input_ids``, ``position_ids`` restarting per sample (transformers detects the
      packing from them, for sdpa and eager attention), ``use_cache=False``;
    * ``"flash"``: the rows flattened to one ``1 x R*T`` sequence with ``position_ids``,
      ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32) and ``max_length_q``/``max_length_k`` (the
      flash-attention varlen kwargs of transformers), ``use_cache=False``;
    * ``"sdpa"``: ``input_ids``, ``position_ids`` and ``attention_mask`` as an additive float
      ``R x 1 x T x T`` block-diagonal causal mask (``mask_dtype``; 0 allowed, -inf elsewhere),
      right for any attention implementation that takes a 4D mask, eager included.
    """
    if style not in ("hf", "flash", "sdpa"):
        raise ValueError(f"style must be 'hf', 'flash' or 'sdpa', not {style!r}")
    out = {"input_ids": batch["input_ids"]}
    if batch.get("label_convention") == "seq2seq":  # encoder-decoder: the decoder's inputs, labels as they are
        out.update(attention_mask=batch["attention_mask"], decoder_input_ids=batch["decoder_input_ids"],
                   decoder_attention_mask=batch["decoder_attention_mask"])
        if labels:
            out["labels"] = batch["labels"]
        return {**out, **{key: batch[key] for key in keep}}
    if labels and batch.get("labels") is not None:
        if batch.get("label_convention", "shifted") == "shifted":
            out["labels"] = _unshift(batch["labels"])
            out["shift_labels"] = batch["labels"]
        else:
            out["labels"] = batch["labels"]
    if not is_packed(batch):
        out["attention_mask"] = batch["attention_mask"]
    else:
        out["position_ids"] = batch["position_ids"]
        out["use_cache"] = False
        if style == "flash":
            rows, seqlen = batch["input_ids"].shape
            for key in ("input_ids", "position_ids", "labels", "shift_labels"):
                if key in out:
                    out[key] = out[key].reshape(1, rows * seqlen)
            cu = batch["cu_seqlens"].to(torch.int32)
            out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(batch["max_seqlen"]),
                       max_length_k=int(batch["max_seqlen"]))
        elif style == "sdpa":
            out["attention_mask"] = block_causal_mask(batch["segment_ids"], dtype=mask_dtype)[:, None]
    for key in keep:
        out[key] = batch[key]
    return out
