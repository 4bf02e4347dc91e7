"""Steps x ranks x micro: compile warm-up, same shape per step, and balancing the microbatches of each
step across data-parallel ranks (the tail rule that makes an epoch whole steps is :mod:`.tail`); and
what the planner's refusals suggest (:class:`Remedies`)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..errors import InternalConsistencyError
from .batching import Microbatches, stable_argsort_int
from .shapes import pair_ids

LPT_MAX_DP = 64  # above this many ranks, deal serpentine instead of LPT (cost O(M * dp))
LPT_HEAP_MAX_STEPS = 8  # up to this many steps, LPT runs step by step on a heap (one numpy pass per slot beyond)


@dataclass(frozen=True)
class Remedies:
    """What the planner's refusals suggest: the options of the command that runs it (``varlen
    replan`` has neither ``--tail`` nor ``--drop-long``: it keeps the parent's)."""

    tail: bool = True
    drop_long: bool = True

    @property
    def fewer_slots(self) -> str:
        return "lower --dp/--grad-accum" + (" or pass --tail drop" if self.tail else "")

    @property
    def or_drop_long(self) -> str:
        return " or pass --drop-long" if self.drop_long else ""

    @property
    def too_long_packed(self) -> str:
        return ("pass --split-long, --drop-long or a larger --seq-len" if self.drop_long else
                "plan afresh with --split-long, --drop-long or a larger --seq-len")


PLAN_REMEDIES = Remedies()  # varlen plan's: --tail drop and --drop-long are its options


def tail_message(num: int, slots: int, dp: int, grad_accum: int, what: str = "samples",
                 remedies: Remedies = PLAN_REMEDIES) -> str:
    return (f"{num:,} {what} cannot fill {slots:,} microbatch slots ({slots // (dp * grad_accum):,} step(s) x dp {dp} "
            f"x grad-accum {grad_accum}) without duplicating samples; {remedies.fewer_slots}")


def balanced_shuffle(cost: np.ndarray, slots: int, rng: np.random.Generator, window_steps: int = 64) -> np.ndarray:
    """A random microbatch order whose steps hold microbatches of similar cost: shuffle, sort by cost
    inside windows of ``window_steps`` steps, cut into steps, shuffle the steps. Random at the
    window level, and the ranks of a step finish together (straggler near 1 even with grad_accum 1,
    where balancing inside a step cannot help)."""
    m = len(cost)
    perm = rng.permutation(m)
    window = np.arange(m) // (window_steps * slots)
    seq = perm[np.lexsort((cost[perm], window))]
    steps = m // slots
    return seq.reshape(steps, slots)[rng.permutation(steps)].reshape(-1)


# -- ranks -----------------------------------------------------------------------------------------
def assign_ranks(cost: np.ndarray, dp: int, grad_accum: int) -> np.ndarray:
    """Rank of every microbatch of a (steps x slots) cost matrix: each rank gets ``grad_accum`` per
    step, loads as equal as possible. LPT (largest first onto the least-loaded rank with a free
    slot), vectorised across steps; serpentine dealing for very many ranks."""
    steps, slots = cost.shape
    if steps == 0:
        return np.zeros((0, slots), np.int64)
    order = np.argsort(-cost, axis=1, kind="stable")
    if dp == 1:
        return np.zeros((steps, slots), np.int64)
    rank = np.empty((steps, slots), np.int64)
    rows = np.arange(steps)
    if dp > LPT_MAX_DP:
        p = np.arange(slots)
        rnd, within = p // dp, p % dp
        deal = np.where(rnd % 2 == 0, within, dp - 1 - within)
        rank[rows[:, None], order] = deal[None, :]
        return rank
    if steps <= LPT_HEAP_MAX_STEPS:  # a step or a few (varlen_cli.online): a heap per step, the same ranks
        for s in range(steps):
            rank[s] = _lpt_heap(cost[s], order[s], dp, grad_accum)
        return rank
    load = np.zeros((steps, dp), np.float64)
    used = np.zeros((steps, dp), np.int64)
    for j in range(slots):
        idx = order[:, j]
        c = cost[rows, idx]
        r = np.argmin(np.where(used < grad_accum, load, np.inf), axis=1)
        rank[rows, idx] = r
        load[rows, r] += c
        used[rows, r] += 1
    return rank


def _lpt_heap(cost: np.ndarray, order: np.ndarray, dp: int, grad_accum: int) -> np.ndarray:
    """One step of :func:`assign_ranks`'s LPT with a heap of (load, rank): the least-loaded rank with a
    free slot, the lowest rank among equal loads (as the vectorised argmin picks), in O(slots log dp)."""
    heap = [(0.0, r) for r in range(dp)]
    used = [0] * dp
    rank = np.empty(len(cost), np.int64)
    values = cost.tolist()
    for idx in order.tolist():
        load, r = heapq.heappop(heap)
        rank[idx] = r
        used[r] += 1
        if used[r] < grad_accum:
            heapq.heappush(heap, (load + values[idx], r))
    return rank


@dataclass
class EpochLayout:
    order: np.ndarray  # microbatch index per plan row (rows in (step, rank, micro) order)
    step: np.ndarray  # epoch-local step per row
    rank: np.ndarray
    micro: np.ndarray
    warmup_steps: int = 0
    warmup_missing: int = 0  # (shape, rank) pairs the warm-up could not cover


def shape_ids(seqlen: np.ndarray, batch: np.ndarray | None) -> np.ndarray:
    return pair_ids(np.zeros(len(seqlen), np.int64) if batch is None else batch, seqlen)[2]


def same_shape_steps(mb: Microbatches, slots: int) -> None:
    """All microbatches of a step (consecutive groups of ``slots``) get the step's largest T and B."""
    if not mb.count:
        return
    t = mb.seqlen.reshape(-1, slots).max(axis=1)
    b = mb.batch_size.reshape(-1, slots).max(axis=1)
    mb.seqlen = np.repeat(t, slots)
    mb.batch_size = np.repeat(b, slots)


def layout_epoch(mb: Microbatches, cost: np.ndarray, dp: int, grad_accum: int, *, warmup: bool,
                 same_shape: bool, static: bool, ranked: bool = False) -> EpochLayout:
    """Steps, ranks and micro indices of an epoch's microbatches. ``ranked``: the microbatches come
    in (step, rank, micro) order already (compute-balanced packed plans) and keep their ranks."""
    slots = dp * grad_accum
    m = mb.count
    steps = m // slots
    if steps * slots != m:
        raise InternalConsistencyError(f"{m} microbatches do not fill whole steps of {slots}")
    seq_index = np.arange(m, dtype=np.int64)
    warmup_steps, missing = 0, 0
    step_of = seq_index // slots
    fixed_rank = None
    fixed_micro = None
    if warmup and m:
        if same_shape:
            seq_index, warmup_steps, missing = _warmup_steps(mb, slots)
            step_of = np.empty(m, np.int64)
            step_of[seq_index] = np.arange(m) // slots
        else:
            seq_index, fixed_rank, fixed_micro, warmup_steps, missing = _warmup_micro(mb, dp, grad_accum, static)
            step_of = np.empty(m, np.int64)
            step_of[seq_index] = np.arange(m) // slots
    # position of each microbatch in the (re)ordered sequence
    pos = np.empty(m, np.int64)
    pos[seq_index] = np.arange(m)
    cost_mat = cost[seq_index].reshape(steps, slots)
    if ranked:  # whole steps may move (warm-up), ranks stay
        rank_mat = np.broadcast_to(np.arange(slots) // grad_accum, (steps, slots))
    else:
        rank_mat = assign_ranks(cost_mat, dp, grad_accum)
    rank = np.empty(m, np.int64)
    rank[seq_index] = rank_mat.reshape(-1)
    micro_key = pos.copy()
    if fixed_rank is not None:
        w = warmup_steps * slots
        head = seq_index[:w]
        rank[head] = fixed_rank
        micro_key[head] = fixed_micro
    order = np.lexsort((micro_key, rank, step_of))
    micro = np.arange(m, dtype=np.int64) % grad_accum
    return EpochLayout(order, step_of[order], rank[order], micro, warmup_steps, missing)


def _warmup_steps(mb: Microbatches, slots: int):
    """Same shape per step: the first step of every shape (largest T first) moves to the front."""
    steps = mb.count // slots
    sid = shape_ids(mb.seqlen[::slots], mb.batch_size[::slots])
    t = mb.seqlen[::slots]
    first = np.full(sid.max() + 1, -1, np.int64)
    rev = np.arange(steps)[::-1]
    first[sid[rev]] = rev  # first step of each shape
    lead = first[np.argsort(-t[first], kind="stable")]
    rest = np.setdiff1d(np.arange(steps), lead)
    step_order = np.concatenate([lead, rest])
    seq_index = (step_order[:, None] * slots + np.arange(slots)[None, :]).reshape(-1)
    return seq_index, len(lead), 0


def _warmup_micro(mb: Microbatches, dp: int, grad_accum: int, static: bool):
    """Every rank meets every shape in the first ceil(K / grad_accum) steps: rank r's j-th warm-up
    micro has the j-th shape (largest T first, so the allocator sees the peak early)."""
    slots = dp * grad_accum
    m = mb.count
    sid = shape_ids(mb.seqlen, mb.batch_size if static else None)
    k = int(sid.max()) + 1
    # T of each shape id, largest first
    t_of = np.zeros(k, np.int64)
    t_of[sid] = mb.seqlen
    shape_order = np.argsort(-t_of, kind="stable")
    w = min(-(-k // grad_accum), m // slots)
    o = stable_argsort_int(sid)
    starts = np.searchsorted(sid[o], np.arange(k), side="left")
    grid = np.full((w, dp, grad_accum), -1, np.int64)
    missing = 0
    for j, s in enumerate(shape_order.tolist()):
        hi = starts[s + 1] if s + 1 < k else m
        picks = o[starts[s]:min(hi, starts[s] + dp)]
        if j >= w * grad_accum:
            missing += dp
            continue
        ws, a = divmod(j, grad_accum)
        grid[ws, : len(picks), a] = picks
        missing += dp - len(picks)
    used = np.zeros(m, bool)
    flat = grid.reshape(-1)
    used[flat[flat >= 0]] = True
    free = np.flatnonzero(~used)
    holes = np.flatnonzero(flat < 0)
    flat[holes] = free[: len(holes)]
    used[flat] = True
    rest = np.flatnonzero(~used)
    # warm-up rows are listed in (step, rank, micro) order already
    seq_index = np.concatenate([flat, rest])
    ranks = np.tile(np.repeat(np.arange(dp), grad_accum), w)
    micros = np.tile(np.arange(grad_accum), w * dp)
    return seq_index, ranks, micros, w, missing
