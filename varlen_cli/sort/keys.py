"""Sort keys for ``varlen sort``: the composite key as packed integers, local sorting, exact splitters.

Pure numpy, no process group: every function that needs global knowledge takes it as an argument,
so the tests can run many simulated ranks in one process.

The composite key of a row is its ``--by`` columns, then the tie-break (``sample_id``, or a seeded
bijective hash of it with ``--ties shuffle``). It is a total order on the rows (sample ids are
unique), so any correct sort gives the same global order, whatever the number of workers.

Each key column becomes an unsigned *code* whose order is the wanted order (floats that hold only
integers are coded as integers; other floats by their IEEE bits; ``--descending`` complements the
code; NaN, with ``--nan last``, sets a flag bit above the code). The codes are shifted to start at
the global minimum, so each field takes only the bits its global range needs, and the fields are
concatenated into the fewest 64-bit words (one word in the common case: an integral difficulty and
a sample id). Words are stored as int64 with the top bit flipped, so their signed order is the
unsigned order of the packed bits (torch sorts int64, not uint64).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError, InternalConsistencyError

_SIGN = np.uint64(1 << 63)
_EXACT_FLOAT_INT = float(1 << 53)  # floats that are integers up to here are coded exactly as int64
U64_MAX = (1 << 64) - 1


# -- hashing -------------------------------------------------------------------------------------
def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, a bijection of uint64 (vectorised, wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def shuffle_hash(sample_id: np.ndarray, seed: int) -> np.ndarray:
    """The ``--ties shuffle`` order of ``sample_id``: a pure function of (sample_id, seed).

    For a fixed seed it is a bijection of the 64-bit ids, so it never ties and needs no further
    tie-break.
    """
    salt = splitmix64(np.array([int(seed) & U64_MAX], dtype=np.uint64))[0]
    return splitmix64(np.asarray(sample_id).astype(np.int64, copy=False).view(np.uint64) ^ salt)


# -- ordinals: each key column as an order-preserving uint64 ---------------------------------------
def ordinal(values: np.ndarray, integral: bool) -> np.ndarray:
    """A new uint64 array whose unsigned order is the order of ``values`` (NaN rows: arbitrary).

    ``integral`` (floats only, decided over all ranks): code the floats as int64; else by their
    IEEE bits (-0.0 as 0.0).
    """
    kind = values.dtype.kind
    if kind in "bu":
        return values.astype(np.uint64)
    if kind == "i":
        u = values.astype(np.int64).view(np.uint64)
        u ^= _SIGN
        return u
    if kind == "f":
        if integral:
            with np.errstate(invalid="ignore"):
                u = values.astype(np.int64).view(np.uint64)
            u ^= _SIGN
            return u
        bits = (values.astype(np.float64, copy=False) + 0.0).view(np.int64)  # + 0.0: -0.0 becomes 0.0
        # Negative floats: flip the magnitude bits so that larger magnitudes sort lower.
        np.bitwise_xor(bits, np.int64(0x7FFFFFFFFFFFFFFF), out=bits, where=bits < 0)
        u = bits.view(np.uint64)
        u ^= _SIGN
        return u
    raise TypeError(f"cannot order values of dtype {values.dtype}")


def from_ordinal(u: np.ndarray, dtype: np.dtype, integral: bool) -> np.ndarray:
    """The inverse of :func:`ordinal` for integer, boolean and integral float columns (in place
    on ``u`` where it can)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return u.astype(bool)
    if dtype.kind == "u":
        return u.astype(dtype, copy=False)
    u ^= _SIGN
    ints = u.view(np.int64)
    if dtype.kind == "i":
        return ints.astype(dtype, copy=False)
    if not (dtype.kind == "f" and integral):
        raise InternalConsistencyError(f"cannot decode sort keys as {dtype} (integral={integral})")
    return ints.astype(dtype)


# -- fields and their global ranges --------------------------------------------------------------
@dataclass
class FieldStats:
    """What one rank knows about one key column; :func:`merge_stats` combines the ranks'."""

    column: str
    dtype: str
    count: int = 0
    nan: int = 0
    first_nan_id: int | None = None  # smallest sample_id with a NaN key, for the error message
    integral: bool = True  # floats: every non-NaN value is an integer of magnitude <= 2**53
    negzero: bool = False  # floats: some value is -0.0
    vmin: Any = None  # smallest and largest non-NaN values (None: no such value)
    vmax: Any = None
    umin: int = 0  # set by merge_stats: the ordinals of vmin and vmax
    umax: int = 0

    @property
    def has_values(self) -> bool:
        return self.vmin is not None


def _column_stats(name: str, values: np.ndarray, ids: np.ndarray | None) -> FieldStats:
    s = FieldStats(column=name, dtype=values.dtype.str, count=len(values))
    if not len(values):
        return s
    mn, mx = values.min(), values.max()
    if values.dtype.kind != "f":
        s.vmin, s.vmax = mn.item(), mx.item()
        return s
    w = values
    if np.isnan(mn) or np.isnan(mx):  # NaN propagates through min and max
        nan = np.isnan(values)
        s.nan = int(nan.sum())
        if ids is not None:
            s.first_nan_id = int(ids[nan].min())
        w = values[~nan]
        del nan
        if not len(w):
            return s
        mn, mx = w.min(), w.max()
    s.vmin, s.vmax = float(mn), float(mx)
    s.integral = bool(abs(s.vmin) <= _EXACT_FLOAT_INT and abs(s.vmax) <= _EXACT_FLOAT_INT)
    if s.integral:
        s.integral = bool((w.astype(np.int64) == w).all())
    if s.vmin <= 0.0 <= s.vmax:
        s.negzero = bool(np.signbit(w[w == 0]).any())
    return s


def local_stats(spec: KeySpec, columns: dict) -> list[FieldStats]:
    """This rank's stats of each ``by`` column, then of ``sample_id`` when it is the tie-break."""
    ids = columns.get("sample_id")
    out = [_column_stats(name, columns[name], ids) for name in spec.by]
    if spec.tie_column is not None and spec.ties == "id":
        out.append(_column_stats("sample_id", ids, None))
    return out


def merge_stats(per_rank: Sequence[Sequence[FieldStats]]) -> list[FieldStats]:
    """Combine every rank's field stats (same fields on every rank) into the global ones."""
    out = []
    for fields in zip(*per_rank):
        g = FieldStats(column=fields[0].column, dtype=fields[0].dtype)
        for s in fields:
            g.count += s.count
            g.nan += s.nan
            if s.first_nan_id is not None:
                g.first_nan_id = s.first_nan_id if g.first_nan_id is None else min(g.first_nan_id, s.first_nan_id)
            g.negzero = g.negzero or s.negzero
            if s.has_values:
                g.integral = g.integral and s.integral
                g.vmin = s.vmin if g.vmin is None else min(g.vmin, s.vmin)
                g.vmax = s.vmax if g.vmax is None else max(g.vmax, s.vmax)
        if g.has_values:
            u = ordinal(np.array([g.vmin, g.vmax], dtype=np.dtype(g.dtype)), g.integral)
            g.umin, g.umax = int(u[0]), int(u[1])
        out.append(g)
    return out


@dataclass(frozen=True)
class KeySpec:
    """The composite key: ``by`` columns, direction, tie-break and NaN policy."""

    by: tuple
    descending: bool = False
    ties: str = "id"  # "id" or "shuffle"
    seed: int = 0
    nan: str = "error"  # "error" or "last"

    @property
    def tie_column(self) -> str | None:
        """The hidden last field: None when ``sample_id`` already is a key with ``--ties id``."""
        if self.ties == "id" and "sample_id" in self.by:
            return None
        return "sample_id"


def check_nans(spec: KeySpec, stats: list[FieldStats], where: str) -> None:
    if spec.nan == "last":
        return
    for name, s in zip(spec.by, stats):
        if s.nan:
            first = f" (the first is sample_id {s.first_nan_id})" if s.first_nan_id is not None else ""
            raise InputError(f"key column '{name}' has {s.nan:,} NaN values in {where}{first}; "
                             f"pass --nan last to put them at the end")


@dataclass
class KeyLayout:
    """How the fields are packed: (column, bits, kind) per field, most significant first.

    kind: "nan" (1 bit, set for NaN keys), "key" (a --by column's code), "id" (sample_id minus the
    smallest sample_id) or "hash" (the --ties shuffle hash, 64 bits).
    """

    fields: list = field(default_factory=list)
    bits: int = 0

    @property
    def words(self) -> int:
        return max(1, -(-self.bits // 64))

    @property
    def top_bits(self) -> int:
        """Bits used in the most significant word."""
        return self.bits - 64 * (self.words - 1) if self.bits else 0

    @property
    def id_last(self) -> bool:
        """True when the least significant field is sample_id - min(sample_id) (a one-word key's
        low bits then give back the sample id)."""
        return bool(self.fields) and self.fields[-1][2] == "id"

    def position(self, index: int) -> int:
        """Bit position (from the bottom of the whole bit string) where field ``index`` starts."""
        return sum(f[1] for f in self.fields[index + 1:])


def layout(spec: KeySpec, stats: list[FieldStats]) -> KeyLayout:
    """Field widths from the global stats (identical on every rank)."""
    out = KeyLayout()
    for name, s in zip(spec.by, stats):
        if s.nan and spec.nan == "last":
            out.fields.append((name, 1, "nan"))
        out.fields.append((name, (s.umax - s.umin).bit_length() if s.has_values else 0, "key"))
    if spec.tie_column is not None:
        if spec.ties == "id":
            s = stats[len(spec.by)]
            out.fields.append(("sample_id", (s.umax - s.umin).bit_length() if s.has_values else 0, "id"))
        else:
            out.fields.append(("sample_id", 64, "hash"))
    out.fields = [f for f in out.fields if f[1] > 0]
    out.bits = sum(f[1] for f in out.fields)
    return out


def _stats_of(spec: KeySpec, stats: list[FieldStats], name: str, kind: str) -> FieldStats:
    if kind == "id":
        return stats[len(spec.by)]
    return stats[spec.by.index(name)]


def _code(spec: KeySpec, stats: list[FieldStats], name: str, kind: str, values: np.ndarray) -> np.ndarray:
    """A new uint64 array: the field's code for each row."""
    if kind == "nan":
        return np.isnan(values).astype(np.uint64)
    if kind == "hash":
        return shuffle_hash(values, spec.seed)
    s = _stats_of(spec, stats, name, kind)
    u = ordinal(values, s.integral)
    if kind == "key" and spec.descending:
        np.subtract(np.uint64(s.umax), u, out=u)
    else:
        u -= np.uint64(s.umin)
    if kind == "key" and s.nan:
        u[np.isnan(values)] = 0
    return u


def pack(spec: KeySpec, stats: list[FieldStats], lay: KeyLayout, columns: dict, n: int, extra_bits: int = 0) -> list:
    """The packed key words (int64, top bit flipped) of this rank's ``n`` rows.

    The bit string of all fields is right-aligned in the words (the least significant field ends at
    bit 0 of the last word). ``extra_bits`` (one-word layouts only) shifts the key left to leave
    room for a row index in the low bits.
    """
    k = lay.words
    words: list = [None] * k
    pos = lay.bits  # where the next field ends, counting bits from the bottom of the k*64-bit number
    for name, width, kind in lay.fields:
        code = _code(spec, stats, name, kind, columns[name])
        pos -= width
        w, s = k - 1 - pos // 64, pos % 64
        if s + width > 64:  # the field's high bits spill into the next more significant word
            high = code >> np.uint64(64 - s)
            if words[w - 1] is None:
                words[w - 1] = high
            else:
                words[w - 1] |= high
            del high
        if s:
            code <<= np.uint64(s)
        if words[w] is None:
            words[w] = code
        else:
            words[w] |= code
        del code
    words = [np.zeros(n, dtype=np.uint64) if w is None else w for w in words]
    if extra_bits:
        if not (k == 1 and lay.bits + extra_bits <= 64):
            raise InternalConsistencyError(f"sort key layout of {k} words, {lay.bits} + {extra_bits} bits")
        words[0] <<= np.uint64(extra_bits)
    return [to_signed(w) for w in words]


def to_signed(u: np.ndarray) -> np.ndarray:
    """uint64 -> int64 with the same order (flip the top bit), in place."""
    u ^= _SIGN
    return u.view(np.int64)


# -- decoding key columns back from sorted words --------------------------------------------------
def decodable(spec: KeySpec, stats: list[FieldStats], lay: KeyLayout, dtypes: dict) -> dict:
    """Columns whose values the sorted key words give back exactly: name -> field index in the
    layout, or None for a key column whose values are all equal (a field of width 0).

    Those columns need not be permuted nor exchanged. Integer and boolean columns qualify, and
    floats that hold only integers (no NaN, no -0.0) when they are sort keys.
    """
    out = {}
    index = {(f[0], f[2]): i for i, f in enumerate(lay.fields)}
    for name, s in zip(spec.by, stats):
        kind = np.dtype(dtypes[name]).kind
        if s.nan or not s.has_values or np.dtype(s.dtype) != np.dtype(dtypes[name]):
            continue
        if kind in "iub" or (kind == "f" and s.integral and not s.negzero):
            out[name] = index.get((name, "key"))
    if ("sample_id", "id") in index and np.dtype(dtypes["sample_id"]).kind == "i":
        out["sample_id"] = index[("sample_id", "id")]
    return out


def decode(spec: KeySpec, stats: list[FieldStats], lay: KeyLayout, words: Sequence[np.ndarray], name: str,
           index: int | None, dtype, extra_bits: int = 0) -> np.ndarray:
    """The values of column ``name`` from the key words (see :func:`decodable`)."""
    n = len(words[0])
    if index is None:  # a key column whose values are all equal
        s = _stats_of(spec, stats, name, "key")
        return np.full(n, s.vmin, dtype=dtype)
    col, width, kind = lay.fields[index]
    s = _stats_of(spec, stats, name, kind)
    k = lay.words
    pos = lay.position(index) + extra_bits
    w, sh = k - 1 - pos // 64, pos % 64
    u = words[w].view(np.uint64) ^ _SIGN
    if sh:
        u >>= np.uint64(sh)
    if sh + width > 64:
        high = words[w - 1].view(np.uint64) ^ _SIGN
        high <<= np.uint64(64 - sh)
        u |= high
        del high
    if width < 64:
        u &= np.uint64((1 << width) - 1)
    if kind == "key" and spec.descending:
        np.subtract(np.uint64(s.umax), u, out=u)
    else:
        u += np.uint64(s.umin)
    return from_ordinal(u, dtype, s.integral)


def word_bounds(lay: KeyLayout, extra_bits: int = 0) -> list[tuple[int, int]]:
    """The (min, max) each signed word can take, for the splitter bisection."""
    lo = -(1 << 63)
    out = []
    for j in range(lay.words):
        bits = (lay.top_bits + extra_bits) if j == 0 else 64
        out.append((lo, lo + (1 << bits) - 1 if bits else lo))
    return out


# -- local sorting -------------------------------------------------------------------------------
def lex_order(words: Sequence[np.ndarray], runs: bool = False) -> np.ndarray:
    """The permutation that sorts rows by (words[0], words[1], ...).

    Sorts by the first word (timsort when ``runs``: the input is a few sorted runs), then re-sorts
    only the rows whose first word ties, by all words. The first word is nearly unique in practice,
    so this costs about one argsort.
    """
    order = np.argsort(words[0], kind="stable" if runs else None)
    if len(words) == 1 or len(order) < 2:
        return order
    w0 = words[0][order]
    tie = w0[1:] == w0[:-1]
    del w0
    if not tie.any():
        return order
    inrun = np.zeros(len(order), dtype=bool)
    inrun[1:] |= tie
    inrun[:-1] |= tie
    pos = np.flatnonzero(inrun)
    sub = order[pos]
    order[pos] = sub[np.lexsort([w[sub] for w in reversed(words)])]
    return order


def index_bits(max_rows: int) -> int:
    """Bits of a row index below ``max_rows``."""
    return max(int(max_rows) - 1, 0).bit_length()


# -- exact splitters -------------------------------------------------------------------------------
def split_positions(
    locals_: Sequence[Sequence[np.ndarray]],
    targets: np.ndarray,
    bounds: Sequence[tuple[int, int]],
    reduce: Callable[[np.ndarray], np.ndarray],
) -> list[np.ndarray]:
    """Exact splitters by distributed selection.

    ``locals_`` holds sorted key words (lexicographically sorted rows) of one or more ranks: this
    rank only in a real process group (``reduce`` = all-reduce sum), or every simulated rank at
    once (``reduce`` = identity). For each global position ``t`` in ``targets`` it finds the
    ``t``-th smallest composite key K_t by bisection, word by word, on the key values (each round:
    count the rows <= a candidate with ``searchsorted``, sum the counts over ranks). Returns, for
    each local, the number of its rows < K_t per target: with unique keys these sum to exactly
    ``t``, so rank r receives exactly the global rows [t_r, t_{r+1}).

    Rounds: the bits of the key (<= 64 per word), each one tiny all-reduce of len(targets) counts.
    """
    targets = np.asarray(targets, dtype=np.int64)
    T = len(targets)
    starts = [np.zeros(T, dtype=np.int64) for _ in locals_]  # rows < prefix, per target
    stops = [np.full(T, len(w[0]) if len(w) else 0, dtype=np.int64) for w in locals_]  # rows <= prefix
    if T == 0:
        return starts
    k = len(bounds)
    for j in range(k):
        lo = np.full(T, bounds[j][0], dtype=np.int64)
        hi = np.full(T, bounds[j][1], dtype=np.int64)
        whole = j == 0  # on the first word every target's range is the whole array
        while True:
            active = lo < hi
            if not active.any():
                break
            mid = (lo >> 1) + (hi >> 1) + ((lo & 1) + (hi & 1) >> 1)  # floor((lo+hi)/2), no overflow
            counts = np.zeros(T, dtype=np.int64)
            for w, a, b in zip(locals_, starts, stops):
                counts += _count_le(w[j], a, b, mid, whole)
            counts = reduce(counts)
            ok = counts >= targets + 1  # K_t's word j <= mid
            hi = np.where(active & ok, mid, hi)
            lo = np.where(active & ~ok, mid + 1, lo)
        for i, (w, a, b) in enumerate(zip(locals_, starts, stops)):
            left = _count_lt(w[j], a, b, lo, whole)
            right = _count_le(w[j], a, b, lo, whole)
            starts[i], stops[i] = left, right
    return starts


def _count_le(word: np.ndarray, a: np.ndarray, b: np.ndarray, values: np.ndarray, whole: bool) -> np.ndarray:
    if whole:
        return np.searchsorted(word, values, side="right").astype(np.int64)
    return np.array([ai + np.searchsorted(word[ai:bi], v, side="right") for ai, bi, v in zip(a, b, values)],
                    dtype=np.int64)


def _count_lt(word: np.ndarray, a: np.ndarray, b: np.ndarray, values: np.ndarray, whole: bool) -> np.ndarray:
    if whole:
        return np.searchsorted(word, values, side="left").astype(np.int64)
    return np.array([ai + np.searchsorted(word[ai:bi], v, side="left") for ai, bi, v in zip(a, b, values)],
                    dtype=np.int64)


def send_counts(positions: np.ndarray, n: int) -> np.ndarray:
    """Rows this rank sends to each rank, from its split positions (one per rank after the first)."""
    edges = np.concatenate([[0], np.asarray(positions, dtype=np.int64), [n]])
    return np.diff(edges)


def split_targets(total: int, world_size: int) -> np.ndarray:
    """Global first row of ranks 1..P-1: the same balanced slices as ``artifacts.row_bounds``."""
    return np.array([total * r // world_size for r in range(1, world_size)], dtype=np.int64)
