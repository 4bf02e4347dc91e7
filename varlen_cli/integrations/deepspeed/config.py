"""The DeepSpeed config a plan needs, and the settings that contradict a plan (each a one-line ``PlanError``).

* ``gradient_accumulation_steps`` is the plan's ``grad_accum``: another explicit value is refused, and
  so are a ``train_batch_size`` and ``train_micro_batch_size_per_gpu`` that imply another one;
* ``train_micro_batch_size_per_gpu`` only counts samples in DeepSpeed (its ``global_samples``,
  throughput and monitor axes): it is set to the plan's batch size when every microbatch has the
  same one (another explicit value is refused), else to the mean samples per microbatch, rounded
  (an explicit value is then replaced: no single number is the plan's); ``train_batch_size`` is left
  to DeepSpeed (micro x ``grad_accum`` x the data-parallel size);
* DeepSpeed's own data sampling (``data_efficiency``, ``curriculum_learning``) would re-batch the
  data: refused.

:func:`plan_columns` reads columns of the plan (vectorised, one read) for these checks and for the
pipeline's shape checks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ... import format
from ...loader.plan_file import Plan, PlanError

AUTO = (None, "auto")


def plan_columns(plan: Plan, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The plan's columns ``names`` as numpy arrays, in row order (the file the plan was opened from;
    refused if it changed since)."""
    try:
        pf, _ = format.open_plan_file(plan.path)
    except format.FormatError as exc:
        raise PlanError(str(exc)) from None
    if format.plan_fingerprint(pf.schema_arrow) != plan.fingerprint:
        raise PlanError(f"{plan.path} changed since it was opened: open the plan again")
    table = pf.read(columns=list(names))
    return {name: table.column(name).to_numpy() for name in names}


def micro_batch_size(plan: Plan) -> tuple[int, bool]:
    """Samples per microbatch as DeepSpeed counts them, and whether every microbatch has that batch size
    (see the module docstring)."""
    cols = plan_columns(plan, ("num_samples", "batch_size"))
    sizes, padded = cols["num_samples"], cols["batch_size"]
    if padded.min() == padded.max():
        return max(1, int(padded[0])), True
    return max(1, int(round(float(sizes.mean())))), False


def read_config(config: dict | str | os.PathLike) -> dict:
    """A copy of a DeepSpeed config given as a dict or a JSON file."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    try:
        with open(os.fspath(config)) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the DeepSpeed config {config}: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(f"the DeepSpeed config {config} is not a JSON object")
    return data


def engine_config(config: dict | str | os.PathLike, plan: Plan, pipe: bool = False) -> dict:
    """``config`` with the plan's gradient accumulation and micro batch size (module docstring); ``pipe``:
    for DeepSpeed's pipeline engine (ZeRO 0 or 1 only)."""
    cfg = read_config(config)
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    if pipe and stage not in (0, 1):
        raise PlanError(f"the DeepSpeed config has ZeRO stage {stage} but DeepSpeed's pipeline engine runs ZeRO "
                        f"stage 0 or 1 only")
    ga, given, total = (_count(cfg, k) for k in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu",
                                                 "train_batch_size"))
    if ga not in AUTO and ga != plan.grad_accum:
        raise PlanError(f"the DeepSpeed config has gradient_accumulation_steps={ga} but the plan was made with "
                        f"--grad-accum {plan.grad_accum}: leave it out (varlen sets it from the plan) or re-plan")
    if ga in AUTO and given not in AUTO and total not in AUTO and total != given * plan.grad_accum * plan.dp:
        raise PlanError(f"the DeepSpeed config has train_batch_size={total} and train_micro_batch_size_per_gpu="
                        f"{given}, which make {total / (given * plan.dp):g} accumulation steps on {plan.dp} "
                        f"data-parallel ranks, but the plan was made with --grad-accum {plan.grad_accum}: leave them "
                        f"out (varlen sets them from the plan)")
    micro, fixed = micro_batch_size(plan)
    if fixed and given not in AUTO and given != micro:
        raise PlanError(f"the DeepSpeed config has train_micro_batch_size_per_gpu={given} but every microbatch of "
                        f"the plan holds {micro} (padded) samples: leave it out or set \"auto\"")
    for key in ("data_efficiency", "curriculum_learning"):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled"):
            raise PlanError(f"the DeepSpeed config enables {key}: DeepSpeed would sample and batch the data itself, "
                            f"not as the plan says; turn it off (the plan already orders and batches the samples)")
    cfg.pop("train_batch_size", None)
    cfg.update(gradient_accumulation_steps=plan.grad_accum, train_micro_batch_size_per_gpu=micro)
    return cfg


def _count(cfg: dict, key: str):
    """``cfg[key]``: absent (None), ``"auto"`` or a positive integer (else refused)."""
    value = cfg.get(key)
    if value in AUTO or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise PlanError(f"the DeepSpeed config has {key}={value!r}: give a positive integer, \"auto\", or leave it out")


def check_engine(engine: Any) -> None:
    """Settings of a built engine that the plan's loss normalisation does not cover."""
    sp = int(getattr(engine, "sequence_parallel_size", 1) or 1)
    if sp > 1:
        raise PlanError(f"sequence parallelism (sequence_parallel_size={sp}) splits every sample across ranks: the "
                        f"plan's loss normalisation counts whole samples per data-parallel rank; not supported")
