"""``varlen run``: the whole pipeline (analyze, sort when the order needs it, plan) in one launch.

All stages share one process group: with ``--nproc N`` the workers are started once, analyze and
sort run distributed in them, and rank 0 plans. The output directory holds::

    OUT_DIR/metrics/        varlen analyze
    OUT_DIR/sorted/         varlen sort (only for --order curriculum or reverse)
    OUT_DIR/plan.parquet    varlen plan
    OUT_DIR/_run.json       the run's config, provenance and the stages' artifact ids

The directory is built in ``.OUT_DIR.varlen-tmp-<random>`` and swapped in when every stage
succeeded: a failed or killed run leaves an existing OUT_DIR as it was.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

from . import analyze as analyze_stage
from . import format, storage
from .analyze import AnalyzeConfig
from .errors import UsageError
from .runtime import artifacts, safety
from .runtime.choices import Device, check_choices, doc
from .runtime.dist import cap_workers, run_distributed, session
from .runtime.executor import run_in_session

SORTED_ORDERS = ("curriculum", "reverse")
AUTO_MIN_BUDGET = 16384
RUN_MANIFEST = format.RUN_MANIFEST_NAME


@dataclass(frozen=True)
class RunConfig:
    """The pipeline's options: sources, output, and per-stage options by config field name.

    ``analyze``, ``sort`` and ``plan`` hold keyword arguments of :class:`AnalyzeConfig`,
    :class:`~varlen_cli.sort.SortConfig` and :class:`~varlen_cli.plan.PlanConfig` (without their
    input and output, which ``run`` sets). ``plan["max_tokens"]`` defaults (without ``--max-memory`` or
    ``--packing``) to the larger of 16384 and the longest sample (rounded up to ``pad_multiple``).
    """

    sources: tuple = doc(help="Sources, as for `varlen analyze`: files, directories, globs.")
    output: str = doc(help="Output directory: metrics/, sorted/ (when the order needs it), plan.parquet, _run.json.")
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


def needs_auto_budget(p) -> bool:
    """Whether the plan's budget is chosen after analyze: no --max-tokens, --max-memory or --packing."""
    return p.max_tokens is None and p.max_memory is None and not p.packing


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
    # without --max-tokens the budget is chosen after analyze; check the other plan options now
    plan_stage.check(p if not needs_auto_budget(p) else replace(p, max_tokens=AUTO_MIN_BUDGET))
    if storage.is_remote(config.output):
        raise UsageError(f"varlen run writes a local output directory, not {config.output}; run analyze and sort "
                         "with -o URL instead")
    out = os.path.abspath(config.output)
    safety.check_no_overlap(config.output, safety.stage_inputs(config))
    safety.check_replaceable(config.output, config.overwrite, "dir")
    config = cap_workers(config, functools.partial(analyze_stage.count_units, a))  # analyze's units
    if config.nproc == 1:  # in this process, or one rank of torchrun: rank 0 locks in _run_worker
        return run_distributed(_run_worker, config, 1)
    with safety.output_lock(out, config.output):  # the launcher holds the lock; its workers inherit it
        try:
            return run_distributed(_run_worker, replace(config, nproc=1), config.nproc)
        except BaseException:
            safety.clean_leftovers(out)
            raise


def _run_worker(config: RunConfig) -> RunResult | None:
    """Every stage writes inside one temporary directory beside OUT, swapped in when all succeeded."""
    t0 = time.perf_counter()
    out = os.path.abspath(config.output)
    with session(config.device) as d, artifacts.atomic_dir_for_group(d, config.output, config.overwrite) as tmp:
        result = _run_stages(replace(config, output=tmp.tmp), d, t0, final=out)
        if d.is_main:
            relocate_manifests(tmp.tmp, out)
            tmp.commit()
            moved = {k: _moved(getattr(result, k), tmp.tmp, out) for k in ("analyze", "sort", "plan")}
            result = replace(result, output=out, seconds=time.perf_counter() - t0, **moved)
        d.barrier()
        return result


def relocate_manifests(tmp: str, out: str) -> None:
    """The stages' manifests record paths inside the temporary directory (their outputs, the sorted
    directory's input): made the paths they will have once it is swapped in (artifact ids hold no
    paths). The plan records its input's final path itself (``PlanConfig.recorded_input``)."""
    def moved(value):
        if isinstance(value, str) and (value == tmp or value.startswith(tmp + os.sep)):
            return out + value[len(tmp):]
        if isinstance(value, dict):
            return {k: moved(v) for k, v in value.items()}
        return [moved(v) for v in value] if isinstance(value, list) else value

    for stage in ("metrics", "sorted"):
        path = os.path.join(tmp, stage, artifacts.MANIFEST_NAME)
        if os.path.exists(path):
            with open(path) as fh:
                manifest = json.load(fh)
            artifacts.atomic_write_json(path, moved(manifest))


def _moved(stage_result, tmp: str, out: str):
    """A stage's result with its output path inside OUT (it was written in the temporary directory)."""
    if stage_result is None:
        return None
    return replace(stage_result, output=os.path.join(out, os.path.relpath(stage_result.output, tmp)))


def _run_stages(config: RunConfig, d, t0: float, final: str) -> RunResult | None:
    """analyze, sort and plan into ``config.output`` (the temporary directory); every rank plans its
    chunks, rank 0 writes the plan."""
    from . import sort as sort_stage
    from .plan.core import plan_in_group

    a, s, p = stage_configs(config)
    p = replace(p, recorded_input=os.path.join(final, os.path.relpath(p.input, config.output)))  # where it ends up
    analyzed = run_in_session(analyze_stage.run_in_group, a)
    sorted_ = run_in_session(sort_stage.run_in_group, s) if s is not None else None
    auto = None
    if needs_auto_budget(p):
        longest = int(analyzed.stats["max"]) if d.is_main else 0
        longest = int(d.all_gather_object(longest)[0]) if d.distributed else longest
        m = max(1, int(p.pad_multiple))
        auto = max(AUTO_MIN_BUDGET, -(-longest // m) * m)
        p = replace(p, max_tokens=auto)
    planned = plan_in_group(p, d)  # every rank forms its share of the chunks; rank 0 writes
    if not d.is_main:
        return None
    manifest = {
        "format": format.RUN_FORMAT, "format_version": format.RUN_FORMAT_VERSION, **artifacts.provenance(),
        "config": artifacts.config_dict(replace(config, output=final)), "auto_max_tokens": auto,
        "metrics": {"path": "metrics", "artifact_id": analyzed.manifest.get("artifact_id")},
        "sorted": ({"path": "sorted", "artifact_id": sorted_.manifest.get("artifact_id")} if sorted_ else None),
        "plan": {"path": "plan.parquet", "num_steps": planned.num_steps},
    }
    artifacts.atomic_write_json(os.path.join(config.output, RUN_MANIFEST), manifest)
    return RunResult(config.output, analyzed, sorted_, planned, auto, time.perf_counter() - t0)
