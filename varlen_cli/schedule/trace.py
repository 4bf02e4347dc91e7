"""``varlen simulate PLAN --trace TRACE.json``: the simulated schedule as Chrome trace events, the
JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open.

One process per worker (a GPU rank) and schedule, one thread (track) per pipeline stage it runs: a
track per (worker, stage). Each forward and backward of a microbatch is one complete event
(``"ph": "X"``) with the simulator's start time and duration, steps laid end to end (step k starts
where the steps before it end, the gradient sync between them), plus a ``steps`` track of one event
a step; so the last event ends at the simulated makespan (``simulate --json``'s ``makespan``). Times
are the simulator's cost units (the plan's budget: padded ``B*T + A*B*T^2`` or packed
``tokens + A*sum(l^2)``), written as microseconds. The file is written as it is computed (memory:
one chunk of steps); its first key is ``"format": "varlen-trace"`` (``--overwrite`` looks for it).
"""

from __future__ import annotations

import json

import numpy as np

from ..errors import OutputError, UsageError
from .engine import build_jobs, unit_starts

MAX_TRACE_EVENTS = 4_000_000  # about 600 MB of JSON; Perfetto's UI opens about that much
PID_STRIDE = 100_000  # the pid of worker w in the k-th schedule of the trace: k * PID_STRIDE + w
CHUNK_JOBS = 1 << 18  # job times computed at a time (steps x jobs of one unit)


def trace_steps(num_steps: int, limit: int | None) -> int:
    """The steps a trace holds: the first ``limit`` (every step without one)."""
    return num_steps if limit is None else max(0, min(int(limit), num_steps))


def check_trace_size(schemes: list, steps: int, limit: int | None) -> None:
    """Refuse, before any work, a trace too large to open (:data:`MAX_TRACE_EVENTS`)."""
    per_step = sum(2 * s.stages * s.microbatches for s in schemes)
    if per_step * steps > MAX_TRACE_EVENTS:
        fits = max(1, MAX_TRACE_EVENTS // max(per_step, 1))
        given = f"--trace-steps {limit}" if limit is not None else f"its {steps:,} steps"
        raise UsageError(f"the trace of {given} would hold {per_step * steps:,} events ({per_step:,} a step; at most "
                         f"{MAX_TRACE_EVENTS:,}): pass --trace-steps {fits} (or fewer), or --schedule with one scheme")


def _event(name: str, cat: str, ts: float, dur: float, pid: int, tid: int, args: dict) -> str:
    return json.dumps({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid,
                       "args": args}, separators=(",", ":"))


def _metadata(pid: int, name: str, threads: dict) -> list[str]:
    """Names and order of a process and its threads (``"ph": "M"`` events)."""
    out = [json.dumps({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}),
           json.dumps({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})]
    for tid, label in sorted(threads.items()):
        out.append(json.dumps({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}}))
        out.append(json.dumps({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                               "args": {"sort_index": tid}}))
    return out


class _Events:
    """The ``traceEvents`` list, written one event at a time."""

    def __init__(self, fh):
        self.fh, self.count = fh, 0

    def add(self, line: str) -> None:
        self.fh.write(("," if self.count else "") + line)
        self.count += 1


def _scheme_events(out: _Events, k: int, scheme, result, costs, r: float, steps: int) -> None:
    """Write the events of one scheme's first ``steps`` steps."""
    base = k * PID_STRIDE
    offsets = np.concatenate([[0.0], np.cumsum(result.steps[:steps])])
    per_step, accum = costs.per_step, costs.grad_accum
    lanes: dict = {}
    for unit in range(scheme.units):
        jobs = build_jobs(scheme, unit)
        n = scheme.microbatches // scheme.units
        for w, s in set(zip(jobs.worker.tolist(), jobs.stage.tolist())):
            lanes.setdefault(w, {})[s] = f"stage {s}"
        rows = max(1, CHUNK_JOBS // jobs.size)
        for lo in range(0, steps, rows):
            hi = min(steps, lo + rows)
            start, dur = unit_starts(scheme, jobs, costs.cost[lo:hi, jobs.first:jobs.first + n], r)
            start = start + offsets[lo:hi, None]
            columns = (jobs.worker.tolist(), jobs.stage.tolist(), jobs.micro.tolist(), jobs.backward.tolist())
            for i in range(hi - lo):
                for t, d, w, s, m, b in zip(start[i].tolist(), dur[i].tolist(), *columns):
                    out.add(_event(f"{'B' if b else 'F'} {m}", "backward" if b else "forward", t, d, base + w, s,
                                   {"step": lo + i, "microbatch": m, "rank": m // accum, "micro": m % accum}))
    for w, threads in sorted(lanes.items()):
        for line in _metadata(base + w, f"{scheme.name} worker {w}", threads):
            out.add(line)
    steps_pid = base + PID_STRIDE - 1
    for line in _metadata(steps_pid, f"{scheme.name} steps", {0: "optimizer steps"}):
        out.add(line)
    for i in range(steps):
        out.add(_event(f"step {i}", "step", float(offsets[i]), float(result.steps[i]), steps_pid, 0,
                       {"step": i, "makespan": float(result.steps[i]), "microbatches": per_step}))


def check_trace_output(path: str, overwrite: bool, plan: str) -> None:
    """Refuse, before any work, a trace output that cannot be written: in object storage, the plan
    itself, or an existing file without ``overwrite`` (or that varlen did not write)."""
    from .. import storage
    from ..runtime import safety

    if storage.is_remote(path):
        raise UsageError(f"--trace {path}: a trace is written to a local file (copy it to object storage after)")
    safety.check_no_overlap(path, [plan])
    safety.check_replaceable(path, overwrite, "trace")


def write_trace(path: str, pairs: list, costs, r: float, limit: int | None, overwrite: bool) -> int:
    """Write the trace of ``pairs`` (``(scheme, ScheduleResult)``, simulated over ``costs``) to ``path``
    (a local file, written atomically); returns the steps it holds."""
    from .. import format
    from ..runtime import artifacts

    check_trace_output(path, overwrite, costs.path)
    steps = trace_steps(costs.num_steps, limit)
    head = {"format": format.TRACE_FORMAT, "displayTimeUnit": "ms",
            "otherData": {"generator": "varlen simulate", "plan": costs.path, "steps": steps,
                          "time_unit": "the simulator's cost units (the plan's budget), as microseconds",
                          "schedules": [{"schedule": res.schedule, "pid": k * PID_STRIDE, "workers": res.workers,
                                         "stages": res.stages, "makespan": res.makespan,
                                         "makespan_traced": float(res.steps[:steps].sum())}
                                        for k, (_, res) in enumerate(pairs)]}}
    with artifacts.atomic_file(path, overwrite, inputs=[costs.path], kind="trace") as out:
        try:
            with open(out.tmp, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(head)[:-1] + ', "traceEvents": [')
                events = _Events(fh)
                for k, (scheme, res) in enumerate(pairs):
                    _scheme_events(events, k, scheme, res, costs, r, steps)
                fh.write("]}\n")
        except OSError as exc:  # a full disk: the user's, not varlen's
            raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    return steps
