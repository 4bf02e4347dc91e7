"""Which shapes ``varlen calibrate --model`` measures (``--shapes auto``): a walk along the limit.

The plans that matter put their largest microbatches just under the limit, at every T the data has,
so the profile must be right there, and measuring far beyond it only costs time. The walk:

1. at ``t_min`` (16) B = 1, 4, 16, ... while the next B's peak, extrapolated linearly in B, stays
   under the limit; then the B extrapolated to reach the limit (the fixed cost comes from B = 1);
2. T doubles; at each T the B predicted to reach the limit from the per-token cost at the T before
   (linear in T through the last two), measured, and once more at the B extrapolated from that
   measurement when it landed under 90% of the limit (or over it);
3. it stops at the first T where B = 1 is predicted over the limit, after measuring B = 1 at the
   longest T predicted to fit (no sample longer than that can be planned under the limit), or at
   ``--max-seqlen``.

With ``ladder`` (no ``--max-memory``: the limit is the calibration memory, far above most plans'
limits) every T also gets a point at a quarter of its largest B, so lower limits are inside the
measured range too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

T_MIN = 16
MAX_POINTS = 32
TARGET = 0.97  # aim a little under the limit ...
NEAR = 0.9  # ... a point at 90% of it or more is close enough ...
BEYOND = 1.05  # ... and one up to 5% over it is a good point too (the fit uses every point)


class _Walk:
    def __init__(self, measure: Callable[[int, int], dict], limit: float, max_points: int):
        self.measure_fn, self.limit, self.max_points = measure, float(limit), max_points
        self.points: list[dict] = []
        self.c0 = 0.0  # the peak at 1 x t_min: the fixed cost (a lower bound of the fit's c0)
        self.per_token: list[tuple[int, float]] = []  # (T, growth per token at the largest fitting B)

    def full(self) -> bool:
        return len(self.points) >= self.max_points

    def take(self, b: int, t: int) -> dict | None:
        """Measure (b, t) (once: a shape measured before is that point); None when it ran out of memory."""
        done = next((p for p in self.points if (p["batch_size"], p["seqlen"]) == (b, t)), None)
        if done is not None:
            return done
        r = self.measure_fn(b, t)
        if r.get("oom"):
            return None
        self.points.append(r)
        return r

    def fits(self, r: dict | None) -> bool:
        """Close enough to the limit to stand for it (at most ``BEYOND`` times it)."""
        return r is not None and r["peak_bytes"] <= BEYOND * self.limit

    def b_at_limit(self, r: dict) -> int:
        """The B at which a peak linear in B through (0, c0) and ``r`` reaches ``TARGET`` x the limit."""
        growth = max(r["peak_bytes"] - self.c0, 1.0) / r["batch_size"]
        return int(max(0.0, TARGET * self.limit - self.c0) // growth)

    def per_token_at(self, t: int) -> float:
        """Growth per token at T, linear in T through the last two T measured (constant with one)."""
        (t1, q1), (t2, q2) = (self.per_token[-2:] if len(self.per_token) > 1 else self.per_token * 2)
        slope = (q2 - q1) / (t2 - t1) if t2 != t1 else 0.0
        return max(q2 + max(slope, 0.0) * (t - t2), 1e-9)

    def record(self, r: dict) -> None:
        n = r["batch_size"] * r["seqlen"]
        self.per_token.append((r["seqlen"], max(r["peak_bytes"] - self.c0, 1.0) / n))

    def longest_t(self) -> int:
        """The T at which B = 1 reaches the limit, per-token cost linear in T (q(T) = a + s T)."""
        (t1, q1), (t2, q2) = (self.per_token[-2:] if len(self.per_token) > 1 else self.per_token * 2)
        s = max((q2 - q1) / (t2 - t1), 0.0) if t2 != t1 else 0.0
        a = q2 - s * t2
        room = max(TARGET * self.limit - self.c0, 0.0)
        if s <= 0:
            return int(room / max(a, 1e-9))
        return int((-a + math.sqrt(a * a + 4 * s * room)) / (2 * s))


def walk(measure: Callable[[int, int], dict], limit: float, t_max: int | None = None, ladder: bool = False,
         t_min: int = T_MIN, max_points: int = MAX_POINTS) -> list[dict]:
    """The measured points (dicts with batch_size, seqlen, peak_bytes) of the walk above."""
    w = _Walk(measure, limit, max_points)
    t = min(t_min, t_max) if t_max else t_min
    first = w.take(1, t)
    if not w.fits(first):
        return w.points  # B = 1 at the shortest T does not fit: the caller says so
    w.c0 = first["peak_bytes"]
    top = _ladder_at_first_t(w, t)
    w.record(top)
    while not w.full() and (t_max is None or t < t_max):
        nxt = 2 * t if t_max is None else min(2 * t, t_max)
        guess = int((TARGET * w.limit - w.c0) // (w.per_token_at(nxt) * nxt))
        if guess < 1:
            _longest(w, t, t_max)
            break
        top = _frontier_at(w, guess, nxt)
        if top is None:
            _longest(w, t, t_max)
            break
        w.record(top)
        if ladder and top["batch_size"] >= 4 and not w.full():
            w.take(top["batch_size"] // 4, nxt)
        t = nxt
    return w.points


def _ladder_at_first_t(w: _Walk, t: int) -> dict:
    """B = 1, 4, 16, ... while the next stays under the limit, then the B reaching it; the largest fitting point."""
    top = w.points[-1]
    b = 1
    while not w.full():
        here = [p for p in w.points if p["seqlen"] == t]
        nxt = 4 * b
        if _extrapolate(here, w.c0, nxt) > TARGET * w.limit:
            break
        r = w.take(nxt, t)
        if not w.fits(r):
            return top
        top, b = r, nxt
    frontier = w.b_at_limit(top)
    if frontier > top["batch_size"] and not w.full():
        r = w.take(frontier, t)
        if w.fits(r):
            top = r
    return top


def _frontier_at(w: _Walk, guess: int, t: int) -> dict | None:
    """Measure the predicted largest B at T, and once more where that measurement says the limit is;
    the largest fitting point (None when B = 1 does not fit)."""
    r = w.take(guess, t)
    if w.fits(r):
        better = w.b_at_limit(r)
        if r["peak_bytes"] >= NEAR * w.limit or better <= guess or w.full():
            return r
        r2 = w.take(better, t)
        return r2 if w.fits(r2) else r
    b = guess
    while b > 1 and not w.full():  # over the limit (or out of memory): come back under it
        b = max(1, min(b - 1, w.b_at_limit(r)) if r is not None else b // 2)
        r = w.take(b, t)
        if w.fits(r):
            return r
    return None


def _longest(w: _Walk, t_done: int, t_max: int | None) -> None:
    """B = 1 at the longest T predicted to fit (when it is beyond the last T measured), once more from
    that point when it landed under 90% of the limit: no T that can be planned is left beyond the points."""
    for _ in range(2):
        t_long = w.longest_t()
        if t_max is not None:
            t_long = min(t_long, t_max)
        if t_long <= t_done * 1.05 or w.full():
            return
        r = w.take(1, t_long)
        if r is None or r["peak_bytes"] >= NEAR * w.limit:
            return
        w.record(r)
        t_done = t_long


def _extrapolate(here: list[dict], c0: float, b: int) -> float:
    """The peak at B from the points at one T: linear through the last two (through c0 with one)."""
    last = here[-1]
    if len(here) == 1:
        return c0 + (last["peak_bytes"] - c0) * b / last["batch_size"]
    prev = here[-2]
    slope = (last["peak_bytes"] - prev["peak_bytes"]) / (last["batch_size"] - prev["batch_size"])
    return last["peak_bytes"] + slope * (b - last["batch_size"])
