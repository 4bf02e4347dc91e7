"""The invariants of a plan, checked on its arrays: ``varlen validate`` (:mod:`varlen_cli.validate`,
which reads a plan file) and the planner's own last step before writing (so the planner cannot
write a plan that ``varlen validate`` rejects) run these same checks.

The checks run on *windows*: consecutive plan rows that hold whole steps (:class:`PlanArrays`, with
``first_row``), fed one after another to :class:`PlanChecks`; a whole plan in memory is one window
(:func:`run_checks`). A plan of a billion samples is checked window by window in bounded memory
(issue 25): whatever a check needs across windows is kept small (per-step values, the distinct
seqlens), and exactly-once is a bitmap of one bit per sample and epoch. Everything is recomputed from
the columns and the metadata, vectorised over segments (CSR offsets of the list columns).
Imports numpy and the plan format only (no planner, no pyarrow).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import format
from .budget import Budget
from .key_spill import KeyRangeSpill

MAX_EXAMPLES = 5


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False


@dataclass
class PlanArrays:
    """Plan rows as arrays: per-microbatch columns (``cols``: epoch, step, rank, micro, num_samples,
    seqlen, batch_size, tokens, lr_scale, shape_id, step_samples, step_tokens and, when present,
    step_loss_tokens), the list columns flattened (``ids``; packed plans ``lengths``, ``rows``,
    ``starts``; mixtures ``source``) with their CSR ``offsets``, and, when known (``--metrics``, the
    planner), ``sample_length``: each entry's whole sample length, and ``sample_target``: each
    entry's loss tokens as the metrics counted them (their ``target_length``; plans whose metadata
    says ``loss_tokens: target_length``). ``first_row``: the plan row of the first row (a window of a
    larger plan; whole steps)."""

    cols: dict
    offsets: np.ndarray
    ids: np.ndarray
    lengths: np.ndarray | None = None
    rows: np.ndarray | None = None
    starts: np.ndarray | None = None
    source: np.ndarray | None = None
    sample_length: np.ndarray | None = None
    sample_target: np.ndarray | None = None
    first_row: int = 0
    _final: np.ndarray | None = field(default=None, repr=False)
    _split: np.ndarray | None = field(default=None, repr=False)  # entries of split samples (final_entries)
    _epoch: np.ndarray | None = field(default=None, repr=False)  # entry_epoch()

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    @property
    def split(self) -> bool:
        """Whether some entry of these rows is a chunk past a sample's start (``--split-long``)."""
        return self.starts is not None and len(self.starts) > 0 and bool(self.starts.any())

    def entry_epoch(self) -> np.ndarray:
        if self._epoch is None:
            self._epoch = np.repeat(self.cols["epoch"].astype(np.int64), np.diff(self.offsets))
        return self._epoch


# -- segments ----------------------------------------------------------------------------------------
def segment_reduce(ufunc, values: np.ndarray, offsets: np.ndarray, empty=0, dtype=None) -> np.ndarray:
    """``ufunc.reduceat`` over the CSR segments, ``empty`` for empty ones (any offsets)."""
    counts = np.diff(offsets)
    out = np.full(len(counts), empty, dtype=dtype or (np.float64 if values.dtype.kind == "f" else np.int64))
    nz = np.flatnonzero(counts > 0)
    if len(nz):
        out[nz] = ufunc.reduceat(values, offsets[nz], dtype=out.dtype if ufunc is np.add else None)
    return out


def _join(values) -> str:
    return ", ".join(str(int(v)) for v in list(values)[:MAX_EXAMPLES])


def _examples(mask: np.ndarray, values: np.ndarray) -> str:
    return _join(values[np.flatnonzero(mask)[:MAX_EXAMPLES]])


class Examples:
    """Up to MAX_EXAMPLES values, the first ones met in plan order (``first_row``: the plan row of the
    window's first value; windows fed out of order, or merged, keep the first by plan row)."""

    def __init__(self):
        self.values: list = []
        self.rows: list = []

    def add(self, mask: np.ndarray, values: np.ndarray, first_row: int = 0) -> None:
        if len(self.values) < MAX_EXAMPLES and mask.any():
            at = np.flatnonzero(mask)[:MAX_EXAMPLES]
            self.values += values[at].tolist()
            self.rows += (first_row + at).tolist()

    def merge(self, other: Examples) -> None:
        """The first MAX_EXAMPLES of both, by plan row."""
        pairs = sorted(zip(self.rows + other.rows, self.values + other.values), key=lambda p: p[0])[:MAX_EXAMPLES]
        self.rows, self.values = [p[0] for p in pairs], [p[1] for p in pairs]

    def __str__(self) -> str:
        return _join(self.values)


def _smallest(*parts) -> np.ndarray:
    """The MAX_EXAMPLES smallest distinct values of arrays."""
    return np.unique(np.concatenate([np.asarray(p, np.int64) for p in parts]))[:MAX_EXAMPLES]


def _edges_decrease(edges: list) -> bool:
    """Whether the epoch falls from one window to the next; ``edges``: (first row, first epoch, last
    epoch) of each window, in any order."""
    edges = sorted(edges)
    return any(b[1] < a[2] for a, b in zip(edges, edges[1:]))


def _first_met(a: tuple | None, b: tuple | None) -> tuple | None:
    """Of two (first row, ...) findings, the one met first in plan order."""
    if a is None or b is None:
        return a if b is None else b
    return min(a, b, key=lambda x: x[0])


# -- layout and counts ---------------------------------------------------------------------------------
class Layout:
    def __init__(self, meta: dict):
        self.meta = meta
        self.dp, self.accum = int(meta["dp"]), int(meta["grad_accum"])
        self.slots = self.dp * self.accum
        self.spe = [int(s) for s in meta.get("steps_per_epoch", [])]
        self.epochs = int(meta.get("epochs", len(self.spe)))
        self.n = 0
        self.bad = {name: Examples() for name in ("step", "rank", "micro")}
        self.edges: list = []  # (first row, first epoch, last epoch) of each window
        self.decrease = self.outside = self.spans = False
        self.rows_per_epoch = np.zeros(max(self.epochs, 0), np.int64)

    def update(self, a: PlanArrays) -> None:
        c, n = a.cols, a.count
        position = a.first_row + np.arange(n)
        for name, want in (("step", position // self.slots), ("rank", position % self.slots // self.accum),
                           ("micro", position % self.accum)):
            self.bad[name].add(c[name] != want, position, a.first_row)
        epoch = c["epoch"].astype(np.int64)
        if n:
            if (np.diff(epoch) < 0).any():
                self.decrease = True
            self.edges.append((a.first_row, int(epoch[0]), int(epoch[-1])))
            if int(epoch.min()) < 0 or int(epoch.max()) >= self.epochs:
                self.outside = True
            else:
                self.rows_per_epoch += np.bincount(epoch, minlength=self.epochs)
            whole = n - n % self.slots
            if whole and (epoch[:whole:self.slots] != epoch[self.slots - 1:whole:self.slots]).any():
                self.spans = True
        self.n += n

    def merge(self, other: Layout) -> None:
        for name, ex in self.bad.items():
            ex.merge(other.bad[name])
        self.edges += other.edges
        self.decrease |= other.decrease
        self.outside |= other.outside
        self.spans |= other.spans
        self.rows_per_epoch += other.rows_per_epoch
        self.n += other.n

    def result(self) -> Check:
        n, slots = self.n, self.slots
        self.decrease |= _edges_decrease(self.edges)
        if n % slots:
            return Check("layout", False, f"{n} microbatches is not a multiple of dp x grad_accum = {slots}")
        steps = n // slots
        problems = [f"{name} out of (step, rank, micro) order at rows {ex}" for name, ex in self.bad.items()
                    if ex.values]
        if int(self.meta.get("num_steps", steps)) != steps:
            problems.append(f"metadata says {self.meta.get('num_steps')} steps, the plan has {steps}")
        if "num_microbatches" in self.meta and int(self.meta["num_microbatches"]) != n:
            problems.append(f"metadata says {self.meta['num_microbatches']} microbatches, the plan has {n}")
        if n and self.decrease:
            problems.append("epochs decrease")
        elif n and self.outside:
            problems.append(f"epochs outside 0..{self.epochs - 1}")
        elif len(self.spe) != self.epochs:
            problems.append(f"metadata lists steps for {len(self.spe)} epochs, the plan has {self.epochs}")
        else:
            have = self.rows_per_epoch // slots
            if have.tolist() != self.spe:
                bad = np.flatnonzero(have != np.asarray(self.spe))
                problems.append(f"steps_per_epoch says {self.spe[bad[0]]} steps in epoch {bad[0]}, the epoch column "
                                f"{int(have[bad[0]])}")
            elif steps and self.spans:
                problems.append("a step spans two epochs")
        if problems:
            return Check("layout", False, "; ".join(problems))
        return Check("layout", True, f"{steps} steps x {self.dp} ranks x {self.accum} microbatches, "
                     f"{self.epochs} epoch(s)")


class Counts:
    def __init__(self, packed: bool):
        self.packed = packed
        self.bad = self.under = self.negative = 0
        self.entries = {"sample_ids": 0}

    def update(self, a: PlanArrays) -> bool:
        """False when the list columns disagree or ids are negative (the other checks skip such rows)."""
        c = a.cols
        self.bad += int(np.count_nonzero(c["num_samples"] != np.diff(a.offsets)))
        self.entries["sample_ids"] += len(a.ids)
        ok = True
        for name, values in (("sample_lengths", a.lengths), ("sample_rows", a.rows), ("sample_starts", a.starts),
                             ("source", a.source)):
            if values is not None:
                self.entries[name] = self.entries.get(name, 0) + len(values)
                ok &= len(values) == len(a.ids)
        if not self.packed:
            self.under += int(np.count_nonzero(c["batch_size"] < c["num_samples"]))
        if len(a.ids) and int(a.ids.min()) < 0:
            self.negative += int((a.ids < 0).sum())
            ok = False
        return ok

    def merge(self, other: Counts) -> None:
        self.bad += other.bad
        self.under += other.under
        self.negative += other.negative
        for name, count in other.entries.items():
            self.entries[name] = self.entries.get(name, 0) + count

    def result(self) -> Check:
        problems = []
        if self.bad:
            problems.append(f"num_samples != len(sample_ids) in {self.bad} rows")
        for name, count in self.entries.items():
            if name != "sample_ids" and count != self.entries["sample_ids"]:
                problems.append(f"{name} has {count} entries, sample_ids {self.entries['sample_ids']}")
        if self.under:
            problems.append(f"batch_size < num_samples in {self.under} rows")
        if self.negative:
            problems.append(f"{self.negative} negative sample ids")
        if problems:
            return Check("counts", False, "; ".join(problems))
        return Check("counts", True, "num_samples and batch_size consistent")


# -- coverage -----------------------------------------------------------------------------------------
class Bitmap:
    """One bit per key in ``[0, n)`` (``pad``: the bytes rounded up to a multiple of it, zero)."""

    def __init__(self, n: int, pad: int = 1):
        self.n = n
        self.bits = np.zeros(-(-((n + 7) // 8) // pad) * pad, np.uint8)

    def test(self, keys: np.ndarray) -> np.ndarray:
        return (self.bits[keys >> 3] >> (keys & 7).astype(np.uint8)) & 1 == 1

    def set(self, keys: np.ndarray) -> None:
        """Set the bits of ``keys`` (repeats allowed): a scatter, repeated for the bits a collision lost."""
        while len(keys):
            byte, mask = keys >> 3, np.left_shift(1, keys & 7).astype(np.uint8)
            self.bits[byte] |= mask
            keys = keys[(self.bits[byte] & mask) == 0]

    def test_and_set(self, keys: np.ndarray) -> np.ndarray:
        """:meth:`test` then :meth:`set`, with one gather less: whether each key was set before."""
        byte, mask = keys >> 3, np.left_shift(1, keys & 7).astype(np.uint8)
        before = self.bits[byte]
        self.bits[byte] = before | mask
        lost = np.flatnonzero((self.bits[byte] & mask) == 0)  # keys sharing a byte: one write won
        if len(lost):
            self.set(keys[lost])
        return (before & mask) != 0

    def count(self) -> int:
        return int(np.bitwise_count(self.bits).sum())

    def clear_keys(self, other: Bitmap, k: int) -> np.ndarray:
        """Up to ``k`` keys set in neither this bitmap nor ``other``."""
        full = self.bits | other.bits
        if self.n % 8:
            full[-1] |= np.uint8((0xFF << (self.n % 8)) & 0xFF)  # bits past n
        bytes_ = np.flatnonzero(full != 0xFF)[:k]
        keys = (bytes_[:, None] * 8 + np.arange(8)[None, :]).reshape(-1)
        keys = keys[keys < self.n]
        return keys[((full[keys >> 3] >> (keys & 7).astype(np.uint8)) & 1) == 0][:k]


@dataclass
class _Keys:
    """Entries as keys into one space over every source: ``offset[source] + id``; ``expected``: the
    copies of each key an epoch holds (None: one each; a mixture: floor/ceil of its weight)."""

    size: int
    expected: np.ndarray | None
    offset: np.ndarray
    names: list

    def want(self, keys: np.ndarray) -> np.ndarray:
        return np.ones(len(keys), np.int64) if self.expected is None else self.expected[keys]

    def of(self, a: PlanArrays, meta: dict) -> tuple[np.ndarray | None, str | None]:
        """The keys of a window's entries, or a problem (ids or sources out of range)."""
        mix = meta.get("mixture")
        if not mix:
            if len(a.ids) and (int(a.ids.min()) < 0 or int(a.ids.max()) >= max(self.size, 1)):
                return None, f"sample ids outside 0..{self.size - 1}"
            return a.ids.astype(np.int64, copy=False), None
        sources = mix["sources"]
        sizes = np.diff(self.offset)
        src = a.source if a.source is not None else np.zeros(len(a.ids), np.int64)
        if len(src) and (int(src.min()) < 0 or int(src.max()) >= len(sources)):
            return None, f"source outside 0..{len(sources) - 1}"
        bad = (a.ids < 0) | (a.ids >= sizes[src]) if len(src) else np.zeros(0, bool)
        if bad.any():
            k = int(src[np.flatnonzero(bad)[0]])
            return None, f"source {sources[k]['name']!r} has sample ids outside 0..{int(sizes[k]) - 1}"
        return self.offset[src] + a.ids, None


def keys_of(meta: dict) -> _Keys:
    mix = meta.get("mixture")
    if not mix:
        n = int((meta.get("input") or {}).get("num_rows") or 0)
        return _Keys(n, None, np.array([0, n], np.int64), ["input"])
    sources = mix["sources"]
    sizes = np.array([int(s["num_rows"]) for s in sources], np.int64)
    offset = np.concatenate([[0], np.cumsum(sizes)])
    expected = np.concatenate([mixture_copies(int(s["num_rows"]), float(s["weight"]), int(mix.get("seed", 0)), k)
                               for k, s in enumerate(sources)]) if len(sources) else np.zeros(0, np.int64)
    return _Keys(int(offset[-1]), expected, offset, [s["name"] for s in sources])


MIX_SEED = 0x6D6978  # seed stream of a mixture's fractional subsets ("mix")


def mixture_extra(n: int, weight: float, seed: int, index: int) -> np.ndarray:
    """The seeded subset of a mixture source's ``n`` samples that get one copy more than ``floor(w)``:
    ``round(frac(w) x n)`` of them, sorted, the same in every epoch. The one definition, for the
    planner (``varlen plan --mix``) and for ``varlen validate``."""
    whole = int(np.floor(weight))
    extra_n = int(round((weight - whole) * n))
    return np.sort(np.random.default_rng([seed, MIX_SEED, index]).choice(n, extra_n, replace=False))


def mixture_copies(n: int, weight: float, seed: int, index: int) -> np.ndarray:
    """Copies of each of a source's ``n`` samples in every epoch of a mixture (``floor(w)``, one more for
    :func:`mixture_extra`)."""
    copies = np.full(n, int(np.floor(weight)), np.int64)
    copies[mixture_extra(n, weight, seed, index)] += 1
    return copies


def _dropped_keys(meta: dict, keys: _Keys, epochs: int) -> tuple[np.ndarray, list]:
    """Keys dropped in every epoch (too long; one per dropped copy) and per epoch (``--tail drop``)."""
    info = meta.get("dropped") or {}

    def as_keys(ids, sources) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        src = np.asarray(sources if sources is not None else np.zeros(len(ids)), np.int64)
        if len(src) != len(ids) or (len(src) and (src.min() < 0 or src.max() >= len(keys.offset) - 1)):
            src = np.zeros(len(ids), np.int64)
        k = keys.offset[src] + ids
        return k[(ids >= 0) & (k < keys.size)]

    if "too_long_ids" not in info:  # older plans: the union, every epoch
        return as_keys(info.get("sample_ids", []), None), [np.zeros(0, np.int64)] * epochs
    long_keys = as_keys(info.get("too_long_ids", []), info.get("too_long_sources"))
    tail = [np.zeros(0, np.int64) for _ in range(epochs)]
    for entry in info.get("tail", []):
        e = int(entry["epoch"])
        if 0 <= e < epochs:
            tail[e] = np.concatenate([tail[e], as_keys(entry["sample_ids"], entry.get("sources"))])
    return long_keys, tail


SPLIT_BITMAP_MAX = 1 << 34  # (epoch, key) pairs a split plan's lookup bitmap covers (2 GiB; else binary search)
_START_BITS = 31  # a later chunk's (epoch key, start) packed in one int64 while the epoch key fits 32 bits


class SplitInfo:
    """The split samples of a plan (``--split-long``): per (epoch, key) the largest chunk start, from
    the entries with start > 0 (what tells which chunk completes a sample without its length).

    Collected packed (one int64 per later chunk: epoch key and start), sorted once in place; looked up
    by a bitmap of the split (epoch, key) pairs and its rank (set bits before each 64-bit word), which
    indexes ``max_start``: O(1) per entry, no binary search."""

    def __init__(self, size: int):
        self.size = max(size, 1)
        self._packed: list = []  # epoch key << _START_BITS | start
        self._keys: list = []  # (epoch key, start) pairs that do not pack (tampered epochs, huge plans)
        self._starts: list = []
        self.later = 0  # entries with start > 0
        self.count = 0  # split (epoch, key)s
        self.key = np.zeros(0, np.int64)  # them, sorted, when there is no bitmap
        self.max_start = np.zeros(0, np.int64)
        self.bits: Bitmap | None = None
        self._words: np.ndarray | None = None  # self.bits as uint64 words
        self._rank: np.ndarray | None = None  # set bits before each word

    def collect(self, epoch: np.ndarray, keys: np.ndarray, starts: np.ndarray) -> None:
        later = starts > 0
        n = int(np.count_nonzero(later))
        if not n:
            return
        self.later += n
        k, s = epoch[later] * self.size + keys[later], starts[later].astype(np.int64)
        if int(k.min()) >= 0 and int(k.max()) < 1 << 32 and int(s.max()) < 1 << _START_BITS:
            self._packed.append((k << _START_BITS) | s)
        else:
            self._keys.append(k)
            self._starts.append(s)

    def freeze(self) -> SplitInfo:
        if self._keys:  # some pairs do not pack: sort all as pairs
            joined = np.concatenate(self._packed) if self._packed else np.zeros(0, np.int64)
            k = np.concatenate([joined >> _START_BITS, *self._keys])
            s = np.concatenate([joined & ((1 << _START_BITS) - 1), *self._starts])
            order = np.lexsort((s, k))
            k, s = k[order], s[order]
            packed = False
        else:
            packed = True
            k = np.concatenate(self._packed) if len(self._packed) > 1 else \
                (self._packed[0] if self._packed else np.zeros(0, np.int64))
            self._packed = []
            k.sort()  # in place: by epoch key, then start
            s = k  # the starts are the low bits of the packed values
            k = k >> _START_BITS
        self._packed, self._keys, self._starts = [], [], []
        last = np.r_[k[1:] != k[:-1], True] if len(k) else np.zeros(0, bool)
        self.key, top = k[last], s[last]
        del k, s, last
        self.max_start = _compact(top & ((1 << _START_BITS) - 1) if packed else top)
        self.count = len(self.key)
        span = int(self.key[-1]) + 1 if len(self.key) else 0
        self.bits = self._words = self._rank = None
        if 0 < span <= SPLIT_BITMAP_MAX:  # one bit per (epoch, key): most entries are not split, found in O(1)
            self.bits = Bitmap(span, pad=8)
            self.bits.set(self.key)
            self.key = np.zeros(0, np.int64)  # the bitmap and its rank say it all
            self._words = self.bits.bits.view(np.uint64)
            self._rank = np.zeros(len(self._words), np.int32 if self.count < 1 << 31 else np.int64)
            np.cumsum(np.bitwise_count(self._words[:-1]), out=self._rank[1:])
        return self

    def _index(self, epoch_keys: np.ndarray) -> np.ndarray:
        """Where split (epoch, key)s are in ``max_start`` (the keys must be split ones)."""
        if self._rank is None:
            return np.searchsorted(self.key, epoch_keys)
        word, bit = epoch_keys >> 6, (epoch_keys & 63).astype(np.uint64)
        below = self._words[word] & ((np.uint64(1) << bit) - np.uint64(1))
        return self._rank[word] + np.bitwise_count(below)

    def lookup(self, epoch_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(whether each key is a split sample's, its largest start)."""
        n = len(epoch_keys)
        is_split = self.contains(epoch_keys)
        top = np.zeros(n, np.int64)
        hit = np.flatnonzero(is_split)
        top[hit] = self.max_start[self._index(epoch_keys[hit])]
        return is_split, top

    def contains(self, epoch_keys: np.ndarray) -> np.ndarray:
        """Whether each (epoch, key) is a split sample's."""
        n = len(epoch_keys)
        if not self.count:
            return np.zeros(n, bool)
        if self.bits is None:
            at = np.minimum(np.searchsorted(self.key, epoch_keys), len(self.key) - 1)
            return self.key[at] == epoch_keys
        inside = (epoch_keys >= 0) & (epoch_keys < self.bits.n)
        if inside.all():
            return self.bits.test(epoch_keys)
        out = np.zeros(n, bool)
        candidates = np.flatnonzero(inside)
        out[candidates] = self.bits.test(epoch_keys[candidates])
        return out

    def final(self, epoch_keys: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(whether each entry is a split sample's, whether it ends its sample): a split sample's entry
        ends it when it starts at the sample's largest start (> 0); any other entry ends its sample."""
        is_split = self.contains(epoch_keys)
        final = ~is_split
        later = np.flatnonzero(is_split & (starts > 0))
        if len(later):
            final[later] = starts[later] == self.max_start[self._index(epoch_keys[later])]
        return is_split, final


def split_info(windows, meta: dict) -> SplitInfo:
    """:class:`SplitInfo` from windows (``PlanArrays`` with ``starts``) of a plan."""
    keys = keys_of(meta)
    info = SplitInfo(keys.size)
    for a in windows:
        if a.starts is None:
            continue
        k, problem = keys.of(a, meta)
        if problem is None:
            info.collect(a.entry_epoch(), k, a.starts)
    return info.freeze()


class _Seen:
    """One epoch's occurrences: a bitmap (plain plans) or a count per key (mixtures), the entries
    added, and the smallest keys met again in a later window (the examples of repeats)."""

    def __init__(self, seen, entries: int = 0, hits: np.ndarray | None = None):
        self.seen, self.entries = seen, entries
        self.hits = np.zeros(0, np.int64) if hits is None else hits

    @classmethod
    def empty(cls, keys: _Keys) -> _Seen:
        return cls(Bitmap(keys.size) if keys.expected is None else np.zeros(keys.size, np.int64))

    def add(self, k: np.ndarray) -> None:
        if isinstance(self.seen, Bitmap):
            hit = self.seen.test_and_set(k)
            if hit.any():
                self.hits = _smallest(self.hits, k[hit])
        else:
            self.seen += np.bincount(k, minlength=len(self.seen))
        self.entries += len(k)

    def merge(self, other: _Seen) -> _Seen:
        """Both windows' occurrences: keys in both bitmaps are repeats (and examples)."""
        if isinstance(self.seen, Bitmap):
            both = self.seen.bits & other.seen.bits
            at = np.flatnonzero(both)[:MAX_EXAMPLES]
            keys = (at[:, None] * 8 + np.arange(8)[None, :]).reshape(-1)
            keys = keys[((both[keys >> 3] >> (keys & 7).astype(np.uint8)) & 1) == 1]
            self.hits = _smallest(self.hits, other.hits, keys)
            self.seen.bits |= other.seen.bits  # repeats = entries - distinct counts the overlap
        else:
            self.seen += other.seen
        self.entries += other.entries
        return self


class Coverage:
    """Every sample (every copy of a mixture's) once per epoch, or listed as dropped; a replan's first
    epoch lacks exactly the samples its lineage says were consumed. An occurrence is an entry that
    starts its sample (``--split-long`` chunks: the first one); the chunks of a split sample tile it.
    Plain plans keep one bit per sample for the epoch at hand; mixtures a count per copy."""

    def __init__(self, meta: dict, split: SplitInfo | None):
        self.meta, self.split = meta, split
        self.keys = keys_of(meta)
        self.epochs = int(meta.get("epochs", 1))
        self.long_keys, self.tail_keys = _dropped_keys(meta, self.keys, self.epochs)
        info = meta.get("dropped") or {}
        self.listed = info.get("too_long_listed", True)  # more than the list holds: only counted
        self.long_count = int(info.get("too_long_count", len(np.unique(self.long_keys))))
        self.long_bitmap: Bitmap | None = None  # the unlisted too-long samples, from --metrics
        lineage = meta.get("lineage") or {}
        self.consumed = int(lineage.get("consumed_samples") or 0)
        self.partial_first = "consumed_samples" in lineage
        self.problem: tuple | None = None  # (first row, message) of the window with ids out of range
        self.out_of_order = False
        self.last_epoch: int | None = None
        self.edges: list = []  # (first row, first epoch, last epoch) of each window
        self.keep = False  # mergeable: every epoch's state kept until results() (see PlanChecks.merge)
        self.held: dict = {}  # epoch -> _Seen of the epochs not current (keep only)
        self.current: int | None = None
        self.seen: _Seen | None = None  # the current epoch's
        self.problems: list = []
        self.needs_diagnosis: set = set()
        self.chunks: dict = {name: [] for name in ("epoch", "key", "start", "length", "full")}
        self.spill: KeyRangeSpill | None = None  # where split chunks go instead of self.chunks (spill_to)
        self.spill_full = self.spill_gaps = False  # spilled with their samples' lengths; a window without

    def spill_to(self, directory: str, expected: int, lengths: bool) -> None:
        """Append split samples' chunks to files under ``directory`` by (epoch, range of keys) instead of
        holding them (about ``expected`` of them; ``lengths``: windows come with ``sample_length``); the
        tiling is then checked one file at a time: bounded memory (not for a ``keep`` Coverage)."""
        parts = min(max(-(-int(expected) // SPILL_PART), 1), SPILL_FILES)
        self.spill_full = lengths
        self.spill = KeyRangeSpill(directory, ("key", "start", "length") + (("full",) if lengths else ()),
                                   self.keys.size, parts)

    def long_samples(self, ids: np.ndarray) -> None:
        """The samples too long for any microbatch (from the lengths), for a plan that counted them
        instead of listing them (``dropped.too_long_listed``: false)."""
        self.long_bitmap = Bitmap(self.keys.size)
        self.long_bitmap.set(np.asarray(ids, np.int64))

    def update(self, a: PlanArrays) -> None:
        if self.problem is not None:
            return
        k, problem = self.keys.of(a, self.meta)
        if problem is not None:
            self.problem = (a.first_row, problem)
            return
        row_epoch = a.cols["epoch"].astype(np.int64)
        if a.count:
            if (np.diff(row_epoch) < 0).any() or (self.last_epoch is not None and row_epoch[0] < self.last_epoch):
                self.out_of_order = True
            self.last_epoch = int(row_epoch[-1])
            self.edges.append((a.first_row, int(row_epoch[0]), int(row_epoch[-1])))
        if self.out_of_order:
            return
        epoch = a.entry_epoch()
        if a.starts is not None:
            self._collect_chunks(a, epoch, k)
            first = a.starts == 0
            k, epoch = k[first], epoch[first]
        if not len(k):
            return
        bounds = np.flatnonzero(np.diff(epoch)) + 1
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(k)]):
            self._epoch(int(epoch[lo]))
            self._add(k[lo:hi])

    def _collect_chunks(self, a: PlanArrays, epoch: np.ndarray, k: np.ndarray) -> None:
        """Entries of split samples, for the tiling check at the end."""
        sel = a.starts > 0
        if a.sample_length is not None and a.lengths is not None:
            sel |= a.lengths < a.sample_length
        elif a._split is not None:  # found by final_entries
            sel |= a._split
        elif self.split is not None:
            sel |= self.split.contains(epoch * self.split.size + k)
        if not sel.any():
            return
        if self.spill is not None:
            n = int(sel.sum())
            cols = {"key": k[sel], "start": a.starts[sel],
                    "length": a.lengths[sel] if a.lengths is not None else np.zeros(n, np.int64)}
            if self.spill_full:
                if a.sample_length is None:  # as in memory: the whole lengths are then not checked
                    self.spill_gaps = True
                cols["full"] = a.sample_length[sel] if a.sample_length is not None else np.zeros(n, np.int64)
            self.spill.add(epoch[sel], cols)
            return
        # held until the end (a billion-sample plan has tens of millions): int32 where the values fit
        parts = {"epoch": _compact(epoch[sel]), "key": _compact(k[sel]), "start": _compact(a.starts[sel]),
                 "length": _compact(a.lengths[sel]) if a.lengths is not None else np.zeros(int(sel.sum()), np.int32),
                 "full": _compact(a.sample_length[sel]) if a.sample_length is not None else None}
        for name, values in parts.items():
            if values is not None:
                self.chunks[name].append(values)

    def _epoch(self, e: int) -> None:
        if self.current == e:
            return
        if self.keep:  # the epoch's state stays until results()
            if self.current is not None:
                self.held[self.current] = self.seen
            self.seen = self.held.pop(e, None) or _Seen.empty(self.keys)
            self.current = e
            return
        self._close()
        self.current, self.seen = e, _Seen.empty(self.keys)

    def _add(self, k: np.ndarray) -> None:
        self.seen.add(k)

    def _close(self) -> None:
        e, seen = self.current, self.seen
        self.current = self.seen = None
        if e is not None:
            self._close_epoch(e, seen)

    def _close_epoch(self, e: int, seen: _Seen) -> None:
        if not 0 <= e < self.epochs:
            return  # the layout check reports epochs outside the plan's
        dropped = np.concatenate([self.long_keys, self.tail_keys[e]])
        partial = e == 0 and self.partial_first
        consumed = self.consumed if partial else None
        if self.keys.expected is not None:
            self.problems += _count_problems(self.keys, seen.seen, dropped, e, consumed)
        else:
            self.problems += self._plain_problems(e, seen, dropped, consumed)

    def merge(self, other: Coverage) -> None:
        """Add the windows another Coverage (``keep``) was fed: bitmaps OR-ed, their overlap counted as
        repeats, split chunks and window edges joined, the first problem by plan row kept."""
        self.problem = _first_met(self.problem, other.problem)
        self.out_of_order |= other.out_of_order
        self.edges += other.edges
        if self.spill is not None or other.spill is not None:
            raise ValueError("a spilling Coverage cannot be merged")
        for name, parts in other.chunks.items():
            self.chunks[name] += parts
        mine, theirs = self._states(), other._states()
        for e, seen in theirs.items():
            mine[e] = mine[e].merge(seen) if e in mine else seen
        self.held, self.current, self.seen = mine, None, None

    def _states(self) -> dict:
        states = dict(self.held)
        if self.current is not None:
            states[self.current] = self.seen
        return states

    def _plain_problems(self, e: int, seen: _Seen, dropped: np.ndarray, consumed) -> list[str]:
        present, n = seen.seen, self.keys.size
        uniq, times = np.unique(dropped, return_counts=True)
        if (times > 1).any():
            return [f"epoch {e}: more copies listed as dropped than it has"]
        gone = Bitmap(n)
        gone.set(uniq)
        if not self.listed:  # the too-long samples are counted, not listed (too many)
            if self.long_bitmap is not None:
                gone.bits |= self.long_bitmap.bits
        both = int(np.bitwise_count(present.bits & gone.bits).sum())
        distinct = present.count()
        repeats = seen.entries - distinct  # occurrences past a sample's first
        covered = int(np.bitwise_count(present.bits | gone.bits).sum())
        missing = n - covered
        if not self.listed and self.long_bitmap is None:  # only their number is known
            missing -= self.long_count
        problems = []
        if repeats or both:
            if repeats:
                self.needs_diagnosis.add(e)
            shown = f" (e.g. ids {_join(seen.hits)})" if len(seen.hits) else ""
            problems.append(f"epoch {e}: {both + repeats} samples appear more than once in an epoch or more often than "
                            f"their weight{shown}")
        if missing > 0 and missing != consumed:
            shown = ""
            if self.listed or self.long_bitmap is not None:
                shown = f" (e.g. ids {_join(present.clear_keys(gone, MAX_EXAMPLES))})"
            problems.append(f"epoch {e}: {missing} samples are missing from an epoch and not listed as dropped{shown}"
                            + (f"; {missing} missing, the lineage says {consumed} were consumed"
                               if consumed is not None else ""))
        return problems

    def result(self) -> Check:
        if self.problem is not None:
            return Check("coverage", False, self.problem[1])
        if self.out_of_order or _edges_decrease(self.edges):
            return Check("coverage", False, "rows are not in epoch order")
        states, self.held, self.current, self.seen = self._states(), {}, None, None
        for e in sorted(states):
            self._close_epoch(e, states[e])
        problems = self.problems + self._tiling()
        if problems:
            return Check("coverage", False, "; ".join(problems[:4]) + (f" (+{len(problems) - 4} more)"
                                                                      if len(problems) > 4 else ""))
        dropped = len(np.unique(self.long_keys)) if self.listed else self.long_count
        return Check("coverage", True, f"every sample{' (copy)' if self.meta.get('mixture') else ''} exactly once in "
                     f"each of {self.epochs} epochs" + (f", {dropped} listed as dropped" if dropped else ""))

    def _tiling(self) -> list[str]:
        if self.spill is not None:
            return self._spilled_tiling()
        if not self.chunks["epoch"]:
            return []
        c = {}
        for name, parts in self.chunks.items():  # each column's parts freed as it is joined
            if parts:
                c[name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
                self.chunks[name] = [c[name]]
        problems = []
        epochs = np.unique(c["epoch"]).tolist()
        for e in epochs:
            sel = c["epoch"] == e if len(epochs) > 1 else slice(None)
            problems += _tiling_problems({name: v[sel] for name, v in c.items()}, int(e),
                                         partial=e == 0 and self.partial_first)
        return problems

    def _spilled_tiling(self) -> list[str]:
        problems = []
        for e in self.spill.groups():
            partial = e == 0 and self.partial_first
            found = []
            for c in self.spill.parts(e):
                if self.spill_gaps:
                    c.pop("full", None)
                found += _tiling_found(c, partial)
            problems += _tiling_messages(found, e, partial)
        return problems


def _count_problems(keys: _Keys, occ: np.ndarray, dropped: np.ndarray, e: int, consumed: int | None) -> list[str]:
    """Each key's occurrences in epoch ``e`` (``occ``: per key) against its copies less its dropped ones;
    ``consumed``: a replan's first epoch, which lacks exactly that many."""
    odd = np.flatnonzero(occ != 1) if keys.expected is None else np.flatnonzero(occ != keys.expected)
    cand, where = np.unique(np.concatenate([odd, dropped]), return_inverse=True)
    want = keys.want(cand) - np.bincount(where[len(odd):], minlength=len(cand))
    have = occ[cand]
    if (want < 0).any():
        return [f"epoch {e}: more copies listed as dropped than it has"]
    dup, miss = have > want, have < want
    missing = int((want - have)[miss].sum())
    problems = []
    if dup.any():
        problems.append(f"epoch {e}: {int(dup.sum())} samples appear more than once in an epoch or more often than "
                        f"their weight (e.g. {_key_names(keys, cand[dup])})")
    if miss.any() and missing != consumed:
        problems.append(f"epoch {e}: {int(miss.sum())} samples are missing from an epoch and not listed as dropped "
                        f"(e.g. {_key_names(keys, cand[miss])})"
                        + (f"; {missing} missing, the lineage says {consumed} were consumed" if consumed is not None
                           else ""))
    return problems


def _key_names(keys: _Keys, where: np.ndarray) -> str:
    where = where[:MAX_EXAMPLES]
    if len(keys.names) == 1:
        return "ids " + ", ".join(str(int(w)) for w in where)
    src = np.searchsorted(keys.offset, where, side="right") - 1
    return ", ".join(f"{keys.names[s]}:{int(w - keys.offset[s])}" for s, w in zip(src, where))


def _compact(values: np.ndarray) -> np.ndarray:
    """``values`` as int32 when they fit (split chunks' epochs, keys, starts and lengths), else int64."""
    values = np.asarray(values)
    if not len(values) or (int(values.min()) >= -INT32_LIMIT and int(values.max()) < INT32_LIMIT):
        return values.astype(np.int32)
    return values.astype(np.int64)


INT32_LIMIT = 1 << 31


TILING_PART = 1 << 20  # split chunks whose tiling is checked together (a range of keys): bounded temporaries
SPILL_PART = 1 << 21  # split chunks a spill file is meant to hold (Coverage.spill_to; 64 MiB with lengths)
SPILL_FILES = 4096  # at most this many ranges of keys an epoch


def _tiling_problems(c: dict, e: int, partial: bool) -> list[str]:
    """The chunks of every split sample of one epoch (``c``: their key, start, length and, when known,
    whole length): each distinct chunk (start, length) as often as the sample's first one (its copies),
    distinct chunks back to back from 0 (a replan's first epoch: no overlap only), and, with the
    samples' lengths, ending at the sample's length."""
    return _tiling_messages(_tiling_found(c, partial), e, partial)


def _tiling_found(c: dict, partial: bool) -> list[dict]:
    """:func:`_tiling_part` of the chunks ``c`` (every chunk of their samples), a range of keys at a time
    (a sample's chunks share its key), in key order: bounded temporaries."""
    k = c["key"]
    with_full = "full" in c and len(c["full"]) == len(k)
    names = ("key", "start", "length") + (("full",) if with_full else ())
    parts = -(-len(k) // TILING_PART)
    if parts <= 1:
        return [_tiling_part({name: c[name] for name in names}, partial)]
    found = []
    edges = np.linspace(int(k.min()), int(k.max()) + 1, parts + 1).astype(np.int64)
    for lo, hi in zip(edges[:-1], edges[1:]):
        idx = np.flatnonzero((k >= lo) & (k < hi))
        found.append(_tiling_part({name: c[name][idx] for name in names}, partial))
    return found


def _tiling_messages(found: list[dict], e: int, partial: bool) -> list[str]:
    """The problems of epoch ``e`` from its :func:`_tiling_part` findings, in key order."""
    problems = []
    if any(f["differ"] for f in found):
        problems.append(f"epoch {e}: copies of a chunk differ in length")
    if partial:
        if any(f["overlap"] for f in found):
            problems.append(f"epoch {e}: split chunks overlap")
    elif any(f["gaps"] for f in found):
        problems.append(f"epoch {e}: split chunks overlap or leave gaps (e.g. sample keys "
                        f"{_join(sum((f['gaps'] for f in found), []))})")
    bad_ends = sum(f["bad_ends"] for f in found)
    if bad_ends:
        problems.append(f"epoch {e}: {bad_ends} split chunks do not end within, or at the end of, their sample")
    return problems


def _tiling_part(c: dict, partial: bool) -> dict:
    """What :func:`_tiling_problems` reports, for the split samples whose keys are in ``c``."""
    found = {"differ": False, "overlap": False, "gaps": [], "bad_ends": 0}
    k, s, ln = c["key"], c["start"], c["length"]
    if not len(s) or not (s > 0).any():
        return found
    k, s, ln, order = _sorted_chunks(k, s, ln, need_order="full" in c)
    new_key = np.r_[True, k[1:] != k[:-1]]
    keep = (s[np.r_[new_key[1:], True]] > 0)[np.cumsum(new_key) - 1]  # samples split: their largest start > 0
    full = c["full"][order] if "full" in c else None
    if not keep.all():
        k, s, ln, new_key = k[keep], s[keep], ln[keep], new_key[keep]
        full = full[keep] if full is not None else None
    same_chunk = ~new_key & np.r_[False, s[1:] == s[:-1]]
    found["differ"] = bool((same_chunk & np.r_[False, ln[1:] != ln[:-1]]).any())
    chunk_start = np.flatnonzero(~same_chunk)  # first entry of each distinct (key, start)
    ck, cs, cl = k[chunk_start], s[chunk_start].astype(np.int64), ln[chunk_start].astype(np.int64)
    copies = np.diff(np.append(chunk_start, len(k)))
    first = np.r_[True, ck[1:] != ck[:-1]]
    prev_end = np.r_[0, (cs + cl)[:-1]]
    if partial:
        found["overlap"] = bool((~first & (cs < prev_end)).any())
    else:
        gaps = (first & (cs != 0)) | (~first & (cs != prev_end))
        group = np.cumsum(first) - 1
        head_copies = copies[first][group]
        bad = gaps | (copies != head_copies)
        found["gaps"] = ck[np.flatnonzero(bad)[:MAX_EXAMPLES]].tolist()
    if full is not None:
        full = full[chunk_start].astype(np.int64)
        last = np.r_[ck[1:] != ck[:-1], True]
        over = cs + cl > full
        short = last & (cs + cl != full) & (not partial)
        found["bad_ends"] = int(over.sum() + short.sum())
    return found


def _sorted_chunks(k: np.ndarray, s: np.ndarray, ln: np.ndarray, need_order: bool) -> tuple:
    """Chunks sorted by (key, start, length), and the order (when ``need_order``): one sort of the three
    packed in an int64 when their values fit (they do in any plan varlen writes), else a lexsort."""
    k, s, ln = (np.asarray(x, np.int64) for x in (k, s, ln))
    bits = [int(x.max()).bit_length() for x in (k, s, ln)]
    if min(int(k.min()), int(s.min()), int(ln.min())) < 0 or sum(bits) > 63:
        order = np.lexsort((ln, s, k))
        return k[order], s[order], ln[order], order
    packed = (k << (bits[1] + bits[2])) | (s << bits[2]) | ln
    order = None
    if need_order:  # ties are equal chunks of one sample (the same whole length): any order of them will do
        order = np.argsort(packed)
        packed = packed[order]
    else:
        packed.sort()
    low = (1 << bits[2]) - 1
    return packed >> (bits[1] + bits[2]), (packed >> bits[2]) & ((1 << bits[1]) - 1), packed & low, order


# -- budget and shapes ----------------------------------------------------------------------------------
class BudgetCheck:
    def __init__(self, meta: dict, budget: Budget):
        self.packing, self.budget = meta.get("packing"), budget
        self.over, self.over_rows = 0, Examples()
        self.problems: dict = {}  # message -> count (summed over windows)
        self.met: dict = {}  # message -> (first row, order in its window): the order met

    def _count(self, message: str, n: int = 1, where: tuple = (0, 0)) -> None:
        self.problems[message] = self.problems.get(message, 0) + n
        self.met[message] = min(self.met.get(message, where), where)

    def merge(self, other: BudgetCheck) -> None:
        self.over += other.over
        self.over_rows.merge(other.over_rows)
        for message, n in other.problems.items():
            self._count(message, n, other.met[message])

    def update(self, a: PlanArrays) -> None:
        c, budget = a.cols, self.budget
        b, t = c["batch_size"].astype(np.int64), c["seqlen"].astype(np.int64)
        if budget.max_tokens is not None or budget.max_samples is not None:
            over = ~budget.fits(b, t)
            if not self.packing and budget.max_samples is not None:
                over |= c["num_samples"] > budget.max_samples
            self.over += int(over.sum())
            self.over_rows.add(over, a.first_row + np.arange(len(over)), a.first_row)
        found = []
        if self.packing:
            seq = int(self.packing["seq_len"])
            if (t != seq).any():
                found.append((f"microbatches whose seqlen is not seq_len {seq}", int((t != seq).sum())))
            if a.rows is not None and a.lengths is not None:
                found += _packed_row_problems(a, b, seq, self.packing.get("max_per_row"))
        if a.sample_length is not None:
            found += _length_problems(a, self.packing)
        for i, (message, n) in enumerate(found):
            self._count(message, n, (a.first_row, i))

    def result(self) -> Check:
        problems = []
        if self.over:
            problems.append(f"{self.over} microbatches over the budget {self.budget.describe()} (e.g. rows "
                            f"{self.over_rows})")
        for message in sorted(self.problems, key=self.met.__getitem__):
            n = self.problems[message]
            problems.append(message if n is None or message.startswith(("entries not", "tokens column", "negative"))
                            else f"{n} {message}")
        if problems:
            return Check("budget", False, "; ".join(problems))
        if self.packing:
            return Check("budget", True, f"every packed row <= {int(self.packing['seq_len'])} tokens")
        return Check("budget", True, f"B x T{' + A x B x T^2' if self.budget.attention_cost else ''} <= "
                     f"{self.budget.max_tokens} in every microbatch")


def _packed_row_problems(a: PlanArrays, b: np.ndarray, seq: int, cap) -> list[tuple[str, int]]:
    """Packed rows: every entry in a row ``< batch_size``, in row order, no row over ``seq`` tokens or
    ``cap`` samples, ``tokens`` the sum of the entries. One pass over the entries: rows are segments."""
    counts = np.diff(a.offsets)
    rows, lengths = a.rows, a.lengths
    limit = int(b[0]) if len(b) and int(b.min()) == int(b.max()) else np.repeat(b, counts)
    outside = (rows < 0) | (rows >= limit) if len(rows) else np.zeros(0, bool)
    if outside.any():
        return [("entries in a row outside 0..batch_size-1", int(outside.sum()))]
    problems = []
    if len(lengths) and int(lengths.min()) < 0:
        problems.append(("negative sample_lengths", 1))
    first = np.zeros(len(rows), bool)  # first entry of each microbatch
    first[a.offsets[:-1][counts > 0]] = True
    step = np.diff(rows.astype(np.int32, copy=False))  # rows < batch_size: int32
    if len(step) and (step[~first[1:]] < 0).any():
        return problems + [("entries not in row order", 1)]
    new_row = first.copy()
    new_row[1:] |= step != 0
    row_start = np.flatnonzero(new_row)
    if len(row_start):
        fill = np.add.reduceat(lengths.astype(np.int64), row_start)
        if (fill > seq).any():
            problems.append((f"packed rows hold more than seq_len {seq} tokens", int((fill > seq).sum())))
        per_row = np.diff(np.append(row_start, len(rows)))
        if cap and (per_row > int(cap)).any():
            problems.append((f"rows hold more than {cap} samples", int((per_row > int(cap)).sum())))
    tokens = segment_reduce(np.add, lengths.astype(np.int64), a.offsets)
    if (tokens != a.cols["tokens"]).any():
        problems.append(("tokens column differs from the sum of sample_lengths", 1))
    return problems


def _length_problems(a: PlanArrays, packing) -> list[tuple[str, int]]:
    """With each entry's sample length (``--metrics``, the planner): padded microbatches hold their
    longest sample and count its tokens; packed entries lie within their sample."""
    c = a.cols
    full = a.sample_length
    if packing:
        start = a.starts if a.starts is not None else np.zeros(len(full), np.int64)
        bad = (start < 0) | (start + a.lengths > full) if a.lengths is not None else np.zeros(0, bool)
        return [("packed entries reach past their sample's length", int(bad.sum()))] if bad.any() else []
    problems = []
    longest = segment_reduce(np.maximum, full, a.offsets)
    short = longest > c["seqlen"]
    if short.any():
        problems.append(("microbatches have a sample longer than their seqlen", int(short.sum())))
    if (segment_reduce(np.add, full, a.offsets) != c["tokens"]).any():
        problems.append(("tokens column differs from the sum of the samples' lengths", 1))
    return problems


DENSE_SEQLEN = 1 << 24  # seqlens below this are noted in a boolean array (one byte each), others in a set


class Shapes:
    def __init__(self, meta: dict):
        self.meta = meta
        self.pcfg = meta.get("config") or {}
        self.shapes = meta.get("shapes") or []
        self.arr = np.asarray(self.shapes, dtype=np.int64).reshape(-1, 2)
        self.seqlens = np.zeros(0, bool)  # seqlen t met: seqlens[t] (0 <= t < DENSE_SEQLEN)
        self.odd_seqlens: set = set()  # the others (a tampered plan)
        self.pairs: set = set()
        self.outside = self.bad_b = self.mixed = False
        self.bad_t = 0

    def update(self, a: PlanArrays) -> None:
        c = a.cols
        t = c["seqlen"].astype(np.int64)
        self._note_seqlens(t)
        sid = c["shape_id"].astype(np.int64)
        if len(sid) and (not self.shapes or sid.min() < 0 or sid.max() >= len(self.shapes)):
            self.outside = True
        elif len(sid) and not self.outside:
            want_b, want_t = self.arr[sid, 0], self.arr[sid, 1]
            self.bad_t += int((want_t != t).sum())
            self.bad_b |= bool(((want_b > 0) & (want_b != c["batch_size"])).any())
        key = c["batch_size"].astype(np.int64) * (1 << 32) + t
        if self.pcfg.get("static_shapes"):
            self.pairs.update(np.unique(key).tolist())
        if self.pcfg.get("same_shape_per_step") or self.meta.get("packing"):
            step = c["step"].astype(np.int64)
            order = np.lexsort((key, step))
            s, kk = step[order], key[order]
            self.mixed |= bool(((s[1:] == s[:-1]) & (kk[1:] != kk[:-1])).any())

    def _note_seqlens(self, t: np.ndarray) -> None:
        if not len(t):
            return
        if int(t.min()) < 0 or int(t.max()) >= DENSE_SEQLEN:
            inside = (t >= 0) & (t < DENSE_SEQLEN)
            self.odd_seqlens.update(np.unique(t[~inside]).tolist())
            t = t[inside]
            if not len(t):
                return
        top = int(t.max())
        if top >= len(self.seqlens):
            grown = np.zeros(max(top + 1, 2 * len(self.seqlens)), bool)
            grown[:len(self.seqlens)] = self.seqlens
            self.seqlens = grown
        self.seqlens[t] = True

    def distinct_seqlens(self) -> int:
        return int(np.count_nonzero(self.seqlens)) + len(self.odd_seqlens)

    def merge(self, other: Shapes) -> None:
        if len(other.seqlens) > len(self.seqlens):
            grown = other.seqlens.copy()
            grown[:len(self.seqlens)] |= self.seqlens
            self.seqlens = grown
        else:
            self.seqlens[:len(other.seqlens)] |= other.seqlens
        self.odd_seqlens |= other.odd_seqlens
        self.pairs |= other.pairs
        self.outside |= other.outside
        self.bad_b |= other.bad_b
        self.mixed |= other.mixed
        self.bad_t += other.bad_t

    def result(self) -> Check:
        problems = []
        k = self.pcfg.get("num_shapes")
        distinct_t = self.distinct_seqlens()
        if k and distinct_t > int(k):
            problems.append(f"{distinct_t} distinct seqlens, more than --num-shapes {k}")
        if self.outside:
            problems.append("shape_id outside the metadata's shapes")
        else:
            if self.bad_t:
                problems.append(f"{self.bad_t} rows whose seqlen differs from their shape")
            if self.bad_b:
                problems.append("rows whose batch_size differs from their static shape")
        if self.pcfg.get("static_shapes") and k and len(self.pairs) != int(k) and distinct_t == int(k):
            problems.append(f"static shapes: {len(self.pairs)} (B, T) pairs for {k} buckets")
        if self.mixed:
            which = "" if self.meta.get("packing") else " (--same-shape-per-step)"
            problems.append("a step mixes shapes" + which)
        if problems:
            return Check("shapes", False, "; ".join(problems))
        return Check("shapes", True, f"{distinct_t} distinct seqlens, {len(self.shapes)} shapes")


# -- per-step totals -----------------------------------------------------------------------------------
def final_entries(a: PlanArrays, split: SplitInfo | None, keys: _Keys, meta: dict) -> np.ndarray | None:
    """Per entry: whether it ends its sample (a whole sample, or a split sample's last chunk); None
    when every entry does. Exact with the samples' lengths; without them, the chunk with the largest
    start of its sample in its epoch (``split``: those starts over the whole plan)."""
    if a._final is not None or a.starts is None:
        return a._final
    if a.sample_length is not None:
        final = a.starts + a.lengths == a.sample_length
        a._final = None if final.all() else final
        return a._final
    if split is None or not split.count:
        return None
    k, problem = keys.of(a, meta)
    if problem is not None:
        return None
    a._split, a._final = split.final(a.entry_epoch() * split.size + k, a.starts)
    return a._final


def completed(a: PlanArrays, final: np.ndarray | None) -> np.ndarray:
    """Samples each microbatch completes: its entries, except non-final chunks of split samples."""
    if final is None:
        return a.cols["num_samples"].astype(np.int64)
    return segment_reduce(np.add, final.astype(np.int64), a.offsets)


def _step_sums(step: np.ndarray, values: np.ndarray) -> np.ndarray:
    if not len(step):
        return np.zeros(0)
    local = step - step.min()
    return np.bincount(local, weights=values)[local]


class StepTotals:
    def __init__(self, unknowable: bool):
        self.unknowable, self.bad = unknowable, 0

    def update(self, a: PlanArrays, done: np.ndarray) -> None:
        c = a.cols
        step = c["step"].astype(np.int64)
        bad = _step_sums(step, c["tokens"]) != c["step_tokens"]
        if not self.unknowable:
            bad |= _step_sums(step, done) != c["step_samples"]
        self.bad += int(bad.sum())

    def merge(self, other: StepTotals) -> None:
        self.bad += other.bad

    def result(self) -> Check:
        if self.bad:
            return Check("step totals", False, f"step_samples/step_tokens wrong in {self.bad} rows")
        note = " (step_samples of the first epoch need --metrics)" if self.unknowable else ""
        return Check("step totals", True, "step_samples and step_tokens match their steps" + note)


class Lr:
    def __init__(self, meta: dict, unknowable: bool):
        cfg = meta.get("config") or {}
        self.mode = meta.get("lr_scaling", cfg.get("lr_scaling", "none"))
        self.by = meta.get("lr_scale_by", cfg.get("lr_scale_by", "samples"))
        self.base = meta.get("base_batch_size")
        self.trained_only = meta.get("loss_tokens") == format.TARGET_LENGTH_COLUMN
        self.unknowable = unknowable
        self.nonfinite = self.bad = 0

    @property
    def _plain(self) -> bool:
        return self.mode == "none" or self.base == 0

    def update(self, a: PlanArrays, done: np.ndarray) -> None:
        c = a.cols
        lr = c["lr_scale"].astype(np.float64)
        self.nonfinite += int((~np.isfinite(lr)).sum())
        step = c["step"].astype(np.int64)
        if self._plain:  # base 0: only empty samples, nothing to scale by (plan/lr.py)
            want = np.ones(len(step))
        elif (self.by == "samples" and self.unknowable) or not self._base_ok():
            return
        else:
            if self.by == "loss-tokens" or (self.by == "tokens" and self.trained_only):  # plan/lr.py
                if "step_loss_tokens" not in c:
                    return
                per_step = c["step_loss_tokens"].astype(np.float64)
            else:
                per_step = _step_sums(step, c["tokens"] if self.by == "tokens" else done)
            ratio = per_step / float(self.base)
            want = ratio if self.mode == "linear" else np.sqrt(ratio)
        self.bad += int((~np.isclose(lr, want, rtol=1e-9, atol=1e-12)).sum())

    def merge(self, other: Lr) -> None:
        self.nonfinite += other.nonfinite
        self.bad += other.bad

    def _base_ok(self) -> bool:
        b = self.base
        return isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0

    def result(self) -> Check:
        if self.nonfinite:
            return Check("lr_scale", False, f"{self.nonfinite} rows whose lr_scale is not finite")
        if not self._plain:
            if self.by == "samples" and self.unknowable:
                return Check("lr_scale", True, "needs --metrics for the first epoch of a replanned --split-long plan",
                             skipped=True)
            if not self._base_ok():
                return Check("lr_scale", False, f"metadata has no base_batch_size > 0 (got {self.base!r})")
        if self.bad:
            return Check("lr_scale", False, f"{self.bad} rows whose lr_scale is not {self.mode}({self.by} / "
                         f"{self.base})")
        shown = f" / {self.base:g}" if self.base and self.mode != "none" else ""
        return Check("lr_scale", True, f"{self.mode} in step {self.by}{shown}")


class Straggler:
    """The straggler in the plan's own cost model (:meth:`varlen_cli.budget.Budget.microbatch_cost`),
    recomputed from the columns; fails when the plan's recorded statistics say otherwise."""

    def __init__(self, meta: dict, budget: Budget):
        self.meta, self.budget = meta, budget
        self.dp = int(meta["dp"])
        self.parts: list = []  # (first row, per-step straggler, sum of the steps' top loads, of their means)
        self.missing_lengths = False

    def update(self, a: PlanArrays) -> None:
        c = a.cols
        if not a.count:
            return
        sum_squares = None
        if self.budget.needs_segment_lengths:
            if a.lengths is None:
                self.missing_lengths = True
                return
            from .budget import segment_sum_squares

            sum_squares = segment_sum_squares(a.lengths, a.offsets)
        cost = self.budget.microbatch_cost(c["tokens"], c["batch_size"], c["seqlen"], sum_squares)
        step = c["step"].astype(np.int64)
        step = step - step.min()
        rank = c["rank"].astype(np.int64)
        load = format.step_loads(step, rank, cost, self.dp)
        self.parts.append((a.first_row, format.straggler(step, rank, cost, self.dp), float(load.max(axis=1).sum()),
                           float(load.mean(axis=1).sum())))

    def merge(self, other: Straggler) -> None:
        self.parts += other.parts
        self.missing_lengths |= other.missing_lengths

    def result(self) -> Check:
        if self.missing_lengths:
            return Check("straggler", False, "a packed attention cost needs sample_lengths")
        if not self.parts:
            return Check("straggler", True, "no steps")
        parts = sorted(self.parts, key=lambda p: p[0])  # plan order: the sums as one pass adds them
        per_step = np.concatenate([p[1] for p in parts])
        top = mean = 0.0
        for p in parts:
            top += p[2]
            mean += p[3]
        overhead = top / mean - 1.0 if mean > 0 else 0.0
        what = ", ".join(f"{k}={v}" for k, v in self.budget.straggler_spec().items())
        stats = self.meta.get("stats") or {}
        for key, value in (("straggler_mean", per_step.mean()), ("straggler_max", per_step.max())):
            recorded = stats.get(key)
            if isinstance(recorded, (int, float)) and not np.isclose(float(recorded), float(value), rtol=1e-9,
                                                                     atol=1e-12):
                return Check("straggler", False, f"metadata says {key} {recorded:.6g}, the plan has {value:.6g} "
                             f"(cost {what})")
        return Check("straggler", True, f"mean {per_step.mean():.3f}, max {per_step.max():.3f}, overhead "
                     f"{100 * overhead:.2f}% in cost {what}")


class LossTokens:
    """``step_loss_tokens`` (when the plan has it) against the targets counted from the lengths, or
    from the metrics' ``target_length`` for plans that count it (:func:`varlen_cli.format.loss_targets`)."""

    def __init__(self, unknowable: bool, target_length: bool = False):
        self.unknowable, self.target_length = unknowable, target_length
        self.present = self.known = True  # known: every window came with what the targets are counted from
        self.bad, self.steps = 0, Examples()

    def update(self, a: PlanArrays, final: np.ndarray | None) -> None:
        if "step_loss_tokens" not in a.cols:
            self.present = False
            return
        if self.target_length:  # analyze --target-length: not derived from the lengths
            if a.sample_target is None:
                self.known = False
                return
            targets = segment_reduce(np.add, format.loss_targets(None, target=a.sample_target), a.offsets)
        else:
            entry_len = a.lengths if a.lengths is not None else a.sample_length
            if entry_len is None:
                self.known = False
                return
            if self.unknowable:
                return
            if final is None and (not len(entry_len) or int(entry_len.min()) > 0):  # l - 1 per entry, in one pass
                targets = segment_reduce(np.add, entry_len, a.offsets) - np.diff(a.offsets)
            else:
                targets = segment_reduce(np.add, format.loss_targets(entry_len, final), a.offsets)
        step = a.cols["step"].astype(np.int64)
        bad = _step_sums(step, targets).astype(np.int64) != a.cols["step_loss_tokens"]
        self.bad += int(bad.sum())
        self.steps.add(bad, step, a.first_row)

    def merge(self, other: LossTokens) -> None:
        self.present &= other.present
        self.known &= other.known
        self.bad += other.bad
        self.steps.merge(other.steps)

    def result(self) -> Check:
        if not self.present:
            return Check("loss tokens", True, "plan has no step_loss_tokens column (older plan)", skipped=True)
        if not self.known:
            return Check("loss tokens", True, "needs --metrics: the plan counts the metrics' target_length "
                         "(assistant tokens)" if self.target_length else "needs --metrics for a padded plan",
                         skipped=True)
        if self.unknowable and not self.target_length:
            return Check("loss tokens", True, "needs --metrics for the first epoch of a replanned --split-long plan",
                         skipped=True)
        if self.bad:
            return Check("loss tokens", False, f"step_loss_tokens wrong in {self.bad} rows (e.g. steps {self.steps})")
        what = "the metrics' target_length" if self.target_length else "the samples' lengths"
        return Check("loss tokens", True, f"step_loss_tokens = targets counted from {what}")


# -- the driver ------------------------------------------------------------------------------------------
class PlanChecks:
    """Every check of a plan, fed windows of whole steps in plan order (:meth:`update`), then
    :meth:`results` (the file's columns and fingerprint are :mod:`varlen_cli.validate`'s).
    ``split``: the plan's split samples (:func:`split_info`), needed for ``--split-long`` plans checked
    without the samples' lengths; ``lengths``: whether windows come with ``sample_length``.

    ``mergeable``: the windows of a plan may be shared out among several PlanChecks (each fed its
    windows in plan order, e.g. the workers writing a plan's segments), which are then joined with
    :meth:`merge` (in any order; picklable between processes): the merged :meth:`results` are those
    of one PlanChecks fed every window. Such a PlanChecks keeps one bitmap per epoch it met until
    the end (a streaming one only the current epoch's). ``spill``: a directory (the caller's) where a
    streaming one puts the chunks of split samples until their check at the end (else held in memory)."""

    def __init__(self, meta: dict, *, split: SplitInfo | None = None, lengths: bool = False, max_memory=None,
                 profile_path: str | None = None, mergeable: bool = False, spill: str | None = None,
                 background: bool = False):
        self.meta = meta
        self.error: str | None = None
        try:
            self.budget = Budget.from_metadata(meta)
        except ValueError as exc:
            self.error = f"malformed metadata: {exc}"
            return
        self.split = split
        self.keys = keys_of(meta)
        # a replan's first epoch of a split plan, without the samples' lengths: which chunk ends a sample
        # whose last chunk was consumed before the replan is unknown
        unknowable = (split is not None and split.count > 0 and not lengths
                      and "consumed_samples" in (meta.get("lineage") or {}))
        self.layout, self.counts = Layout(meta), Counts(bool(meta.get("packing")))
        self.coverage, self.budget_check = Coverage(meta, split), BudgetCheck(meta, self.budget)
        self.coverage.keep = mergeable
        if spill is not None and not mergeable:  # split chunks to files under spill, checked a key range at a time
            expected = split.later + split.count if split is not None else self.keys.size // 16
            self.coverage.spill_to(spill, expected, lengths)
        self.shapes, self.steps, self.lr = Shapes(meta), StepTotals(unknowable), Lr(meta, unknowable)
        self.straggler = Straggler(meta, self.budget)
        self.loss = LossTokens(unknowable, meta.get("loss_tokens") == format.TARGET_LENGTH_COLUMN)
        self.memory = [] if (max_memory is not None or profile_path is not None or self.budget.memory) else None
        self.memory_args = (max_memory, profile_path)
        self.broken = False  # list columns that disagree, negative ids: only layout and counts are meaningful
        self._worker = self._pending = None  # background: a thread checks coverage while the rest goes on
        if background and not mergeable:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = ThreadPoolExecutor(1, thread_name_prefix="varlen-coverage")

    def update(self, a: PlanArrays) -> None:
        if self.error is not None:
            return
        self.layout.update(a)
        if not self.counts.update(a):
            self.broken = True
        if self.broken:
            return
        final = final_entries(a, self.split, self.keys, self.meta)
        done = completed(a, final)
        if self._worker is None:
            self.coverage.update(a)
        else:  # windows in order: the previous one's first (numpy's gathers and scatters release the GIL)
            self._wait()
            self._pending = self._worker.submit(self.coverage.update, a)
        self.budget_check.update(a)
        self.shapes.update(a)
        self.steps.update(a, done)
        self.lr.update(a, done)
        if self.memory is not None:
            self.memory.append((a.first_row, a.cols["batch_size"].astype(np.int32), a.cols["seqlen"].astype(np.int32)))
        self.straggler.update(a)
        self.loss.update(a, final)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the background coverage check and end its thread (results() does it too)."""
        if self._worker is not None:
            try:
                self._wait()
            finally:
                self._worker.shutdown()
                self._worker = None

    def merge(self, other: PlanChecks) -> None:
        """Add the windows ``other`` (made with the same metadata, ``mergeable``) was fed."""
        if self.error is not None:
            return
        self.broken |= other.broken
        for part in ("layout", "counts", "coverage", "budget_check", "shapes", "steps", "lr", "straggler", "loss"):
            getattr(self, part).merge(getattr(other, part))
        if self.memory is not None:
            self.memory += other.memory

    def results(self) -> list[Check]:
        if self.error is not None:
            return [Check("budget", False, self.error)]
        self.close()
        checks = [self.layout.result(), self.counts.result()]
        if self.broken:
            return checks
        checks += [self.coverage.result(), self.budget_check.result(), self.shapes.result(), self.steps.result(),
                   self.lr.result()]
        if self.memory is not None:
            from .memory.budget import memory_check

            windows = sorted(self.memory, key=lambda m: m[0])
            b = np.concatenate([m[1] for m in windows]) if windows else np.zeros(0, np.int32)
            t = np.concatenate([m[2] for m in windows]) if windows else np.zeros(0, np.int32)
            ok, detail = memory_check(b, t, self.budget, *self.memory_args)
            checks.append(Check("memory", ok, detail))
        checks += [self.straggler.result(), self.loss.result()]
        return checks


def run_checks(a: PlanArrays, meta: dict, *, max_memory=None, profile_path: str | None = None) -> list[Check]:
    """Every check of a plan held whole in arrays (one window)."""
    split = split_info([a], meta) if a.starts is not None and a.sample_length is None else None
    checks = PlanChecks(meta, split=split, lengths=a.sample_length is not None, max_memory=max_memory,
                        profile_path=profile_path)
    checks.update(a)
    return checks.results()
