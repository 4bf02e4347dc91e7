"""The coverage check: every sample (every copy of a mixture's) once per epoch or listed as dropped,
a replan's first epoch short by exactly what its lineage consumed, split samples' chunks tiling
them (:mod:`varlen_cli.checks.tiling`, held in memory or spilled to files by key range)."""

from __future__ import annotations

import numpy as np

from .arrays import MAX_EXAMPLES, Check, PlanArrays, compact, edges_decrease, first_met, join_values, smallest
from .key_spill import KeyRangeSpill
from .keys import Bitmap, Keys, keys_of
from .split import SplitInfo
from .tiling import tiling_found, tiling_messages, tiling_problems

SPILL_PART = 1 << 21  # split chunks a spill file is meant to hold (Coverage.spill_to; 64 MiB with lengths)
SPILL_FILES = 4096  # at most this many ranges of keys an epoch


def _dropped_keys(meta: dict, keys: Keys, epochs: int) -> tuple[np.ndarray, list]:
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


class _Seen:
    """One epoch's occurrences: a bitmap (plain plans) or a count per key (mixtures), the entries
    added, and the smallest keys met again in a later window (the examples of repeats)."""

    def __init__(self, seen, entries: int = 0, hits: np.ndarray | None = None):
        self.seen, self.entries = seen, entries
        self.hits = np.zeros(0, np.int64) if hits is None else hits

    @classmethod
    def empty(cls, keys: Keys) -> _Seen:
        return cls(Bitmap(keys.size) if keys.expected is None else np.zeros(keys.size, np.int64))

    def add(self, k: np.ndarray) -> None:
        if isinstance(self.seen, Bitmap):
            hit = self.seen.test_and_set(k)
            if hit.any():
                self.hits = smallest(self.hits, k[hit])
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
            self.hits = smallest(self.hits, other.hits, keys)
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
        self.closed: set = set()  # epochs checked: an epoch of the metadata without rows is checked empty
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
        parts = {"epoch": compact(epoch[sel]), "key": compact(k[sel]), "start": compact(a.starts[sel]),
                 "length": compact(a.lengths[sel]) if a.lengths is not None else np.zeros(int(sel.sum()), np.int32),
                 "full": compact(a.sample_length[sel]) if a.sample_length is not None else None}
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
        self.closed.add(e)
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
        self.problem = first_met(self.problem, other.problem)
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
            shown = f" (e.g. ids {join_values(seen.hits)})" if len(seen.hits) else ""
            problems.append(f"epoch {e}: {both + repeats} samples appear more than once in an epoch or more often than "
                            f"their weight{shown}")
        if missing > 0 and missing != consumed:
            shown = ""
            if self.listed or self.long_bitmap is not None:
                shown = f" (e.g. ids {join_values(present.clear_keys(gone, MAX_EXAMPLES))})"
            problems.append(f"epoch {e}: {missing} samples are missing from an epoch and not listed as dropped{shown}"
                            + (f"; {missing} missing, the lineage says {consumed} were consumed"
                               if consumed is not None else ""))
        elif consumed and missing <= 0:
            problems.append(f"epoch {e}: no sample of epoch {e} is missing, the lineage says {consumed} were consumed")
        return problems

    def result(self) -> Check:
        if self.problem is not None:
            return Check("coverage", False, self.problem[1])
        if self.out_of_order or edges_decrease(self.edges):
            return Check("coverage", False, "rows are not in epoch order")
        states, self.held, self.current, self.seen = self._states(), {}, None, None
        for e in sorted(states):
            self._close_epoch(e, states[e])
        for e in sorted(set(range(self.epochs)) - self.closed):  # no rows: each of its samples missing
            self._close_epoch(e, _Seen.empty(self.keys))
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
            problems += tiling_problems({name: v[sel] for name, v in c.items()}, int(e),
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
                found += tiling_found(c, partial)
            problems += tiling_messages(found, e, partial)
        return problems


def _count_problems(keys: Keys, occ: np.ndarray, dropped: np.ndarray, e: int, consumed: int | None) -> list[str]:
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
    elif consumed and not miss.any():
        problems.append(f"epoch {e}: no sample of epoch {e} is missing, the lineage says {consumed} were consumed")
    return problems


def _key_names(keys: Keys, where: np.ndarray) -> str:
    where = where[:MAX_EXAMPLES]
    if len(keys.names) == 1:
        return "ids " + ", ".join(str(int(w)) for w in where)
    src = np.searchsorted(keys.offset, where, side="right") - 1
    return ", ".join(f"{keys.names[s]}:{int(w - keys.offset[s])}" for s, w in zip(src, where))
