"""``varlen calibrate``: a memory profile, measured from the user's model or computed from a Hugging
Face config; and ``--verify PLAN`` (:mod:`varlen_cli.memory.verify`). See docs/memory.md.

    from varlen_cli.memory import CalibrateConfig, calibrate
    profile = calibrate(CalibrateConfig(output="profile.json", model="mypkg.models:build", max_memory="70GiB"))
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Literal

from ..errors import UsageError
from ..runtime import rank0, user_code
from ..runtime.choices import OVERWRITE_HELP, doc
from . import fit as fitting
from .analytic import analytic_profile_fields, dtype_name
from .grid import T_MIN
from .profile import check_output, new_profile, write_profile
from .sizes import format_size, parse_size

Device = Literal["cpu", "cuda"]
Optimizer = Literal["adamw", "sgd", "none"]
Attention = Literal["eager", "sdpa", "flash"]
Sharding = Literal["none", "zero1", "zero2", "zero3", "fsdp"]
DEFAULT_MAX_SEQLEN = 2048  # auto grid without --max-memory
LONGEST_AUTO_SEQLEN = 65536  # auto grid with --max-memory: up to the T whose B = 1 reaches it, at most this
POINT_KEYS = ("batch_size", "seqlen", "peak_bytes", "base_bytes", "static_bytes", "reserved_bytes", "context_bytes",
              "allocated_bytes", "process", "seconds")


@dataclass(frozen=True)
class CalibrateConfig:
    """Options of ``varlen calibrate`` (see ``varlen calibrate --help`` and docs/memory.md)."""

    output: str | None = doc(None, "Memory profile to write (JSON).")
    model: str | None = doc(None, "Measure: MODULE:FUNCTION (or path/file.py:FUNCTION) returning a torch.nn.Module.")
    hf_config: str | None = doc(None, "Analytic: a Hugging Face config.json (Llama-family decoder) instead of "
                                      "measuring.")
    device: Device = doc("cpu", "Measure on cpu (peak resident memory of the process) or cuda (peak reserved memory "
                                "plus the CUDA context).")
    dtype: str = doc("float32", "Parameter dtype: float32, bfloat16, float16 (bf16, fp16, fp32 also accepted).")
    optimizer: Optimizer = doc("adamw", "Optimizer whose step (and states) the profile includes.")
    vocab_size: int | None = doc(None, "Random ids are drawn below V (default: the model's embedding size).")
    shapes: str = doc("auto", "auto (along the memory limit) or BxT,BxT,... (at least 3, with 2 different T).")
    max_seqlen: int | None = doc(None, "Longest T calibrated: auto grid (default: the longest T whose B = 1 fits "
                                       "--max-memory, else 2048) or analytic fit range (default: the config's "
                                       "max_position_embeddings, at most 32768).")
    max_memory: str | None = doc(None, "The memory limit you will plan with (e.g. 1.5GiB): the auto grid measures "
                                       "around it, not beyond. With --verify: the limit to check (default: the "
                                       "plan's).")
    calibration_memory: str | None = doc(None, "Auto grid without --max-memory: measure up to this peak, e.g. 8GiB "
                                               "(CPU default: half the available RAM; CUDA: the device's memory).")
    attention: Attention = doc("eager", "Analytic: eager materialises B x heads x T^2 scores; sdpa/flash do not.")
    checkpointing: bool = doc(False, "Analytic: activation checkpointing per layer.")
    sharding: Sharding = doc("none", "Analytic: which model states are split over --world-size ranks.")
    world_size: int = doc(1, "Analytic: ranks the sharded states are split over.")
    verify: str | None = doc(None, "Run this plan's largest microbatches (by predicted peak, by B x T, by T) with "
                                   "--model, each in a fresh process; exit 6 if one peaks above the limit.")
    verify_count: int = doc(1, "--verify: how many of the largest distinct shapes to run per criterion.")
    memory_profile: str | None = doc(None, "--verify: the profile whose predictions are shown (default: the one the "
                                           "plan was made with).")
    overwrite: bool = doc(False, OVERWRITE_HELP)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"4x128,16x64"`` -> ``[(4, 128), (16, 64)]``."""
    shapes = []
    for part in text.split(","):
        b, sep, t = part.strip().lower().partition("x")
        if not sep or not b.isdigit() or not t.isdigit() or int(b) < 1 or int(t) < 1:
            raise UsageError(f"--shapes: cannot read {part.strip()!r} as BxT (example: --shapes 1x64,8x64,2x256)")
        shapes.append((int(b), int(t)))
    if len(set(shapes)) < 3 or len({t for _, t in shapes}) < 2:
        raise UsageError("--shapes needs at least 3 distinct shapes with at least 2 different T (to fit c0, c1, c2)")
    return shapes


def check_config(c: CalibrateConfig) -> None:
    """One-line usage errors for options that do not go together (before anything runs)."""
    if (c.model is None) == (c.hf_config is None) and not (c.verify and c.hf_config is None):
        raise UsageError("give exactly one of --model MODULE:FUNCTION (measure) and --hf-config FILE (analytic)")
    if c.max_seqlen is not None and c.max_seqlen < 1:
        raise UsageError(f"--max-seqlen must be >= 1 (got {c.max_seqlen})")
    dtype_name(c.dtype)
    if c.max_memory is not None:
        parse_size(c.max_memory, "--max-memory")
    if c.verify is not None:
        _check_verify(c)
    elif c.output is None:
        raise UsageError("give -o/--output FILE: the memory profile to write (or --verify PLAN to check a plan)")
    elif c.memory_profile is not None or c.verify_count != 1:
        raise UsageError("--memory-profile and --verify-count apply to --verify PLAN")
    if c.model is not None:
        _check_measured(c)
    elif c.shapes != "auto" or c.calibration_memory is not None or c.vocab_size is not None:
        raise UsageError("--shapes, --calibration-memory and --vocab-size apply to --model (measured)")
    if c.optimizer not in ("adamw", "sgd", "none"):
        raise UsageError(f"--optimizer must be one of adamw, sgd, none (got {c.optimizer!r})")


def _check_verify(c: CalibrateConfig) -> None:
    if c.model is None or c.hf_config is not None:
        raise UsageError("--verify runs the plan's microbatches with --model MODULE:FUNCTION (not --hf-config)")
    if c.output is not None:
        raise UsageError("--verify writes no profile: drop -o/--output (--json prints the measurements)")
    if c.shapes != "auto" or c.max_seqlen is not None or c.calibration_memory is not None:
        raise UsageError("--shapes, --max-seqlen and --calibration-memory apply to calibrating, not to --verify")
    if c.verify_count < 1:
        raise UsageError(f"--verify-count must be >= 1 (got {c.verify_count})")


def _check_measured(c: CalibrateConfig) -> None:
    user_code.split_spec(c.model, "--model")
    if c.shapes != "auto":
        parse_shapes(c.shapes)
    elif c.calibration_memory is not None:
        parse_size(c.calibration_memory, "--calibration-memory")
    for name, value, default in (("--attention", c.attention, "eager"), ("--sharding", c.sharding, "none"),
                                 ("--checkpointing", c.checkpointing, False), ("--world-size", c.world_size, 1)):
        if value != default:
            raise UsageError(f"{name} applies to --hf-config (analytic); a measured model runs as it is built")
    if c.device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda (got {c.device!r})")
    if c.vocab_size is not None and c.vocab_size < 2:
        raise UsageError(f"--vocab-size must be >= 2 (got {c.vocab_size})")


def calibrate(config: CalibrateConfig) -> dict:
    """Measure or compute the profile, fit it, write it atomically; returns the profile."""
    if rank0.needs_group():  # under torchrun: rank 0 calibrates and writes, the others get its profile
        return rank0.on_rank0(calibrate, config)
    c = config
    check_config(c)
    if c.verify is not None:
        raise UsageError("calibrate() writes a profile; --verify PLAN is varlen_cli.memory.verify.verify_plan()")
    inputs = model_files(c.model) if c.model is not None else [c.hf_config]
    check_output(c.output, c.overwrite, inputs)
    t0 = time.perf_counter()
    if c.hf_config is not None:
        fields = analytic_profile_fields(c.hf_config, c.dtype, c.attention, c.checkpointing, c.optimizer, c.sharding,
                                         c.world_size, c.max_seqlen)
        profile = new_profile("analytic", fields.pop("model"), **fields)
    else:
        profile = _measured(c)
    profile["calibration_seconds"] = time.perf_counter() - t0
    write_profile(c.output, profile, c.overwrite, inputs)
    return profile


def model_files(spec: str) -> list[str]:
    """The source file ``--model`` names (``path/file.py``, or where MODULE would be imported from, found
    without importing it): an input, which the output must not be."""
    module, _ = user_code.split_spec(spec, "--model")
    if module.endswith(".py"):
        return [module]
    parts = module.split(".")
    for root in [os.getcwd()] + [p for p in sys.path if p]:
        for candidate in (os.path.join(root, *parts) + ".py", os.path.join(root, *parts, "__init__.py")):
            if os.path.isfile(candidate):
                return [candidate]
    return []


def measure_setup(c: CalibrateConfig):
    from .measure import MeasureSetup

    return MeasureSetup(model=c.model, device=c.device, dtype=dtype_name(c.dtype), optimizer=c.optimizer,
                        vocab_size=c.vocab_size)


def _measured(c: CalibrateConfig) -> dict:
    from .grid import walk
    from .procs import Measurer

    setup = measure_setup(c)
    explicit = parse_shapes(c.shapes) if c.shapes != "auto" else None
    first = explicit[0] if explicit else (1, min(T_MIN, c.max_seqlen or T_MIN))
    with Measurer(setup, first) as m:
        if explicit:
            points = [_explicit_point(m, b, t) for b, t in explicit]
            limit = None
        else:
            limit = _design_limit(c, m, first)
            t_max = c.max_seqlen or (LONGEST_AUTO_SEQLEN if c.max_memory else DEFAULT_MAX_SEQLEN)
            points = walk(m.measure, limit, t_max, ladder=c.max_memory is None)
            _check_enough(points, limit, c)
        offset = m.offset
    return _measured_profile(c, setup, points, {"fork_offset_bytes": offset, "limit": limit})


def _measured_profile(c: CalibrateConfig, setup, points: list[dict], measure: dict) -> dict:
    from .procs import use_fork_server

    fit, error = fitting.fit_points(points, "envelope")
    first = points[0]
    process = ("a child forked from a server that imported torch and the model's module, plus the fresh-process "
               "offset" if use_fork_server(c.device) else "a fresh process")
    return new_profile(
        "measured", c.model, device=c.device, device_name=first.get("device_name"), dtype=setup.dtype,
        torch_version=first.get("torch_version"), optimizer=c.optimizer, vocab_size=first.get("vocab_size"),
        num_parameters=first.get("num_parameters"),
        measure={"method": _method(c.device), "process": f"every shape in {process}; warm-up step at 1x8 first",
                 "gradients": "allocated (zeroed) before the step, as between accumulation microbatches",
                 "outputs": "the model's output is held through backward and the optimizer step",
                 "threads": first.get("threads"), **measure, "max_memory": c.max_memory, "host": platform.node()},
        points=[{k: p[k] for k in POINT_KEYS + ("heldout", "predicted_bytes", "relative_error") if k in p}
                for p in points],
        fit=fit, fit_error=error)


def _method(device: str) -> str:
    from .measure import CpuPeak, CudaPeak

    return CudaPeak.method if device == "cuda" else CpuPeak.method


def _explicit_point(m, b: int, t: int) -> dict:
    r = m.measure(b, t)
    if r.get("oom"):
        raise UsageError(f"--shapes: {b}x{t} ran out of memory; give smaller shapes")
    return r


def _design_limit(c: CalibrateConfig, m, first: tuple[int, int]) -> int:
    """The limit the auto grid walks along: --max-memory (or --calibration-memory when lower), else the
    calibration memory (CPU default: half the available RAM; CUDA: the device's memory)."""
    given = [parse_size(v, name) for v, name in ((c.max_memory, "--max-memory"),
                                                 (c.calibration_memory, "--calibration-memory")) if v is not None]
    if given:
        return min(given)
    if c.device == "cuda":
        r = m.measure(*first)
        return int(r.get("device_total_bytes") or 0) or (80 << 30)
    try:
        with open("/proc/meminfo") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
        return avail // 2
    except (OSError, StopIteration):
        return 4 << 30


def _check_enough(points: list, limit: int, c: CalibrateConfig) -> None:
    option = "--max-memory" if c.max_memory else "--calibration-memory"
    if points and points[0]["peak_bytes"] > limit:
        first = points[0]
        raise UsageError(f"{option} {format_size(limit)}: the smallest step ({first['batch_size']}x{first['seqlen']}) "
                         f"already peaks at {format_size(first['peak_bytes'])} (interpreter, torch, model, optimizer "
                         "states); no microbatch fits")
    if len(points) < 3 or len({p["seqlen"] for p in points}) < 2:
        raise UsageError(f"only {len(points)} shapes fit under {option} {format_size(limit)}; raise it (or "
                         "--max-seqlen)")
