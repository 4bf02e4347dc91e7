"""Measured memory profiles against real training processes (slow: fresh processes per shape).

What a profile predicts is the peak of a training process (docs/memory.md): on CPU the peak resident
memory of a fresh process that imports torch and the model's module, builds, warms up and runs the
step with the default allocator; on CUDA the peak reserved memory plus the CUDA context. These
tests calibrate a tiny model around a limit, plan with that limit, and run the planned microbatches
as training steps in fresh processes, in varlen's measuring child and in a plain script that does not
import varlen; expected values come from those measurements, never from the fit's own report.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.plan_helpers import write_metrics
from varlen_cli.cli import app

runner = CliRunner()
MiB = 1 << 20
LM = "tests.memory_models:lm_4k"
LIMIT = "640MiB"  # the tiny model's process peaks at ~380 MiB before its first token (torch, interpreter)
pytestmark = pytest.mark.slow

# A training step as a user's script runs it, without varlen: import torch, build, AdamW, a 1x8
# warm-up step, the step; prints the process's peak resident memory in bytes. Read as VmHWM (this
# process's own high-water mark), not getrusage's ru_maxrss: Linux carries the parent's peak over
# fork+exec into the child's ru_maxrss, so under a pytest worker that ran frameworks in-process
# (~800 MB) ru_maxrss reported the worker's peak, not the step's.
PLAIN_STEP = """
import sys
import torch
from tests.memory_models import lm_4k
b, t = int(sys.argv[1]), int(sys.argv[2])
model = lm_4k()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
def step(b, t):
    ids = torch.randint(0, 4096, (b, t))
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 4096), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
step(1, 8)
step(b, t)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(*(status[k].split()[0] for k in ("RssAnon", "RssFile")), torch.get_num_threads())
print(int(status["VmHWM"].split()[0]) * 1024)
"""


def raise_own_peak(nbytes: int) -> None:
    """Make this (the test) process's peak resident memory at least ``nbytes``, as a pytest worker that ran
    frameworks in-process has it; the bytes are freed at once, the high-water mark stays. A peak reading of
    a process this one starts must not see it."""
    ballast = b"\1" * nbytes  # written, so resident
    del ballast


def plain_step_peak(batch: int, seqlen: int) -> tuple[int, str]:
    """The plain script's peak in bytes, and what else it read (RssAnon and RssFile in kB at the end, threads)."""
    out = subprocess.run([sys.executable, "-c", PLAIN_STEP, str(batch), str(seqlen)], capture_output=True, text=True,
                         timeout=300, check=True)
    *details, peak = out.stdout.split()
    return int(peak), " ".join(details)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A profile of the tiny model around LIMIT, and a plan of 600 samples made with it."""
    root = tmp_path_factory.mktemp("measured")
    profile = str(root / "tiny.json")
    result = runner.invoke(app, ["calibrate", "--model", LM, "--max-memory", LIMIT, "--max-seqlen", "512", "-o",
                                 profile])
    assert result.exit_code == 0, result.output
    metrics = write_metrics(root / "metrics", np.random.default_rng(1).integers(24, 500, 600))
    plan = str(root / "plan.parquet")
    result = runner.invoke(app, ["plan", metrics, "-o", plan, "--memory-profile", profile, "--max-memory", LIMIT,
                                 "--num-shapes", "4", "--drop-long"])
    assert result.exit_code == 0, result.output
    return profile, plan


def test_profile_is_the_process_peak_around_the_limit(calibrated):
    """The profile: every shape measured as a fresh process reads it, none far beyond the limit, the fit
    at or above every point, c0 holding the process (interpreter, torch: hundreds of MiB)."""
    from varlen_cli.memory import parse_size

    path, _ = calibrated
    profile = json.loads(open(path).read())
    limit = parse_size(LIMIT)
    fit = profile["fit"]
    assert fit["method"] == "envelope" and fit["c0"] > 200 * MiB and fit["c1"] > 0 and fit["allowance"] >= 0
    points = profile["points"]
    assert len(points) >= 6 and len({p["seqlen"] for p in points}) >= 3
    assert max(p["peak_bytes"] for p in points) <= 1.15 * limit  # around the limit, not far beyond it
    assert max(p["peak_bytes"] for p in points) >= 0.9 * limit
    assert all(p["predicted_bytes"] >= p["peak_bytes"] * (1 - 1e-9) for p in points)
    assert profile["measure"]["fork_offset_bytes"] > 0 and profile["measure"]["max_memory"] == LIMIT


def test_planned_steps_stay_under_the_limit(calibrated):
    """`calibrate --verify`: the plan's largest microbatches, each run in a fresh process, peak at or under
    the limit, the biggest at >= 75% of it; and a plain script running the largest one agrees."""
    from varlen_cli.memory import parse_size

    profile, plan = calibrated
    result = runner.invoke(app, ["calibrate", "--verify", plan, "--model", LM, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    limit = parse_size(LIMIT)
    assert report["ok"] and report["limit_bytes"] == limit
    rows = report["rows"]
    assert {c for r in rows for c in r["largest_by"]} == {"predicted peak", "B x T", "T"}
    peaks = [r["measured_bytes"] for r in rows]
    assert max(peaks) <= limit and max(peaks) >= 0.75 * limit, rows
    top = max(rows, key=lambda r: r["predicted_bytes"])
    raise_own_peak(limit + limit // 2)  # the plain script's reading is its own step's, whatever ran before here
    plain, details = plain_step_peak(top["batch_size"], top["seqlen"])
    seen = f"plain script: peak {plain} bytes (RssAnon, RssFile kB, threads: {details}); verify: {rows}"
    assert plain <= limit, seen
    # varlen's child reads what a plain script reads, or more (it holds the outputs through backward);
    # the allocator makes runs of one shape differ by up to a tensor (~30 MB here)
    assert plain <= top["measured_bytes"] + 0.05 * limit, seen


def test_verify_fails_over_the_limit(tmp_path):
    """A plan (one shape) against a limit below the process's own memory: exit 6, one line naming the shape,
    and the table marks it."""
    metrics = write_metrics(tmp_path / "metrics", np.full(40, 60))
    plan = str(tmp_path / "plan.parquet")
    assert runner.invoke(app, ["plan", metrics, "-o", plan, "--max-tokens", "512"]).exit_code == 0
    result = runner.invoke(app, ["calibrate", "--verify", plan, "--model", LM, "--max-memory", "200MiB"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 6, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(r"varlen: error: 1 of 1 microbatches measured above the limit "
                                            r"200\.00 MiB: 8x60 peaked at [\d.]+ MiB", lines[0]), lines
    assert "OVER" in result.stdout and "% of limit" in result.stdout and "B x T, T" in result.stdout


def test_forked_measurement_plus_offset_is_a_fresh_process(calibrated):
    """calibrate's fast path (a child forked from an imported server, plus the fresh-minus-forked offset
    measured at the first shape) reads what a fresh process reads: the profile's largest shape again,
    fresh."""
    from varlen_cli.memory.measure import MeasureSetup
    from varlen_cli.memory.procs import measure_fresh

    path, _ = calibrated
    points = json.loads(open(path).read())["points"]
    top = max((p for p in points if p["process"] == "fork"), key=lambda p: p["batch_size"] * p["seqlen"])
    fresh = measure_fresh(MeasureSetup(model=LM), top["batch_size"], top["seqlen"])
    assert fresh["process"] == "fresh"
    assert abs(top["peak_bytes"] - fresh["peak_bytes"]) <= 0.04 * fresh["peak_bytes"], (top, fresh)


def test_cpu_peak_sees_a_known_allocation():
    """A 48 MiB buffer that lives only inside forward: the process peak is 48 MiB higher than without it; and
    the peak is the measuring process's own, not that of the process that started it (here 1 GiB)."""
    from tests.memory_models import BALLAST_BYTES
    from varlen_cli.memory.measure import MeasureSetup
    from varlen_cli.memory.procs import measure_fresh

    raise_own_peak(1 << 30)
    with_buffer = measure_fresh(MeasureSetup(model="tests.memory_models:ballast"), 4, 64)
    without = measure_fresh(MeasureSetup(model="tests.memory_models:no_ballast"), 4, 64)
    assert without["peak_bytes"] < 800 * MiB, without  # torch and a tiny model: ~300 MiB, nothing inherited
    grown = with_buffer["peak_bytes"] - without["peak_bytes"]
    assert BALLAST_BYTES - 2 * MiB <= grown <= BALLAST_BYTES + 4 * MiB, grown  # page-level and library noise


MODEL_ERRORS = [
    (["--model", "tests.memory_models:raising", "--shapes", "1x8,2x8,1x16"], 3,
     "--model tests.memory_models:raising: raising() raised ValueError: hidden size 63 is not divisible by 4 heads"),
    (["--model", "tests.memory_models:forward_raises", "--shapes", "1x8,2x8,1x16"], 3,
     "--model tests.memory_models:forward_raises: the warm-up step at 1x8 raised RuntimeError: mat1 and mat2 shapes "
     "cannot be multiplied (8x4 and 5x4)"),
    (["--model", LM, "--max-memory", "100MiB"], 2,
     re.compile(r"--max-memory 100\.00 MiB: the smallest step \(1x16\) already peaks at [\d.]+ MiB \(interpreter, "
                r"torch, model, optimizer states\); no microbatch fits")),
]


@pytest.mark.parametrize("args, code, message", MODEL_ERRORS)
def test_calibrate_model_errors(tmp_path, args, code, message):
    """The user's model raising is the user's error (exit 3, one line), not a worker failure."""
    result = runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json")] + args)
    assert_user_error(result, code, message)
    assert not (tmp_path / "p.json").exists()


def test_calibrate_command_measures_and_prints(tmp_path):
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["calibrate", "--model", "tests.memory_models:no_ballast", "-o", str(out),
                                 "--shapes", "1x16,4x16,1x32,4x32", "--optimizer", "sgd"])
    assert result.exit_code == 0, result.output
    assert "held-out error" in result.output and "c0 (fixed" in result.output
    profile = json.loads(out.read_text())
    assert profile["optimizer"] == "sgd" and len(profile["points"]) == 4 and profile["vocab_size"] == 16
    assert [p["heldout"] for p in profile["points"]] == [False, True, False, False]


# The live tensors of one step per model, read from resident memory with glibc tuned so that freed memory
# leaves at once (every allocation above 64 KiB its own mapping): parameters, gradients and optimizer states
# counted from their storages, plus the resident growth over the step (high-water mark reset before). One
# process for every model (torch and transformers imported once); each model's tensors freed before the next.
LIVE_TENSORS_STEP = """
import ctypes, gc, sys
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 1 << 16); libc.mallopt(-1, 1 << 16)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
import torch
from varlen_cli.memory.measure import MeasureSetup, build, status_bytes, tensor_bytes, training_step
torch.set_num_threads(1)
for spec in sys.argv[1:]:
    name, b, t = spec.split(",")
    model, opt, vocab = build(MeasureSetup(model=name))
    training_step(model, opt, torch.randint(0, vocab, (1, 8)))
    model.zero_grad(set_to_none=False)
    ids = torch.randint(0, vocab, (int(b), int(t)))
    gc.collect(); libc.malloc_trim(0)
    static, before = tensor_bytes(model, opt), status_bytes("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    training_step(model, opt, ids)
    print(static + status_bytes("VmHWM") - before)
    del model, opt, ids
    gc.collect(); libc.malloc_trim(0)
"""
SHAPES = [("small", 8, 256), ("medium", 2, 512)]


def test_analytic_profile_matches_live_tensors(tmp_path):
    """The analytic profile of a config-built Llama (no weights, no torch) counts tensors: against the live
    tensors of the same model's step (parameters, gradients, states and what the step adds, read with an
    allocator that frees at once), within 15%, for two models and shapes. (A training process peaks higher:
    docs/memory.md.)"""
    pytest.importorskip("transformers")
    from tests import memory_llama

    fits = []
    for name, _, _ in SHAPES:
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps(memory_llama.config_json(getattr(memory_llama, name.upper()))))
        out = tmp_path / f"{name}-analytic.json"
        result = runner.invoke(app, ["calibrate", "--hf-config", str(config), "--dtype", "fp32", "-o", str(out),
                                     "--json"])
        assert result.exit_code == 0, result.output
        fits.append(json.loads(out.read_text())["fit"])
    specs = [f"tests.memory_llama:{name}_llama,{b},{t}" for name, b, t in SHAPES]
    run = subprocess.run([sys.executable, "-c", LIVE_TENSORS_STEP, *specs], capture_output=True, text=True,
                         timeout=300, check=True)
    for (name, b, t), fit, live in zip(SHAPES, fits, map(int, run.stdout.split())):
        predicted = fit["c0"] + fit["c1"] * b * t + fit["c2"] * b * t * t
        assert abs(predicted / live - 1) <= 0.15, (name, b, t, live, predicted)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA device")
def test_cuda_planned_steps_stay_under_the_limit(tmp_path):
    """On a GPU: calibrate around a limit, plan with it, run the largest microbatches in fresh processes:
    peak reserved memory plus the CUDA context at or under the limit."""
    from varlen_cli.memory import parse_size

    limit = "3GiB"
    profile = str(tmp_path / "cuda.json")
    result = runner.invoke(app, ["calibrate", "--model", LM, "--device", "cuda", "--max-memory", limit, "-o",
                                 profile])
    assert result.exit_code == 0, result.output
    measured = json.loads(open(profile).read())
    assert all(p["context_bytes"] > 0 and p["peak_bytes"] >= p["reserved_bytes"] for p in measured["points"])
    metrics = write_metrics(tmp_path / "metrics", np.random.default_rng(2).integers(24, 2000, 400))
    plan = str(tmp_path / "plan.parquet")
    result = runner.invoke(app, ["plan", metrics, "-o", plan, "--memory-profile", profile, "--max-memory", limit,
                                 "--num-shapes", "4", "--drop-long"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["calibrate", "--verify", plan, "--model", LM, "--device", "cuda", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert max(r["measured_bytes"] for r in rows) <= parse_size(limit), rows
