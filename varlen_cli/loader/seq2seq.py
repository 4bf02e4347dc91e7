"""Encoder-decoder batches of a two-budget plan (``varlen plan --max-target-tokens``): what
:class:`~varlen_cli.loader.PadCollate` returns for a plan row with a ``target_seqlen``.

Each dataset item is a dict holding the source sequence under ``key`` (``input_ids``) and the target
sequence under ``target_key`` (``labels``: what ``tokenizer(source, text_target=target)`` returns),
the target holding exactly the tokens the metrics counted as its ``target_length`` (a microbatch whose
targets hold other than the plan row's ``target_tokens`` is refused in one line). The source is
padded to the plan's ``seqlen`` T (the encoder), the target to its ``target_seqlen`` T_target (the
decoder), the batch to its ``batch_size`` B:

* ``decoder_input_ids`` (B x T_target): ``decoder_start_token_id`` then the target shifted right
  (teacher forcing), ``pad_id`` after;
* ``labels`` (B x T_target): the target itself, -100 after it: position ``t`` predicts
  ``labels[t]`` from ``decoder_input_ids[: t + 1]``, so a target of L tokens has L loss targets and a
  step's targets are the plan's ``step_loss_tokens`` (the sum of the step's ``target_length``).

The label convention is ``"seq2seq"``: Hugging Face encoder-decoder models take these keys as they are
(:func:`~varlen_cli.loader.model_inputs.to_model_inputs`).
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from .batch import IGNORE_INDEX
from .microbatch import Microbatch

LABEL_CONVENTION = "seq2seq"


def pad_rows(arrays: list, lengths: np.ndarray, batch: int, seqlen: int, fill: int) -> np.ndarray:
    """``batch x seqlen`` int64: row i holds ``arrays[i]`` then ``fill`` (rows past the arrays: all ``fill``)."""
    n, total = len(arrays), int(lengths.sum())
    flat = np.concatenate(arrays).astype(np.int64, copy=False) if n else np.zeros(0, np.int64)
    starts = np.cumsum(lengths) - lengths
    # each token's index in the flattened B x T batch: row * T + position in its sample
    where = np.arange(total) + np.repeat(np.arange(n) * seqlen - starts, lengths)
    out = np.full(batch * seqlen, fill, dtype=np.int64)
    out[where] = flat
    return out.reshape(batch, seqlen)


def target_seqlen(info: Microbatch | None, lengths: np.ndarray, pad_multiple: int, required: bool) -> int:
    """The decoder side's T: the plan row's ``target_seqlen`` (the targets checked against it and their
    tokens against its ``target_tokens``, which ``step_loss_tokens`` sums per step), or without a
    plan row the longest target rounded up to ``pad_multiple``. ``required``: the collate was asked for
    encoder-decoder batches, which a plan made without ``--max-target-tokens`` cannot give."""
    longest = int(lengths.max()) if len(lengths) else 0
    if info is None:
        return max(-(-longest // pad_multiple) * pad_multiple, 1)
    if info.target_seqlen is None:
        if required:
            raise PlanError(f"step {info.step}: PadCollate(seq2seq=True) pads targets to the plan's target_seqlen, but "
                            "the plan has none: make it with `varlen plan --max-target-tokens M` (docs/plan.md, "
                            "\"Two budgets\")")
        return 0
    if longest > info.target_seqlen:
        i = int(np.argmax(lengths))
        raise PlanError(f"sample {int(info.sample_ids[i])} has a target of {longest} tokens but its microbatch (step "
                        f"{info.step}) is planned at target_seqlen {info.target_seqlen}: the plan was made for "
                        "different target lengths (another dataset, target column or tokenizer)")
    found = int(lengths.sum())
    if info.target_tokens is not None and found != info.target_tokens:  # else a wrong step_loss_tokens
        raise PlanError(f"step {info.step} micro {info.micro}: the targets of the microbatch's samples hold {found} "
                        f"tokens but the plan counted {info.target_tokens} (target_tokens): the dataset's targets "
                        "differ from what `varlen analyze --target-length` counted; tokenize them with the same "
                        "tokenizer and special tokens (EOS), or re-run `varlen analyze --target-length` and "
                        "`varlen plan` on this dataset")
    return int(info.target_seqlen)


def decoder_side(targets: list, lengths: np.ndarray, batch: int, seqlen: int, pad_id: int,
                 start_id: int) -> dict:
    """``decoder_input_ids``, ``decoder_attention_mask`` and ``labels`` (B x T_target) of the targets."""
    labels = pad_rows(targets, lengths, batch, seqlen, IGNORE_INDEX)
    lengths_b = np.zeros(batch, np.int64)
    lengths_b[:len(lengths)] = lengths
    real = np.arange(seqlen)[None, :] < lengths_b[:, None]
    inputs = np.full((batch, seqlen), pad_id, np.int64)
    inputs[:, 1:] = labels[:, :-1]
    inputs[:, 0] = start_id
    inputs[~real] = pad_id
    return {"decoder_input_ids": inputs, "decoder_attention_mask": real, "labels": labels}
