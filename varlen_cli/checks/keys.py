"""Entries as keys: one key space over every source of a plan (:class:`Keys`, :func:`keys_of`), the
copies a mixture's epoch holds of each key (:func:`mixture_copies`, the one definition the planner
uses too), and :class:`Bitmap`, one bit per key."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import PlanArrays


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
class Keys:
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


def keys_of(meta: dict) -> Keys:
    mix = meta.get("mixture")
    if not mix:
        n = int((meta.get("input") or {}).get("num_rows") or 0)
        return Keys(n, None, np.array([0, n], np.int64), ["input"])
    sources = mix["sources"]
    sizes = np.array([int(s["num_rows"]) for s in sources], np.int64)
    offset = np.concatenate([[0], np.cumsum(sizes)])
    expected = np.concatenate([mixture_copies(int(s["num_rows"]), float(s["weight"]), int(mix.get("seed", 0)), k)
                               for k, s in enumerate(sources)]) if len(sources) else np.zeros(0, np.int64)
    return Keys(int(offset[-1]), expected, offset, [s["name"] for s in sources])


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
