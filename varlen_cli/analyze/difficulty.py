"""Per-sample difficulty (``--difficulty``): the key a curriculum sorts on.

* ``length`` (default): the sample's length.
* ``value:COLUMN``: a numeric column (a loss, a score, a quality estimate).
* ``vocab-rarity``: the mean negative log unigram probability of the sample's tokens, with
  unigram counts summed over all workers (DeepSpeed's data-efficiency "vocabulary rarity").
  A two-pass metric: counts first, then the per-sample means.
* ``MODULE:FUNCTION``: a user function mapping an Arrow RecordBatch to one value per row. This is
  the only user code varlen ever runs, and only when named explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError, UsageError
from ..runtime import user_code


@dataclass(frozen=True)
class DifficultySpec:
    kind: str  # length | value | vocab-rarity | function
    column: str = ""  # value: the column; function: "module:function"

    def __str__(self) -> str:
        return {"length": "length", "vocab-rarity": "vocab-rarity", "value": f"value:{self.column}"}.get(
            self.kind, self.column
        )


def parse_difficulty(text: str) -> DifficultySpec:
    if text in ("length", "vocab-rarity"):
        return DifficultySpec(text)
    head, sep, tail = text.partition(":")
    if sep and head == "value" and tail:
        return DifficultySpec("value", tail)
    if sep and head and tail and all(p.isidentifier() for p in head.split(".")) and tail.isidentifier():
        return DifficultySpec("function", text)
    raise UsageError(
        f"--difficulty must be length, value:COLUMN, vocab-rarity or MODULE:FUNCTION; got {text!r}"
    )


def load_function(spec: DifficultySpec):
    return user_code.load_function(spec.column, "--difficulty")


def call_function(fn, spec: DifficultySpec, batch, where: str) -> np.ndarray:
    """The user function's values for one RecordBatch, checked: one finite number per row."""
    name = f"difficulty function {spec.column}"
    try:
        out = fn(batch)
    except (Exception, SystemExit) as exc:  # sys.exit() in user code must not end varlen with its code
        raise InputError(f"{name} raised {user_code.describe(exc)} (on {where})") from None
    try:
        if hasattr(out, "to_numpy"):
            out = out.to_numpy(zero_copy_only=False) if "pyarrow" in type(out).__module__ else out.to_numpy()
        values = np.asarray(out, dtype=np.float64)
    except OverflowError:
        raise InputError(f"{name} returned a number too large for float64 (on {where})") from None
    except (TypeError, ValueError) as exc:
        raise InputError(f"{name} must return numbers, got {type(out).__name__}: {_first_line(exc)}") from None
    if values.ndim != 1:
        raise InputError(f"{name} returned an array of shape {values.shape} for {batch.num_rows} rows; "
                         f"expected shape ({batch.num_rows},) (on {where})")
    if len(values) != batch.num_rows:
        raise InputError(f"{name} returned {len(values)} values for {batch.num_rows} rows (on {where})")
    nan = np.isnan(values)
    if nan.any():
        raise InputError(f"{name} returned NaN for {int(nan.sum())} rows (on {where})")
    inf = np.isinf(values)
    if inf.any():
        raise InputError(f"{name} returned infinite values for {int(inf.sum())} rows (on {where})")
    return values


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def rarity(lengths: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Mean of -log p(token) per sample, p from the global unigram ``counts``; 0 for empty samples."""
    total = counts.sum()
    if total == 0:
        return np.zeros(len(lengths))
    neg_logp = np.log(float(total)) - np.log(counts[ids].astype(np.float64))
    # Per-sample sums with reduceat over the non-empty samples: each sum only depends on the
    # sample's own tokens (not on where a work unit starts, as differences of a running sum would).
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    nonempty = lengths > 0
    sums = np.zeros(len(lengths))
    if nonempty.any():
        sums[nonempty] = np.add.reduceat(neg_logp, starts[nonempty])
    return np.divide(sums, lengths, out=np.zeros(len(lengths)), where=nonempty)
