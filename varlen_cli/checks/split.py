"""The split samples of a ``--split-long`` plan (:class:`SplitInfo`, from :func:`split_info`): which
entry completes a sample, when the samples' lengths are not at hand."""

from __future__ import annotations

import numpy as np

from .arrays import compact
from .keys import Bitmap, keys_of

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
        self.max_start = compact(top & ((1 << _START_BITS) - 1) if packed else top)
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
