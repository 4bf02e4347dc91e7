"""The greedy master scheduler, vectorised across steps, and the job times of a unit (:func:`unit_starts`:
the closed forms where they apply, else the scheduler).

Jobs of one unit (a block of the step's microbatches that shares no worker with the others) are
numbered ``j = d * S * n + s * n + i`` (``d`` 0 forward / 1 backward, stage ``s``, ``i``-th
microbatch of the unit). A job may start when its predecessors are done:

* ``F(s, b)`` after ``F(s-1, b)``; ``B(S-1, b)`` after ``F(S-1, b)``; ``B(s, b)`` after ``B(s+1, b)``;
* with ``flush``: ``B(S-1, b)`` after every ``F(S-1, .)`` of the unit (GPipe: backward after the
  whole forward);
* with ``in_flight(s) = L``: the k-th forward of stage s (in priority order) after the (k-L)-th
  backward of stage s (at most L microbatches hold activations of the stage).

Greedy rule (non-delay list scheduling): whenever a worker is idle and one of its jobs is ready, it
starts the ready job of smallest ``priority`` (ties: smallest job number). Events are processed in
time order; decisions at the same time on different workers are independent (durations are > 0).

All steps have the same jobs with different durations, so the scheduler runs every step at once:
``J`` iterations, each scheduling one job in every step with numpy over the steps. Within one
iteration only the first unscheduled job of each chain (the jobs of one worker, stage and direction,
in priority order) is a candidate; for schemes whose chains become ready in priority order
(``Scheme.chains``, true for the built-in ones) that is exact, otherwise every job is its own chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from .closed import chain_starts, gpipe_starts
from .schemes import BACKWARD, FORWARD, Scheme


@dataclass(frozen=True)
class Jobs:
    """The jobs of one unit: ``n`` microbatches ``first .. first+n-1`` of the step over S stages."""

    stages: int
    n: int
    first: int
    micro: np.ndarray  # (J,) microbatch index in the step
    stage: np.ndarray  # (J,)
    backward: np.ndarray  # (J,) bool
    worker: np.ndarray  # (J,) global worker
    deps: np.ndarray  # (J + 1, D) predecessor job numbers, J = none (row J: the sentinel)
    rank: np.ndarray  # (J + 1,) position in priority order (sentinel last)
    chains: np.ndarray  # (C, L + 1) job numbers of each chain in priority order, padded with J
    chain_worker: np.ndarray  # (C,)
    flush: np.ndarray  # forwards every flushed job waits for (empty without flush)
    flushed: np.ndarray  # (J + 1,) bool: the jobs that wait for the flush (B(S-1, .))

    @property
    def size(self) -> int:
        return len(self.micro)


def build_jobs(scheme: Scheme, unit: int) -> Jobs:
    """The job table of ``unit`` (microbatches ``unit * n .. (unit+1) * n - 1``) under ``scheme``."""
    S, n = scheme.stages, scheme.microbatches // scheme.units
    first = unit * n
    J = 2 * S * n
    d_idx, rest = np.divmod(np.arange(J), S * n)
    s_idx, i_idx = np.divmod(rest, n)
    micro = first + i_idx
    direction = [FORWARD, BACKWARD]
    worker = np.array([scheme.compute(int(s), int(b), direction[d]) for d, s, b in zip(d_idx, s_idx, micro)],
                      dtype=np.int64)
    bad = worker[(worker < 0) | (worker >= scheme.workers)]
    if bad.size:
        raise UsageError(f"--schedule {scheme.name}: compute() returned worker {int(bad[0])} "
                         f"outside 0 .. {scheme.workers - 1}")
    keys = [scheme.priority(int(s), int(b), direction[d]) for d, s, b in zip(d_idx, s_idx, micro)]
    order = sorted(range(J), key=lambda j: (keys[j], j))
    rank = np.empty(J + 1, dtype=np.int64)
    rank[order] = np.arange(J)
    rank[J] = J
    deps = _dependencies(scheme, S, n, J, rank)
    chains, chain_worker = _chains(scheme, worker, d_idx, s_idx, order, J)
    flushed = np.zeros(J + 1, dtype=bool)
    flush = np.arange((S - 1) * n, S * n) if scheme.flush else np.zeros(0, dtype=np.int64)
    flushed[flush + S * n] = True
    return Jobs(stages=S, n=n, first=first, micro=micro, stage=s_idx, backward=d_idx == 1, worker=worker,
                deps=deps, rank=rank, chains=chains, chain_worker=chain_worker, flush=flush, flushed=flushed)


def _dependencies(scheme: Scheme, S: int, n: int, J: int, rank: np.ndarray) -> np.ndarray:
    i = np.arange(n)
    lists: list[list[int]] = [[] for _ in range(J)]

    def fwd(s: int) -> np.ndarray:
        return s * n + i

    def bwd(s: int) -> np.ndarray:
        return S * n + s * n + i

    for s in range(S):
        if s:
            for f, pred in zip(fwd(s), fwd(s - 1)):
                lists[f].append(int(pred))
        preds = fwd(S - 1) if s == S - 1 else bwd(s + 1)
        for b, pred in zip(bwd(s), preds):
            lists[b].append(int(pred))  # the flush (GPipe) is applied by greedy() itself
        limit = scheme.in_flight(s) if scheme.in_flight is not None else None
        if limit is not None:
            if limit < 1:
                raise UsageError(f"--schedule {scheme.name}: in_flight({s}) must be >= 1 (got {limit})")
            f_order = fwd(s)[np.argsort(rank[fwd(s)], kind="stable")]
            b_order = bwd(s)[np.argsort(rank[bwd(s)], kind="stable")]
            for k in range(limit, n):
                lists[int(f_order[k])].append(int(b_order[k - limit]))
    width = max(1, max((len(x) for x in lists), default=1))
    deps = np.full((J + 1, width), J, dtype=np.int64)
    for j, x in enumerate(lists):
        deps[j, :len(x)] = x
    return deps


def _chains(scheme: Scheme, worker, d_idx, s_idx, order, J):
    if scheme.chains:
        keys = {}
        for j in order:  # priority order: each chain lists its jobs in that order
            keys.setdefault((int(worker[j]), int(s_idx[j]), int(d_idx[j])), []).append(j)
        groups = list(keys.values())
    else:
        groups = [[j] for j in order]
    longest = max(len(g) for g in groups)
    chains = np.full((len(groups), longest + 1), J, dtype=np.int64)
    for c, g in enumerate(groups):
        chains[c, :len(g)] = g
    chain_worker = np.array([worker[g[0]] for g in groups], dtype=np.int64)
    return chains, chain_worker


def _extended(jobs: Jobs):
    """Tables with two sentinels: job J (no dependency, finished at 0) and J+1 (chain done, never ready)."""
    J = jobs.size
    done = J + 1
    chains = np.where(jobs.chains == J, done, jobs.chains)
    deps = np.vstack([jobs.deps, np.full((1, jobs.deps.shape[1]), done)])
    rank = np.append(jobs.rank, J + 2)
    flushed = np.append(jobs.flushed, False)
    chain_of = np.zeros(J + 2, dtype=np.int64)
    for c, row in enumerate(jobs.chains):
        chain_of[row[row < J]] = c
    users: list[list[int]] = [[] for _ in range(J + 2)]
    for k in range(J):
        for d in set(jobs.deps[k].tolist()) - {J}:
            users[d].append(k)
    dependents = np.full((J + 2, max(1, max(len(u) for u in users))), done, dtype=np.int64)
    for d, u in enumerate(users):
        dependents[d, :len(u)] = u
    return chains, deps, rank, flushed, chain_of, dependents


def greedy(jobs: Jobs, durations: np.ndarray) -> np.ndarray:
    """Start times ``(rows, J)`` of the greedy schedule of every row of ``durations`` ``(rows, J)``.

    Each iteration starts one job in every row: the candidate (chain head) with the earliest
    possible start, ties to the smallest priority rank (any worker's best ready job at that instant
    is also the best of its own worker). The heads' ready times are kept up to date incrementally:
    when a job finishes, only its dependents that are chain heads are recomputed.
    """
    rows, J = durations.shape
    chains, deps, rank, flushed, chain_of, dependents = _extended(jobs)
    r = np.arange(rows)
    finish = np.full((J + 2, rows), np.inf)  # job-major, so each gather reads whole rows of steps
    finish[J] = 0.0
    dur = np.ascontiguousarray(durations.T)
    start = np.zeros((J, rows))
    workers, local = np.unique(jobs.chain_worker, return_inverse=True)
    free = np.zeros((len(workers), rows))
    C = len(chains)
    head = np.zeros((C, rows), dtype=np.int64)
    hj = np.repeat(chains[:, :1], rows, axis=1)  # (C, rows) the next job of each chain
    head_rank = rank[hj]
    flush_left, flush_end = np.full(rows, jobs.flush.size), np.zeros(rows)
    in_flush = np.zeros(J + 2, dtype=bool)
    in_flush[jobs.flush] = True

    def ready_of(k, cols):
        """When jobs ``k`` (of rows ``cols``) may start, from what has finished so far."""
        ready = finish[deps[k, 0], cols]
        for d in range(1, deps.shape[1]):
            ready = np.maximum(ready, finish[deps[k, d], cols])
        if jobs.flush.size:  # GPipe: the backward waits until every forward of the last stage is done
            flush_at = np.where(flush_left[cols] == 0, flush_end[cols], np.inf)
            ready = np.where(flushed[k], np.maximum(ready, flush_at), ready)
        return ready

    ready = ready_of(hj, r[None, :])
    big = J + 3
    job_by_rank = np.zeros(2 * big + 1, dtype=np.int64)
    job_by_rank[rank[:J]] = np.arange(J)
    for _ in range(J):
        when = np.maximum(ready, free[local])
        t = when.min(axis=0)
        if not np.all(np.isfinite(t)):
            raise UsageError("the schedule deadlocks: a job waits for one that can never run (check the "
                             "scheme's priority, in_flight and compute functions)")
        j = job_by_rank[(head_rank + big * (when != t)).min(axis=0)]  # ranks are unique: no argmin
        c = chain_of[j]
        end = t + dur[j, r]
        start[j, r] = t
        finish[j, r] = end
        free[local[c], r] = end
        if jobs.flush.size:
            last = in_flush[j] & (flush_left == 1)
            flush_left -= in_flush[j]
            flush_end = np.where(in_flush[j], np.maximum(flush_end, end), flush_end)
            if last.any():  # the flush is over in these rows: their waiting heads may start
                cols = np.flatnonzero(last)
                ready[:, cols] = ready_of(hj[:, cols], cols[None, :])
        head[c, r] += 1
        nxt = chains[c, head[c, r]]
        hj[c, r] = nxt
        head_rank[c, r] = rank[nxt]
        ready[c, r] = ready_of(nxt, r)
        for m in range(dependents.shape[1]):
            k = dependents[j, m]
            ck = chain_of[k]
            heads = np.flatnonzero(hj[ck, r] == k)
            if heads.size:
                ready[ck[heads], heads] = ready_of(k[heads], heads)
    return start.T


def unit_starts(scheme: Scheme, jobs: Jobs, costs: np.ndarray, r: float) -> tuple[np.ndarray, np.ndarray]:
    """Start times and durations ``(rows, J)`` of one unit's jobs; ``costs`` is ``(rows, n)``."""
    per_job = costs[:, jobs.micro - jobs.first] * np.where(jobs.backward, r, 1.0)[None, :]
    if scheme.closed_form == "chain":
        return chain_starts(costs, scheme.stages, r), per_job
    if scheme.closed_form == "gpipe":
        return gpipe_starts(costs, scheme.stages, r), per_job
    return greedy(jobs, per_job), per_job
