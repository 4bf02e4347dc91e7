"""The DeepSpeed config a plan needs, and the settings that contradict a plan (each a one-line ``PlanError``).

* ``gradient_accumulation_steps`` is the plan's ``grad_accum`` (another explicit value is refused);
* ``train_micro_batch_size_per_gpu`` is what DeepSpeed counts samples with (its ``global_samples``,
  throughput and monitor axes): the plan's batch size when every microbatch has the same one, else
  the mean samples per microbatch, rounded; an explicit other value is refused, as is a
  ``train_batch_size`` other than that x ``grad_accum`` x ``dp`` (``"auto"`` is accepted for both);
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


def micro_batch_size(plan: Plan) -> int:
    """Samples per microbatch as DeepSpeed counts them (see the module docstring)."""
    sizes = plan_columns(plan, ("num_samples",))["num_samples"]
    if len(sizes) and sizes.min() == sizes.max():
        return max(1, int(sizes[0]))
    return max(1, int(round(float(sizes.mean())))) if len(sizes) else 1


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


def engine_config(config: dict | str | os.PathLike, plan: Plan) -> dict:
    """``config`` with the plan's gradient accumulation and micro batch size (module docstring)."""
    cfg = read_config(config)
    ga = cfg.get("gradient_accumulation_steps")
    if ga not in AUTO and ga != plan.grad_accum:
        raise PlanError(f"the DeepSpeed config has gradient_accumulation_steps={ga} but the plan was made with "
                        f"--grad-accum {plan.grad_accum}: leave it out (varlen sets it from the plan) or re-plan")
    micro = micro_batch_size(plan)
    given = cfg.get("train_micro_batch_size_per_gpu")
    if given not in AUTO and given != micro:
        raise PlanError(f"the DeepSpeed config has train_micro_batch_size_per_gpu={given} but the plan's microbatches "
                        f"hold {_sizes(plan)} samples (varlen plans them): leave it out or set \"auto\"")
    total = cfg.get("train_batch_size")
    if total not in AUTO and total != micro * plan.grad_accum * plan.dp:
        raise PlanError(f"the DeepSpeed config has train_batch_size={total}: the plan makes every step's batch "
                        f"(its size varies); leave it out or set \"auto\"")
    for key in ("data_efficiency", "curriculum_learning"):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled"):
            raise PlanError(f"the DeepSpeed config enables {key}: DeepSpeed would sample and batch the data itself, "
                            f"not as the plan says; turn it off (the plan already orders and batches the samples)")
    cfg.pop("train_batch_size", None)
    cfg.update(gradient_accumulation_steps=plan.grad_accum, train_micro_batch_size_per_gpu=micro)
    return cfg


def _sizes(plan: Plan) -> str:
    sizes = plan_columns(plan, ("num_samples",))["num_samples"]
    low, high = int(sizes.min()), int(sizes.max())
    return f"{low}" if low == high else f"{low} to {high}"


def check_engine(engine: Any) -> None:
    """Settings of a built engine that the plan's loss normalisation does not cover."""
    sp = int(getattr(engine, "sequence_parallel_size", 1) or 1)
    if sp > 1:
        raise PlanError(f"sequence parallelism (sequence_parallel_size={sp}) splits every sample across ranks: the "
                        f"plan's loss normalisation counts whole samples per data-parallel rank; not supported")
