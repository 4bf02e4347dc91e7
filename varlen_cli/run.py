"""``varlen run``: the whole pipeline (analyze, sort when the order needs it, plan) in one launch.

All stages share one process group: with ``--nproc N`` the workers are started once, analyze and
sort run distributed in them, and rank 0 plans. The output directory holds::

    OUT_DIR/metrics/        varlen analyze
    OUT_DIR/sorted/         varlen sort (only for --order curriculum or reverse)
    OUT_DIR/plan.parquet    varlen plan
    OUT_DIR/_run.json       the run's config, provenance and the stages' artifact ids

The directory is complete when ``_run.json`` exists; a failed run removes what it wrote.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

from . import analyze as analyze_stage
from .analyze import AnalyzeConfig
from .errors import OutputError, UsageError
from .runtime import artifacts
from .runtime.choices import Device, check_choices
from .runtime.dist import run_distributed, session
from .runtime.executor import run_in_session

SORTED_ORDERS = ("curriculum", "reverse")
AUTO_MIN_BUDGET = 16384
RUN_MANIFEST = "_run.json"


@dataclass(frozen=True)
class RunConfig:
    """The pipeline's options: sources, output, and per-stage options by config field name.

    ``analyze``, ``sort`` and ``plan`` hold keyword arguments of :class:`AnalyzeConfig`,
    :class:`~varlen_cli.sort.SortConfig` and :class:`~varlen_cli.plan.PlanConfig` (without their
    input and output, which ``run`` sets). ``plan["max_tokens"]`` defaults to the larger of 16384
    and the longest sample (rounded up to ``pad_multiple``).
    """

    sources: tuple
    output: str
    analyze: dict = field(default_factory=dict)
    sort: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)
    nproc: int = 1
    device: Device = "cpu"
    overwrite: bool = False
    progress: bool = True


@dataclass
class RunResult:
    output: str
    analyze: Any
    sort: Any
    plan: Any
    auto_max_tokens: int | None
    seconds: float


def _pick(cls, options: dict, stage: str) -> dict:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise UsageError(f"unknown {stage} option(s) for varlen run: {', '.join(unknown)}")
    return dict(options)


def stage_configs(config: RunConfig):
    """(AnalyzeConfig, SortConfig or None, PlanConfig) for a run; paths inside the output directory."""
    from .plan import PlanConfig
    from .sort import SortConfig, parse_by

    out = os.path.abspath(config.output)
    common = {"device": config.device, "progress": config.progress}
    a = AnalyzeConfig(sources=tuple(config.sources), output=os.path.join(out, "metrics"), nproc=1, overwrite=True,
                      **common, **_pick(AnalyzeConfig, config.analyze, "analyze"))
    plan_opts = _pick(PlanConfig, config.plan, "plan")
    order = plan_opts.get("order", PlanConfig.__dataclass_fields__["order"].default)
    s = None
    if order in SORTED_ORDERS:
        sort_opts = _pick(SortConfig, config.sort, "sort")
        if "by" in sort_opts:
            sort_opts["by"] = parse_by(sort_opts["by"])
        s = SortConfig(metrics_dir=a.output, output=os.path.join(out, "sorted"), nproc=1, overwrite=True,
                       **common, **sort_opts)
    p = PlanConfig(input=s.output if s else a.output, output=os.path.join(out, "plan.parquet"), overwrite=True,
                   **{"progress": config.progress, **plan_opts})
    return a, s, p


def run(config: RunConfig) -> RunResult | None:
    """Run the pipeline; returns the result on rank 0 (None on other ranks)."""
    check_choices(config)
    if not config.sources:
        raise UsageError("give at least one SOURCE")
    from . import plan as plan_stage
    from . import sort as sort_stage

    a, s, p = stage_configs(config)  # checks the option names early
    analyze_stage.check(a)
    if s is not None:
        sort_stage.check(s)
    if p.max_tokens is not None or p.packing:
        plan_stage.check(p)
    artifacts.check_output_free(config.output, config.overwrite)
    out = os.path.abspath(config.output)
    return run_distributed(_run_worker, replace(config, nproc=1), config.nproc, cleanup=[out])


def _run_worker(config: RunConfig) -> RunResult | None:
    from . import sort as sort_stage
    from .plan import plan as make_plan

    t0 = time.perf_counter()
    out = os.path.abspath(config.output)
    a, s, p = stage_configs(config)
    with session(config.device) as d:
        if d.is_main:
            artifacts.check_output_free(out, config.overwrite)
            shutil.rmtree(out, ignore_errors=True)
            try:
                os.makedirs(out)
            except OSError as exc:
                raise OutputError(f"cannot create output directory {out}: {exc.strerror}") from None
        d.barrier()
        try:
            analyzed = run_in_session(analyze_stage.run_in_group, a)
            sorted_ = run_in_session(sort_stage.run_in_group, s) if s is not None else None
            result = None
            if d.is_main:
                auto = None
                if p.max_tokens is None and not p.packing:
                    longest = int(analyzed.stats["max"])
                    m = max(1, int(p.pad_multiple))
                    auto = max(AUTO_MIN_BUDGET, -(-longest // m) * m)
                    plan_cfg = replace(p, max_tokens=auto)
                else:
                    plan_cfg = p
                planned = make_plan(plan_cfg)
                manifest = {
                    "format": "varlen-run", "format_version": 1, **artifacts.provenance(),
                    "config": artifacts.config_dict(config), "auto_max_tokens": auto,
                    "metrics": {"path": "metrics", "artifact_id": analyzed.manifest.get("artifact_id")},
                    "sorted": ({"path": "sorted", "artifact_id": sorted_.manifest.get("artifact_id")}
                               if sorted_ else None),
                    "plan": {"path": "plan.parquet", "num_steps": planned.num_steps},
                }
                artifacts.atomic_write_json(os.path.join(out, RUN_MANIFEST), manifest)
                result = RunResult(out, analyzed, sorted_, planned, auto, time.perf_counter() - t0)
            d.barrier()
            return result
        except BaseException:
            if d.is_main:
                shutil.rmtree(out, ignore_errors=True)
            raise
