"""``varlen calibrate --verify PLAN --model MODULE:FUNCTION``: run a plan's largest microbatches.

The proof by running, for any plan: the plan's largest microbatches, by predicted peak (from the
profile the plan was made with, or ``--memory-profile``), by padded tokens B x T and by T, each run
as one training step of the user's model in a fresh process (import torch, build, optimizer,
warm-up at 1 x 8, the step: :func:`varlen_cli.memory.procs.measure_fresh`), and its measured peak
compared with the limit (the plan's ``--max-memory``, or ``--max-memory``). A peak above the limit
is a violation (the command exits 6).

    from varlen_cli.memory import CalibrateConfig
    from varlen_cli.memory.verify import verify_plan
    result = verify_plan(CalibrateConfig(verify="plan.parquet", model="mypkg.models:build"))
    print(result.ok, result.to_json()["rows"])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .. import format
from ..errors import InputError, UsageError
from . import fit as fitting
from .calibrate import CalibrateConfig, check_config, measure_setup
from .profile import coefficients, load_profile, require_regular_file
from .sizes import format_size, parse_size

CRITERIA = ("predicted peak", "B x T", "T")


@dataclass
class VerifyRow:
    """One microbatch shape run: where it first occurs in the plan, why it was picked, and its peaks."""

    step: int
    rank: int
    micro: int
    batch_size: int
    seqlen: int
    largest_by: list[str]
    predicted_bytes: float | None
    measured_bytes: int | None  # None: the step ran out of memory
    limit_bytes: int
    seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.measured_bytes is not None and self.measured_bytes <= self.limit_bytes


@dataclass
class VerifyResult:
    plan: str
    limit_bytes: int
    profile: str | None  # where the predictions come from
    rows: list[VerifyRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def to_json(self) -> dict:
        rows = [dict(asdict(r), ok=r.ok, fraction_of_limit=(r.measured_bytes / r.limit_bytes
                                                             if r.measured_bytes is not None else None))
                for r in self.rows]
        return {"plan": self.plan, "limit_bytes": self.limit_bytes, "profile": self.profile, "ok": self.ok,
                "rows": rows}

    def violation(self) -> str:
        bad = [r for r in self.rows if not r.ok]
        shown = ", ".join(f"{r.batch_size}x{r.seqlen} " + (f"peaked at {format_size(r.measured_bytes)}"
                                                           if r.measured_bytes is not None else "ran out of memory")
                          for r in bad[:3])
        return (f"{len(bad)} of {len(self.rows)} microbatches measured above the limit "
                f"{format_size(self.limit_bytes)}: {shown}")


def verify_plan(config: CalibrateConfig) -> VerifyResult:
    """Measure the plan's largest microbatches in fresh processes (``config.verify`` is the plan)."""
    c = config
    check_config(c)
    if c.verify is None:
        raise UsageError("verify_plan() needs verify=PLAN")
    meta, cols = _read_plan(c.verify)
    try:
        budget = format.plan_budget(meta)  # the one reader of a plan's budget
    except format.FormatError as exc:
        raise InputError(str(exc)) from None
    if budget.two_sided:  # a model of (B, T) inputs would measure the source side only
        raise UsageError(f"--verify does not apply to {c.verify}: it has two budgets (--max-target-tokens), and "
                         "a memory profile's model runs one sequence of B x T")
    recorded = budget.memory or {}
    limit = _limit(c, recorded)
    profile, source = _profile(c, recorded)
    if profile is not None:
        _check_same_step(c, profile, source)
    coef = coefficients(profile) if profile is not None else None
    setup = measure_setup(c)
    result = VerifyResult(c.verify, limit, source)
    for row in pick_rows(cols, coef, c.verify_count):
        r = _measure(setup, row["batch_size"], row["seqlen"])
        result.rows.append(VerifyRow(limit_bytes=limit, measured_bytes=None if r.get("oom") else int(r["peak_bytes"]),
                                     seconds=r.get("seconds"), **row))
    return result


def _read_plan(path: str) -> tuple[dict, dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    require_regular_file(path, "plan")
    try:
        meta, _ = format.read_plan_metadata(path)
        table = pq.read_table(path, columns=["step", "rank", "micro", "batch_size", "seqlen"])
    except format.FormatError as exc:
        raise InputError(str(exc)) from None
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"cannot read plan {path}: {exc}") from None
    return meta, {name: table.column(name).to_numpy() for name in table.column_names}


def _limit(c: CalibrateConfig, recorded: dict) -> int:
    if c.max_memory is not None:
        return parse_size(c.max_memory, "--max-memory")
    if recorded.get("max_memory"):
        return int(recorded["max_memory"])
    raise UsageError(f"--verify: {c.verify} records no memory limit (it was not planned with --max-memory); "
                     "pass --max-memory")


def _profile(c: CalibrateConfig, recorded: dict) -> tuple[dict | None, str | None]:
    if c.memory_profile is not None:
        return load_profile(c.memory_profile), c.memory_profile
    if recorded.get("profile"):
        return recorded["profile"], recorded.get("profile_path") or "recorded in the plan"
    return None, None


def _check_same_step(c: CalibrateConfig, profile: dict, source: str) -> None:
    """The run must be the step the profile describes (device, dtype, optimizer), or nothing is verified."""
    setup = measure_setup(c)
    want = {"device": profile.get("device"), "dtype": profile.get("dtype"), "optimizer": profile.get("optimizer")}
    have = {"device": setup.device, "dtype": setup.dtype, "optimizer": setup.optimizer}
    differ = [k for k, v in want.items() if v not in (None, "any") and v != have[k]]
    if differ:
        raise UsageError(f"--verify: the profile ({source}) was made with "
                         + " ".join(f"--{k} {want[k]}" for k in differ) + "; pass the same to run the same step")


def pick_rows(cols: dict, coef, count: int) -> list[dict]:
    """The first microbatch of each of the ``count`` largest distinct shapes by predicted peak (when there
    is a profile), by B x T and by T (ties: the larger B), each listed once with every criterion it won."""
    b = cols["batch_size"].astype(np.int64)
    t = cols["seqlen"].astype(np.int64)
    shapes, first = np.unique(np.stack([b, t], axis=1), axis=0, return_index=True)
    sb, st = shapes[:, 0].astype(np.float64), shapes[:, 1].astype(np.float64)
    predicted = fitting.predict(coef, sb, st) if coef is not None else None
    keys = {"B x T": (sb * st, st), "T": (st, sb)}
    if predicted is not None:
        keys = {"predicted peak": (predicted, sb * st), **keys}
    chosen: dict[int, list[str]] = {}
    for name, (primary, tie) in keys.items():
        for i in np.lexsort((-tie, -primary))[:count]:
            chosen.setdefault(int(i), []).append(name)
    rows = []
    for i, reasons in chosen.items():
        j = int(first[i])
        rows.append({"step": int(cols["step"][j]), "rank": int(cols["rank"][j]), "micro": int(cols["micro"][j]),
                     "batch_size": int(shapes[i, 0]), "seqlen": int(shapes[i, 1]), "largest_by": reasons,
                     "predicted_bytes": float(predicted[i]) if predicted is not None else None})
    return rows


def _measure(setup, batch: int, seqlen: int) -> dict:
    from .procs import measure_fresh

    return measure_fresh(setup, batch, seqlen)
