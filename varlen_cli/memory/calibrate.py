"""``varlen calibrate``: a memory profile, measured from the user's model or computed from a Hugging
Face config. See docs/memory.md.

    from varlen_cli.memory import CalibrateConfig, calibrate
    profile = calibrate(CalibrateConfig(output="profile.json", model="mypkg.models:build"))
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Literal

from ..errors import UsageError
from ..runtime import rank0, user_code
from ..runtime.choices import OVERWRITE_HELP, doc
from . import fit as fitting
from .analytic import analytic_profile_fields, dtype_name
from .profile import check_output, new_profile, write_profile
from .sizes import parse_size

Device = Literal["cpu", "cuda"]
Optimizer = Literal["adamw", "sgd", "none"]
Attention = Literal["eager", "sdpa", "flash"]
Sharding = Literal["none", "zero1", "zero2", "zero3", "fsdp"]
T_MIN = 32
MAX_AUTO_POINTS = 24


@dataclass(frozen=True)
class CalibrateConfig:
    """Options of ``varlen calibrate`` (see ``varlen calibrate --help`` and docs/memory.md)."""

    output: str = doc(help="Memory profile to write (JSON).")
    model: str | None = doc(None, "Measure: MODULE:FUNCTION (or path/file.py:FUNCTION) returning a torch.nn.Module.")
    hf_config: str | None = doc(None, "Analytic: a Hugging Face config.json (Llama-family decoder) instead of "
                                      "measuring.")
    device: Device = doc("cpu", "Measure on cpu (peak resident memory) or cuda (max_memory_allocated).")
    dtype: str = doc("float32", "Parameter dtype: float32, bfloat16, float16 (bf16, fp16, fp32 also accepted).")
    optimizer: Optimizer = doc("adamw", "Optimizer whose step (and states) the profile includes.")
    vocab_size: int | None = doc(None, "Random ids are drawn below V (default: the model's embedding size).")
    shapes: str = doc("auto", "auto (small up to what fits) or BxT,BxT,... (at least 3, with 2 different T).")
    max_seqlen: int | None = doc(None, "Longest T calibrated: auto grid (default 2048) or analytic fit range "
                                       "(default: the config's max_position_embeddings, at most 32768).")
    calibration_memory: str | None = doc(None, "Auto grid: do not measure shapes above this peak, e.g. 8GiB (CPU "
                                               "default: half the available RAM; CUDA: until out of memory).")
    attention: Attention = doc("eager", "Analytic: eager materialises B x heads x T^2 scores; sdpa/flash do not.")
    checkpointing: bool = doc(False, "Analytic: activation checkpointing per layer.")
    sharding: Sharding = doc("none", "Analytic: which model states are split over --world-size ranks.")
    world_size: int = doc(1, "Analytic: ranks the sharded states are split over.")
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


def _check(c: CalibrateConfig) -> None:
    if (c.model is None) == (c.hf_config is None):
        raise UsageError("give exactly one of --model MODULE:FUNCTION (measure) and --hf-config FILE (analytic)")
    if c.max_seqlen is not None and c.max_seqlen < 1:
        raise UsageError(f"--max-seqlen must be >= 1 (got {c.max_seqlen})")
    dtype_name(c.dtype)
    if c.model is not None:
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
    else:
        if c.shapes != "auto" or c.calibration_memory is not None or c.vocab_size is not None:
            raise UsageError("--shapes, --calibration-memory and --vocab-size apply to --model (measured)")
    if c.optimizer not in ("adamw", "sgd", "none"):
        raise UsageError(f"--optimizer must be one of adamw, sgd, none (got {c.optimizer!r})")


def calibrate(config: CalibrateConfig) -> dict:
    """Measure or compute the profile, fit it, write it atomically; returns the profile."""
    if rank0.needs_group():  # under torchrun: rank 0 calibrates and writes, the others get its profile
        return rank0.on_rank0(calibrate, config)
    c = config
    _check(c)
    check_output(c.output, c.overwrite)
    t0 = time.perf_counter()
    if c.hf_config is not None:
        fields = analytic_profile_fields(c.hf_config, c.dtype, c.attention, c.checkpointing, c.optimizer, c.sharding,
                                         c.world_size, c.max_seqlen)
        profile = new_profile("analytic", fields.pop("model"), **fields)
    else:
        profile = _measured(c)
    profile["calibration_seconds"] = time.perf_counter() - t0
    write_profile(c.output, profile, c.overwrite)
    return profile


def _measured(c: CalibrateConfig) -> dict:
    import torch

    from .measure import MeasureSetup, measure_shape, preload, start_method

    dtype = dtype_name(c.dtype)
    if c.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this torch")
    setup = MeasureSetup(model=c.model, device=c.device, dtype=dtype, optimizer=c.optimizer, vocab_size=c.vocab_size)
    preload(setup)  # a bad MODULE:FUNCTION fails here, before any child
    if c.shapes == "auto":
        cap = _default_cap(c)
        points = auto_grid(lambda b, t: measure_shape(setup, b, t), cap, c.max_seqlen or 2048)
    else:
        cap = None
        points = []
        for b, t in parse_shapes(c.shapes):
            r = measure_shape(setup, b, t)
            if r.get("oom"):
                raise UsageError(f"--shapes: {b}x{t} ran out of memory; give smaller shapes")
            points.append(r)
    if len(points) < 3 or len({p["seqlen"] for p in points}) < 2:
        raise UsageError(f"only {len(points)} shapes fit under the calibration memory; raise --calibration-memory")
    fit, error = fitting.fit_points(points)
    first = points[0]
    device_name = torch.cuda.get_device_name() if c.device == "cuda" else (platform.processor() or platform.machine())
    return new_profile(
        "measured", c.model, device=c.device, device_name=device_name, dtype=dtype,
        torch_version=torch.__version__, optimizer=c.optimizer, vocab_size=first.get("vocab_size"),
        num_parameters=first.get("num_parameters"),
        measure={"method": ("cuda: max_memory_allocated after reset_peak_memory_stats (reserved recorded)"
                            if c.device == "cuda" else
                            "cpu: static tensor bytes + (VmHWM after the step - VmRSS before), HWM reset by "
                            "/proc/self/clear_refs, malloc_trim before, fixed glibc mmap threshold, inherited free "
                            "heap chunks plugged, 1 thread"),
                 "process": f"one fresh {start_method(c.device)}ed process per shape; warm-up step at 1x8 first",
                 "gradients": "allocated (zeroed) before the step, as between accumulation microbatches",
                 "calibration_memory": cap, "host": platform.node()},
        points=[{k: v for k, v in p.items() if k not in ("vocab_size", "num_parameters", "oom")} for p in points],
        fit=fit, fit_error=error)


def _default_cap(c: CalibrateConfig) -> int | None:
    if c.calibration_memory is not None:
        return parse_size(c.calibration_memory, "--calibration-memory")
    if c.device == "cuda":
        return None  # stops at the first out-of-memory
    try:
        with open("/proc/meminfo") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
        return avail // 2
    except (OSError, StopIteration):
        return 4 << 30


def auto_grid(measure, cap: int | None, max_seqlen: int, t_min: int = T_MIN,
              max_points: int = MAX_AUTO_POINTS) -> list[dict]:
    """Shapes from small up to what fits: T doubling from ``t_min`` to ``max_seqlen``; for each T,
    B = 1, 4, 16, ... until the measured (or, extrapolated linearly in B, the next) peak passes
    ``cap`` or the step runs out of memory. Stops at the first T where B = 1 does not fit."""
    points = []
    t = min(t_min, max_seqlen)
    while len(points) < max_points:
        here = []
        b = 1
        while len(points) + len(here) < max_points:
            if cap is not None and here and _extrapolate(here, b) > cap:
                break
            r = measure(b, t)
            if r.get("oom") or (cap is not None and r["peak_bytes"] > cap):
                break
            here.append(r)
            b *= 4
        points += here
        if not here or t >= max_seqlen:
            break
        t = min(2 * t, max_seqlen)
    return points


def _extrapolate(here: list, b: int) -> float:
    last = here[-1]
    if len(here) == 1:  # peak = static + B * per-sample
        static = last.get("static_bytes", 0)
        return static + (last["peak_bytes"] - static) * b / last["batch_size"]
    prev = here[-2]
    slope = (last["peak_bytes"] - prev["peak_bytes"]) / (last["batch_size"] - prev["batch_size"])
    return last["peak_bytes"] + slope * (b - last["batch_size"])
