"""``varlen simulate``: what a plan's variable-length microbatches cost under each parallel schedule.

Reads the plan with pyarrow only (no torch), schedules every optimizer step on its own (steps are
separated by the gradient sync) and sums. See docs/schedules.md for the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError, UsageError
from ..runtime import rank0
from ..runtime.choices import doc
from .engine import Jobs, build_jobs, unit_starts
from .schemes import SCHEDULES, Scheme, make_scheme

_COLUMNS = ("step", "rank", "micro", "batch_size", "seqlen")
# Sizes checked before any work: the greedy scheduler takes about a millisecond per job of a step
# (every step at once; 65,536 jobs: about a minute on one core, the limit: about 7 minutes), and each
# scheme's stored-weights table has stages x workers cells.
MAX_JOBS_PER_STEP = 1 << 19
MAX_STAGE_WORKER_CELLS = 1 << 24


TRACE = "Chrome trace (--trace)"  # the --help panel of the trace file's options


@dataclass(frozen=True)
class SimulateConfig:
    """Options of ``varlen simulate``."""

    plan: str = doc(help="Plan Parquet file written by `varlen plan`.")
    schedule: str = doc("all", "ddp, fsdp, gpipe, 1f1b, lpp, fslpp, all (side by side), or MODULE:FUNCTION "
                               "returning a varlen_cli.schedule.Scheme.")
    stages: int = doc(1, "Pipeline stages S the model is cut into (equal cost each).")
    workers: int | None = doc(None, "Workers W (default: dp for ddp/fsdp; groups x S for gpipe/1f1b; lpp/fslpp: "
                                    "groups x R, default R = S).")
    groups: int | None = doc(None, "Data-parallel groups G of the pipelines (default: the plan's dp); must divide "
                                   "dp x grad_accum.")
    backward_ratio: float = doc(2.0, "Backward time / forward time of a job.")
    attention_cost: float | None = doc(None, "A of a stage's forward cost (default: the plan's recorded budget, padded "
                                             "B*T + A*B*T^2 or packed tokens + A*sum(l_i^2)); a value overrides the "
                                             "plan's A.")
    gantt_step: int | None = doc(None, "Draw step N as a Gantt chart: worker rows, time columns, microbatch ids.")
    trace: str | None = doc(None, "Write the simulated schedule as Chrome trace events to this JSON file (open it in "
                                  "Perfetto or chrome://tracing): a track per worker and stage, an event per forward "
                                  "and backward, steps end to end.", panel=TRACE)
    trace_steps: int | None = doc(None, "The steps --trace holds, from step 0 (default: every step).", panel=TRACE)
    overwrite: bool = doc(False, "Replace an existing --trace file (only one varlen wrote).", panel=TRACE)


@dataclass(frozen=True)
class PlanCosts:
    """A plan's microbatches as ``(num_steps, dp * grad_accum)`` arrays in ``(rank, micro)`` order."""

    path: str
    dp: int
    grad_accum: int
    cost: np.ndarray  # forward time of one stage: the plan's microbatch cost (varlen_cli.budget.Budget)
    tokens: np.ndarray  # padded tokens B*T: the activations of one stage
    cost_model: dict | None = None  # {"kind", "attention_cost", "source": "plan" | "option", "plan_attention_cost"}

    @property
    def num_steps(self) -> int:
        return self.cost.shape[0]

    @property
    def per_step(self) -> int:
        return self.cost.shape[1]


@dataclass
class ScheduleResult:
    """One scheme over the whole plan (the ``--json`` object)."""

    schedule: str
    workers: int
    stages: int
    groups: int
    microbatches_per_step: int
    backward_ratio: float
    steps: np.ndarray  # per-step makespan
    work: float
    peak_activation: np.ndarray  # per worker, max over steps, padded tokens of one stage
    activation_transfers: np.ndarray  # per worker, tokens received (activations and gradients)
    weight_transfers: np.ndarray  # per worker, stage weights fetched
    gantt: list | None = None  # jobs of the --gantt-step step: (worker, start, end, micro, "F"/"B", stage)
    step_peak: np.ndarray | None = None  # per step, the largest peak activation of any worker
    cost_model: dict | None = None  # the cost of a job (PlanCosts.cost_model)

    @property
    def makespan(self) -> float:
        return float(self.steps.sum())

    @property
    def utilization(self) -> float:
        return self.work / (self.workers * self.makespan) if self.makespan > 0 else 0.0

    @property
    def bubble(self) -> float:
        return 1.0 - self.utilization

    def to_json(self) -> dict:
        return {
            "schedule": self.schedule, "workers": self.workers, "stages": self.stages, "groups": self.groups,
            "microbatches_per_step": self.microbatches_per_step, "backward_ratio": self.backward_ratio,
            "num_steps": int(len(self.steps)), "makespan": self.makespan, "steps": self.steps.tolist(),
            "work": self.work, "utilization": self.utilization, "bubble": self.bubble,
            "peak_activation": self.peak_activation.tolist(),
            "activation_transfers": self.activation_transfers.tolist(),
            "weight_transfers": self.weight_transfers.tolist(),
            **({"cost": dict(self.cost_model)} if self.cost_model is not None else {}),
            **({"gantt": [dict(zip(("worker", "start", "end", "micro", "direction", "stage"), job))
                          for job in sorted(self.gantt)]} if self.gantt is not None else {}),
        }


@dataclass
class SimulateResult:
    plan: str
    results: list = field(default_factory=list)
    trace: str | None = None  # the --trace file written
    trace_steps: int = 0  # the steps it holds


def read_plan_costs(path: str, attention_cost: float | None = None) -> PlanCosts:
    """The plan's per-microbatch costs under its recorded budget (:func:`varlen_cli.format.plan_budget`:
    padded ``B*T + A*B*T^2`` or packed ``tokens + A*sum(l_i^2)``), with ``attention_cost`` replacing
    its A when given; a one-line :class:`InputError` for anything not a plan (the checks of
    :mod:`varlen_cli.format`, the one definition of the plan format)."""
    from .. import format

    try:
        pf, meta = format.open_plan_file(path)
        budget = format.plan_budget(meta)
    except format.FormatError as exc:
        raise InputError(str(exc)) from None
    recorded = budget.attention_cost
    if attention_cost is not None:
        budget = dataclasses.replace(budget, attention_cost=float(attention_cost))
    columns = list(dict.fromkeys(_COLUMNS + tuple(format.plan_cost_columns(budget))))
    missing = [c for c in columns if c not in pf.schema_arrow.names]
    if missing:
        raise InputError(f"{path} lacks plan columns: {', '.join(missing)}")
    dp, accum, steps = (int(meta.get(k) or 0) for k in ("dp", "grad_accum", "num_steps"))
    if dp < 1 or accum < 1 or steps < 1:
        raise InputError(f"{path} has dp={dp}, grad_accum={accum}, num_steps={steps}: nothing to simulate")
    per_step = dp * accum
    rows = pf.metadata.num_rows
    if rows != steps * per_step:
        raise InputError(f"{path} is inconsistent: {rows} rows, expected num_steps x dp x grad_accum = "
                         f"{steps} x {dp} x {accum}")
    # read row group by row group (a plan of 100M+ microbatches: 24 bytes each are kept, not the table)
    b, t, cost = np.empty(rows, np.float64), np.empty(rows, np.float64), np.empty(rows, np.float64)
    for g, at in _row_groups(pf):
        table = pf.read_row_group(g, columns=columns)
        col = {c: table.column(c).to_numpy().astype(np.int64) for c in _COLUMNS}
        position = np.arange(at, at + table.num_rows)
        if (np.any(col["step"] != position // per_step)
                or np.any(col["rank"] * accum + col["micro"] != position % per_step)):
            raise InputError(f"{path} rows are not in (step, rank, micro) order")
        b[position], t[position] = col["batch_size"], col["seqlen"]
        if budget.two_sided:  # the activations of both sides: B x (T + T_target)
            t[position] += table.column(format.TARGET_SEQLEN_COLUMN).to_numpy()
        cost[position] = format.table_cost(table, budget)  # the one cost formula
    if np.any(b * t <= 0):
        raise InputError(f"{path} has a microbatch with batch_size x seqlen <= 0")
    model = {**budget.straggler_spec(), "attention_cost": budget.attention_cost,
             "source": "plan" if attention_cost is None else "option", "plan_attention_cost": recorded}
    _check_cost_range(cost, b, t, model)
    return PlanCosts(path=path, dp=dp, grad_accum=accum, cost=cost.reshape(steps, per_step),
                     tokens=(b * t).reshape(steps, per_step), cost_model=model)


def _check_cost_range(cost: np.ndarray, b: np.ndarray, t: np.ndarray, model: dict) -> None:
    from ..budget import COST_LIMIT

    worst = float(cost.max()) if len(cost) else 0.0
    if worst <= COST_LIMIT:
        return
    big = int(np.argmax(cost))
    given = "--attention-cost" if model["source"] == "option" else "the plan's attention cost"
    raise UsageError(f"{given} {model['attention_cost']:g} is too large: microbatch {int(b[big])} x {int(t[big])} "
                     f"would cost {worst:.3g}, beyond what float64 sums over a plan hold (A is per squared "
                     "token; realistic values are below 1e-3)")


def _row_groups(pf):
    """(row group, its first row) of a Parquet file."""
    at = 0
    for g in range(pf.metadata.num_row_groups):
        yield g, at
        at += pf.metadata.row_group(g).num_rows


def _peak_activation(jobs: Jobs, on: np.ndarray, start, end, tokens) -> np.ndarray:
    """Per row, the max over time of the padded tokens held by one worker: from F start to B end."""
    f = np.flatnonzero(on & ~jobs.backward)
    if f.size == 0:
        return np.zeros(len(start))
    b = f + jobs.stages * jobs.n  # the backward of the same stage and microbatch
    tok = tokens[:, jobs.micro[f] - jobs.first]
    times = np.concatenate([end[:, b], start[:, f]], axis=1)  # frees first: they win ties (stable sort)
    delta = np.concatenate([-tok, tok], axis=1)
    order = np.argsort(times, axis=1, kind="stable")
    level = np.cumsum(np.take_along_axis(delta, order, axis=1), axis=1)
    return level.max(axis=1)


def _unit_peak(scheme: Scheme, jobs: Jobs, on: np.ndarray, start, end, tokens) -> np.ndarray:
    """Per row, a worker's peak activation; closed forms: one microbatch through all S stages at a
    time (chain: ``S max(tok)``), or every microbatch of the group at the end of the forward (GPipe)."""
    if scheme.closed_form == "chain":
        return scheme.stages * tokens.max(axis=1)
    if scheme.closed_form == "gpipe":
        return tokens.sum(axis=1)
    return _peak_activation(jobs, on, start, end, tokens)


def _weight_fetches(jobs: Jobs, on: np.ndarray, start, stored: np.ndarray) -> float:
    """Stage weights a worker fetches: a job of a stage it does not store, unless its previous job
    (in this step) was of the same stage (it keeps the weights in use; the optimizer step ends a step)."""
    j = np.flatnonzero(on)
    order = np.argsort(start[:, j], axis=1, kind="stable")
    stage = jobs.stage[j][order]
    foreign = ~stored[j][order]
    new = np.ones_like(foreign)
    new[:, 1:] = stage[:, 1:] != stage[:, :-1]
    return float(np.count_nonzero(foreign & new))


def _predecessors(jobs: Jobs) -> np.ndarray:
    """The job whose output (activation or gradient) each job consumes; -1 for stage-0 forwards."""
    S, n = jobs.stages, jobs.n
    j = np.arange(jobs.size)
    pred = np.where(jobs.backward, j + n, j - n)  # B(s) <- B(s+1); F(s) <- F(s-1)
    pred[(jobs.backward) & (jobs.stage == S - 1)] -= S * n + n  # B(S-1) <- F(S-1)
    pred[~jobs.backward & (jobs.stage == 0)] = -1
    return pred


@dataclass
class _Totals:
    """What :func:`simulate_scheme` adds up over units and chunks of steps."""

    steps: np.ndarray
    step_peak: np.ndarray
    peak: np.ndarray
    moved_in: np.ndarray
    fetched: np.ndarray
    gantt: list | None


def closed_makespan(scheme: Scheme, costs: np.ndarray, r: float) -> np.ndarray:
    """Per row, the unit's makespan under a closed form (module docstring of :mod:`.closed`)."""
    if scheme.closed_form == "chain":
        return (1.0 + r) * scheme.stages * costs.sum(axis=1)
    return (1.0 + r) * (costs.sum(axis=1) + (scheme.stages - 1) * costs.max(axis=1))


def _chunk(scheme, jobs, c, tok, r, lo, totals, job_stored, gantt_step) -> None:
    """Schedule steps ``lo .. lo + len(c) - 1`` of one unit and add up their numbers."""
    rows, hi = len(c), lo + len(c)
    if scheme.closed_form is None:
        start, dur = unit_starts(scheme, jobs, c, r)
        end = start + dur
        makespan = end.max(axis=1)
    else:  # the times follow from the costs; each worker's job order is the same in every step
        makespan = closed_makespan(scheme, c, r)
        first = 0 if totals.gantt is None or not lo <= gantt_step < hi else gantt_step - lo
        start, dur = unit_starts(scheme, jobs, c[first:first + 1], r)
        end = start + dur
    totals.steps[lo:hi] = np.maximum(totals.steps[lo:hi], makespan)
    for w in np.unique(jobs.worker):
        on = jobs.worker == w
        held = _unit_peak(scheme, jobs, on, start, end, tok)
        totals.peak[w] = max(totals.peak[w], float(held.max()))
        totals.step_peak[lo:hi] = np.maximum(totals.step_peak[lo:hi], held)
        fetches = _weight_fetches(jobs, on, start, job_stored)
        totals.fetched[w] += fetches * rows if scheme.closed_form is not None else fetches
    if totals.gantt is not None and lo <= gantt_step < hi:
        k = 0 if scheme.closed_form is not None else gantt_step - lo
        totals.gantt.extend((int(jobs.worker[j]), float(start[k, j]), float(end[k, j]), int(jobs.micro[j]),
                             "B" if jobs.backward[j] else "F", int(jobs.stage[j])) for j in range(jobs.size))


def simulate_scheme(scheme: Scheme, costs: PlanCosts, r: float, gantt_step: int | None = None,
                    chunk_jobs: int = 1 << 22) -> ScheduleResult:
    """Schedule every step of the plan under ``scheme`` and gather the per-worker numbers."""
    W, n = scheme.workers, scheme.microbatches // scheme.units
    totals = _Totals(steps=np.zeros(costs.num_steps), step_peak=np.zeros(costs.num_steps), peak=np.zeros(W),
                     moved_in=np.zeros(W), fetched=np.zeros(W), gantt=[] if gantt_step is not None else None)
    stored = np.array([[w in scheme.stored_on(s) for w in range(W)] for s in range(scheme.stages)])
    seen: set = set()
    for unit in range(scheme.units):
        jobs = build_jobs(scheme, unit)
        unit_workers = set(np.unique(jobs.worker).tolist())
        if seen & unit_workers:
            raise UsageError(f"--schedule {scheme.name}: units {scheme.units} share workers; use units=1")
        seen |= unit_workers
        job_stored = stored[jobs.stage, jobs.worker]
        pred = _predecessors(jobs)
        moved = (pred >= 0) & (jobs.worker != jobs.worker[np.maximum(pred, 0)])
        cost = costs.cost[:, jobs.first:jobs.first + n]
        tokens = costs.tokens[:, jobs.first:jobs.first + n]
        tok_sum = tokens.sum(axis=0)
        np.add.at(totals.moved_in, jobs.worker[moved], tok_sum[jobs.micro[moved] - jobs.first])
        rows_per_chunk = max(1, chunk_jobs // jobs.size)
        for lo in range(0, costs.num_steps, rows_per_chunk):
            hi = min(costs.num_steps, lo + rows_per_chunk)
            _chunk(scheme, jobs, cost[lo:hi], tokens[lo:hi], r, lo, totals, job_stored, gantt_step)
    work = float((1.0 + r) * scheme.stages * costs.cost.sum())
    return ScheduleResult(schedule=scheme.name, workers=W, stages=scheme.stages, groups=scheme.groups,
                          microbatches_per_step=scheme.microbatches, backward_ratio=r, steps=totals.steps, work=work,
                          peak_activation=totals.peak, activation_transfers=totals.moved_in,
                          weight_transfers=totals.fetched, gantt=totals.gantt, step_peak=totals.step_peak)


def check_config(config: SimulateConfig) -> None:
    if config.stages < 1:
        raise UsageError(f"--stages must be >= 1 (got {config.stages})")
    if not config.backward_ratio > 0 or not np.isfinite(config.backward_ratio):
        raise UsageError(f"--backward-ratio must be > 0 (got {config.backward_ratio})")
    if config.attention_cost is not None and not (config.attention_cost >= 0 and np.isfinite(config.attention_cost)):
        raise UsageError(f"--attention-cost must be >= 0 (got {config.attention_cost})")
    if config.workers is not None and config.workers < 1:
        raise UsageError(f"--workers must be >= 1 (got {config.workers})")
    if config.groups is not None and config.groups < 1:
        raise UsageError(f"--groups must be >= 1 (got {config.groups})")
    if config.trace_steps is not None and (config.trace is None or config.trace_steps < 1):
        raise UsageError("--trace-steps needs --trace FILE" if config.trace is None else
                         f"--trace-steps must be >= 1 (got {config.trace_steps})")
    if config.overwrite and config.trace is None:
        raise UsageError("--overwrite applies to --trace FILE (simulate writes nothing else)")
    if config.schedule not in SCHEDULES + ("all",) and ":" not in config.schedule:
        raise UsageError(f"--schedule {config.schedule!r} is not one of {', '.join(SCHEDULES)}, all, or "
                         "MODULE:FUNCTION")


def check_size(scheme: Scheme) -> None:
    """Refuse, in one line and before any work, a simulation too large to finish (``--stages 100000``)."""
    jobs = 2 * scheme.stages * scheme.microbatches
    if jobs > MAX_JOBS_PER_STEP:
        raise UsageError(f"--schedule {scheme.name} with --stages {scheme.stages} and {scheme.microbatches:,} "
                         f"microbatches per step has {jobs:,} jobs per step; simulate takes at most "
                         f"{MAX_JOBS_PER_STEP:,} (fewer --stages, or a plan with fewer microbatches per step)")
    if scheme.stages * scheme.workers > MAX_STAGE_WORKER_CELLS:
        raise UsageError(f"--schedule {scheme.name} with --stages {scheme.stages} on {scheme.workers:,} workers is "
                         f"too large to simulate (stages x workers at most {MAX_STAGE_WORKER_CELLS:,})")


def simulate(config: SimulateConfig) -> SimulateResult:
    """Simulate the plan under one schedule, or under every built-in one (``schedule="all"``)."""
    if rank0.needs_group():  # under torchrun: rank 0 simulates, the others get its result
        return rank0.on_rank0(simulate, config)
    check_config(config)
    costs = read_plan_costs(config.plan, config.attention_cost)
    if config.gantt_step is not None and not 0 <= config.gantt_step < costs.num_steps:
        raise UsageError(f"--gantt-step {config.gantt_step} is not a step of the plan (0 .. {costs.num_steps - 1})")
    names = SCHEDULES if config.schedule == "all" else (config.schedule,)
    result = SimulateResult(plan=config.plan)
    schemes = []
    for name in names:
        # With "all", --groups applies to the pipelines and --workers to LPP/FSLPP; DDP/FSDP use dp workers.
        workers, groups = config.workers, config.groups
        if config.schedule == "all":
            workers = workers if name in ("lpp", "fslpp") else None
            groups = None if name in ("ddp", "fsdp") else groups
        scheme = make_scheme(name, stages=config.stages, microbatches=costs.per_step, dp=costs.dp,
                             workers=workers, groups=groups)
        check_size(scheme)
        schemes.append(scheme)
    if config.trace:
        from .trace import check_trace_output, check_trace_size, trace_steps

        check_trace_output(config.trace, config.overwrite, config.plan)
        check_trace_size(schemes, trace_steps(costs.num_steps, config.trace_steps), config.trace_steps)
    for scheme in schemes:
        res = simulate_scheme(scheme, costs, config.backward_ratio, config.gantt_step)
        res.cost_model = costs.cost_model
        result.results.append(res)
    if config.trace:
        from .trace import write_trace

        result.trace_steps = write_trace(config.trace, list(zip(schemes, result.results)), costs,
                                         config.backward_ratio, config.trace_steps, config.overwrite)
        result.trace = config.trace
    return result
