"""Per-sample lengths (``--length KIND:PATH``, ``--target-length KIND:PATH``) computed with Arrow
compute and numpy. PATH is a column or a field nested in struct and list columns (:mod:`.paths`).

Kinds:

========  ===================================================================================
list      number of elements of a list column (token ids, frames)
tokens    tokens of a text column through a ``tokenizer.json`` (HF tokenizers, batched calls)
chars     Unicode characters of a text column
bytes     UTF-8 bytes of a text (or binary) column
words     whitespace-separated words of a text column
value     a numeric column as it is (precomputed token counts), or seconds times
          ``--frames-per-second`` rounded up (audio durations)
chat      tokens of a list of messages after the tokenizer's chat template (:mod:`.chat`)
========  ===================================================================================
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from ..errors import InputError, UsageError
from ..storage.files import check_regular
from .paths import FieldPath
from .paths import parse as parse_path

LENGTH_KINDS = ("list", "tokens", "chars", "bytes", "words", "value", "chat")
TEXT_KINDS = ("tokens", "chars", "bytes", "words")
TOKENIZE_BATCH = 8192
# A word is a run of non-whitespace, whitespace being exactly what Python's str.split() splits on
# (RE2's \s alone is ASCII only and misses \v, \x1c-\x1f, \x85 and the Unicode spaces).
WORD_PATTERN = r"[^\s\x{0b}\x{1c}-\x{1f}\x{85}\p{Z}]+"


@dataclass(frozen=True)
class LengthSpec:
    """``KIND:PATH``: ``column`` is the PATH's text (a column, or a nested field: :mod:`.paths`)."""

    kind: str
    column: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.column}"

    @property
    def path(self) -> FieldPath:
        return parse_path(self.column)


NOT_TOKENS = {"chars": "characters", "bytes": "bytes", "words": "words"}  # text lengths that are not tokens


def not_tokens(length: str) -> str | None:
    """What a metrics directory's lengths count when they are not tokens (``chars:text`` ->
    "characters"), else None: ``varlen plan --max-tokens N`` then budgets N of those."""
    return NOT_TOKENS.get(str(length).partition(":")[0])


def parse_length(text: str, option: str = "--length") -> LengthSpec:
    """``KIND:PATH`` of ``option``, checked (the kind, the path's syntax)."""
    kind, sep, column = text.partition(":")
    if not sep or not column or kind not in LENGTH_KINDS:
        raise UsageError(f"{option} must be KIND:PATH with KIND one of {', '.join(LENGTH_KINDS)}; got {text!r}")
    parse_path(column, f"{option} {text}")
    return LengthSpec(kind, column)


def auto_length(schema_names: Sequence[str], schema_types: dict, has_tokenizer: bool) -> LengthSpec:
    """The length a user most likely means when --length is not given."""
    import pyarrow as pa

    for name in ("input_ids", "tokens", "token_ids"):
        if name in schema_names and _is_list(schema_types[name]):
            return LengthSpec("list", name)
    if "text" in schema_names:
        return LengthSpec("tokens" if has_tokenizer else "chars", "text")
    for name in ("num_tokens", "length", "duration"):
        numeric = name in schema_names and (pa.types.is_integer(schema_types[name])
                                            or pa.types.is_floating(schema_types[name]))
        if numeric:
            return LengthSpec("value", name)
    raise UsageError(
        "cannot guess the length column; pass --length KIND:COLUMN (columns: " + ", ".join(schema_names) + ")"
    )


def _is_list(t) -> bool:
    import pyarrow as pa

    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) or (
        hasattr(pa.types, "is_list_view") and (pa.types.is_list_view(t) or pa.types.is_large_list_view(t))
    )


def _is_text(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t)
    )


def load_tokenizer(path: str):
    """A HF ``tokenizers.Tokenizer`` with truncation and padding switched off (for a directory:
    what counts tokens for its ``AutoTokenizer``, see :mod:`.hf_tokenizer`).

    Shipped tokenizer.json files often fix truncation and padding (at 128, say), which would make
    every length the same; lengths must be the true token counts.
    """
    from . import hf_tokenizer

    if hf_tokenizer.is_directory(path):
        return hf_tokenizer.counter(hf_tokenizer.load_auto(path))
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("--tokenizer needs the 'tokenizers' package: pip install 'varlen-cli[tokenizers]'") from None
    check_regular(path, "tokenizer file")
    if not os.path.isfile(path):
        raise InputError(f"tokenizer file or directory {path} does not exist")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path} is not a valid tokenizer.json: {first}") from None
    return hf_tokenizer.untruncated(tok)


def encode(tokenizer, texts: list, add_special_tokens: bool):
    fast = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    return fast(texts, add_special_tokens=add_special_tokens)


def token_lengths(tokenizer, column, add_special_tokens: bool = True, with_ids: bool = False):
    """Token counts of a text column (and the flat token ids when ``with_ids``)."""
    n = len(column)
    lengths = np.empty(n, dtype=np.int64)
    id_chunks = []
    for start in range(0, n, TOKENIZE_BATCH):
        texts = column.slice(start, TOKENIZE_BATCH).to_pylist()
        encodings = encode(tokenizer, texts, add_special_tokens)
        stop = start + len(texts)
        # map() iterates in C; len(Encoding) is implemented by the tokenizer itself.
        lengths[start:stop] = np.fromiter(map(len, encodings), dtype=np.int64, count=len(texts))
        if with_ids:
            ids = itertools.chain.from_iterable(map(attrgetter("ids"), encodings))
            id_chunks.append(np.fromiter(ids, dtype=np.int64, count=int(lengths[start:stop].sum())))
    if with_ids:
        return lengths, (np.concatenate(id_chunks) if id_chunks else np.zeros(0, np.int64))
    return lengths


def compute_lengths(column, spec: LengthSpec, where: str, tokenizer=None, add_special_tokens: bool = True,
                    frames_per_second: float | None = None, target: bool = False) -> np.ndarray:
    """Lengths (int64) of one Arrow column; ``where`` names the file in error messages; ``target``:
    ``spec`` is ``--target-length`` (whose seconds ``--target-frames-per-second`` converts)."""
    option = "--target-length" if target else "--length"
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray) and column.num_chunks == 1:
        column = column.chunk(0)  # several chunks (Arrow files) stay chunked: no copy of the values
    t = column.type
    if len(column) == 0:
        return np.zeros(0, dtype=np.int64)
    if column.null_count:
        raise InputError(f"column '{spec.column}' has {column.null_count} null values in {where}")
    kind = spec.kind
    if kind == "list":
        if not _is_list(t):
            raise InputError(f"{option} list:{spec.column} needs a list column, but '{spec.column}' is {t} in {where}")
        return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if kind == "value":
        return value_lengths(column, spec.column, where, frames_per_second,
                             "--target-frames-per-second" if target else "--frames-per-second")
    if kind == "chat":
        raise UsageError("--length chat:COLUMN needs --tokenizer DIR (a tokenizer with a chat template)")
    if kind == "bytes" and (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return pc.binary_length(column).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if not _is_text(t):
        raise InputError(f"{option} {kind}:{spec.column} needs a text column, but '{spec.column}' is {t} in {where}")
    if kind == "chars":
        out = pc.utf8_length(column)
    elif kind == "bytes":
        out = pc.binary_length(column)
    elif kind == "words":
        out = pc.count_substring_regex(column, pattern=WORD_PATTERN)
    else:  # tokens
        if tokenizer is None:
            raise UsageError("--length tokens:COLUMN needs --tokenizer FILE")
        return token_lengths(tokenizer, column, add_special_tokens)
    return out.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def numeric_values(column, name: str, where: str, what: str, as_float: bool = True) -> np.ndarray:
    """A numeric column as numpy (float64, or as stored when ``as_float`` is False), refusing nulls,
    NaN and negative values. One pass (the minimum) when the values are fine."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    t = column.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        raise InputError(f"{what} '{name}' must be numeric, but it is {t} in {where}")
    if column.null_count:
        raise InputError(f"column '{name}' has {column.null_count} null values in {where}")
    values = column.to_numpy(zero_copy_only=False)
    if len(values):
        low = values.min()  # NaN if any value is NaN
        if values.dtype.kind == "f" and np.isnan(low):
            raise InputError(f"column '{name}' has {int(np.isnan(values).sum())} NaN values in {where}")
        if low < 0:
            neg = values < 0
            raise InputError(f"column '{name}' has {int(neg.sum())} negative values in {where} (first: "
                             f"{values[neg][0]:g})")
        if values.dtype.kind == "f" and np.isinf(values.max()):
            raise InputError(f"column '{name}' has {int(np.isinf(values).sum())} infinite values in {where}")
    return values.astype(np.float64, copy=False) if as_float else values


INT64_MAX = np.iinfo(np.int64).max


def value_lengths(column, name: str, where: str, frames_per_second: float | None,
                  fps_option: str = "--frames-per-second") -> np.ndarray:
    values = numeric_values(column, name, where, "length column", as_float=False)
    if frames_per_second is not None:
        with np.errstate(over="ignore", invalid="ignore"):  # inf is refused just below, in one line
            values = np.ceil(values * frames_per_second - 1e-9)
        _check_fits_int64(values, name, where, f" after {fps_option} {frames_per_second:g}")
        return values.astype(np.int64)
    _check_fits_int64(values, name, where)
    if values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False)
    if not np.all(np.isfinite(values)) or np.any(values != np.floor(values)):
        raise InputError(
            f"length column '{name}' has fractional values in {where}; pass {fps_option} F "
            "to turn seconds into frames"
        )
    return values.astype(np.int64)


def _check_fits_int64(values: np.ndarray, name: str, where: str, how: str = "") -> None:
    """Lengths are int64: refuse values a cast would wrap to negative (uint64, or floats >= 2**63)."""
    if not len(values) or values.dtype.kind == "i":
        return
    big = values > INT64_MAX if values.dtype.kind == "u" else ~(values < 2.0**63)  # NaN/inf too
    if big.any():
        raise InputError(f"length column '{name}' has {int(big.sum())} values above 2**63-1{how} in {where} "
                         f"(first: {values[big][0]:.0f}); lengths must fit int64")


def check_frames_per_second(fps: float | None, option: str = "--frames-per-second") -> None:
    if fps is not None and (not math.isfinite(fps) or fps <= 0):
        raise UsageError(f"{option} must be a positive number, got {fps}")


TARGET_KINDS = tuple(k for k in LENGTH_KINDS if k != "chat")


def parse_target(text: str) -> LengthSpec:
    """``--target-length KIND:PATH`` (any kind but chat: ``assistant`` is the chat target, :mod:`.chat`)."""
    kind, sep, column = text.partition(":")
    if not sep or not column or kind not in TARGET_KINDS:
        raise UsageError(f"--target-length must be KIND:PATH with KIND one of {', '.join(TARGET_KINDS)}, or assistant "
                         f"(with --length chat:COLUMN); got {text!r}")
    return parse_length(text, "--target-length")
