"""Memory-aware budgets: `varlen calibrate` (measured on CPU, analytic from a HF config), `varlen plan
--max-memory`, validate/inspect, and `varlen_cli.loader.predicted_memory`.

The slow tests measure real training steps of small models on CPU, one fresh process per shape
(see docs/memory.md for what the CPU peak is); expected values come from those measurements, never
from the fit's own report."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.plan_helpers import write_metrics
from varlen_cli.cli import app
from varlen_cli.memory import budget_from_profile, fit_nnls, parse_size
from varlen_cli.memory.profile import PROFILE_FORMAT
from varlen_cli.plan.shapes import Budget

runner = CliRunner()
MiB = 1 << 20
TINY = "tests.memory_models:tiny_lm"
CALIBRATION_SHAPES = "1x32,16x32,1x64,4x64,16x64,1x128,8x128,2x256,4x256"


def _profile(c0=2 * MiB, c1=16_000.0, c2=80.0, **extra) -> dict:
    out = {"format": PROFILE_FORMAT, "format_version": 1, "mode": "measured", "model": "x:y",
           "fit": {"c0": c0, "c1": c1, "c2": c2}}
    out.update(extra)
    return out


def _write(path, obj) -> str:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


# -- sizes, fit, budget mapping (fast) -------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("70GiB", 70 << 30), ("512MB", 512 * 10**6), ("1073741824", 1 << 30), ("1.5gib", 3 << 29), ("64 KiB", 65536),
    ("2G", 2 * 10**9), ("100b", 100), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@given(st.floats(0, 1e9), st.floats(1, 1e5), st.floats(0, 1e3))
def test_fit_recovers_exact_coefficients(c0, c1, c2):
    b = np.array([1, 4, 16, 1, 8, 2, 1, 3])
    t = np.array([32, 32, 32, 128, 128, 512, 1024, 700])
    peak = c0 + c1 * b * t + c2 * b * t * t
    got = fit_nnls(b, t, peak)
    assert min(got) >= 0
    np.testing.assert_allclose(got[0] + got[1] * b * t + got[2] * b * t * t, peak, rtol=1e-6)


def test_fit_is_non_negative_on_data_a_free_fit_makes_negative():
    b, t = np.array([1, 2, 4, 1, 2]), np.array([64, 64, 64, 256, 256])
    peak = 1e6 + 1e4 * b * t - 5.0 * b * t * t  # a free least-squares fit gives c2 < 0
    c0, c1, c2 = fit_nnls(b, t, peak)
    assert c0 >= 0 and c1 >= 0 and c2 == 0


@given(st.integers(1, 4096), st.integers(1, 8192), st.floats(0.0, 0.5))
def test_budget_from_profile_is_the_memory_limit(batch, seqlen, margin):
    """The planner's budget (B*T + A*B*T^2 <= max_tokens) admits (B, T) only if the profile predicts
    a peak within max_memory * (1 - margin); and it loses less than one token's memory to rounding."""
    profile = _profile()
    max_memory = 3 << 30
    max_tokens, attention_cost = budget_from_profile(profile, max_memory, margin)
    fits = bool(Budget(max_tokens, None, attention_cost).fits(batch, seqlen))
    c0, c1, c2 = 2 * MiB, 16_000.0, 80.0
    peak = c0 + c1 * batch * seqlen + c2 * batch * seqlen**2
    limit = max_memory * (1 - margin)
    if fits:
        assert peak <= limit * (1 + 1e-12)
    else:
        assert peak > limit - c1 * (1 + 1e-9)


# -- bad inputs (fast) -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("memfiles")
    return {
        "good": _write(root / "good.json", _profile()),
        "notjson": _write(root / "notjson.json", "this is not json"),
        "other": _write(root / "other.json", {"format": "something-else"}),
        "negative": _write(root / "negative.json", _profile(c2=-1.0)),
        "flat": _write(root / "flat.json", _profile(c1=0.0, c2=0.0)),
        "hf_bad": _write(root / "hf_bad.json", {"model_type": "gpt2", "n_embd": 64}),
        "hf_good": _write(root / "hf_good.json", {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
                                                  "num_hidden_layers": 2, "num_attention_heads": 4}),
        "metrics": write_metrics(root / "metrics", np.random.default_rng(0).integers(10, 200, 300)),
        "exists": _write(root / "exists.json", "{}"),
        "root": str(root),
    }


CALIBRATE_ERRORS = [
    ([], 2, "give exactly one of --model MODULE:FUNCTION (measure) and --hf-config FILE (analytic)"),
    (["--model", TINY, "--hf-config", "{hf_good}"], 2,
     "give exactly one of --model MODULE:FUNCTION (measure) and --hf-config FILE (analytic)"),
    (["--model", "no_colon"], 2, "--model must be MODULE:FUNCTION (got 'no_colon')"),
    (["--model", "no_such_module_x:f"], 3,
     "--model no_such_module_x:f: cannot import module 'no_such_module_x': ModuleNotFoundError: "
     "No module named 'no_such_module_x'"),
    (["--model", "tests.memory_models:nothing"], 3,
     "--model tests.memory_models:nothing: module 'tests.memory_models' has no function 'nothing'"),
    (["--model", TINY, "--shapes", "4x"], 2, "--shapes: cannot read '4x' as BxT (example: --shapes 1x64,8x64,2x256)"),
    (["--model", TINY, "--shapes", "1x64,2x64,4x64"], 2,
     "--shapes needs at least 3 distinct shapes with at least 2 different T (to fit c0, c1, c2)"),
    (["--model", TINY, "--dtype", "int8"], 2,
     "--dtype must be one of float32, bfloat16, float16 (or fp32, bf16, fp16) (got 'int8')"),
    (["--model", TINY, "--sharding", "zero3"], 2,
     "--sharding applies to --hf-config (analytic); a measured model runs as it is built"),
    (["--model", TINY, "--calibration-memory", "lots"], 2,
     "--calibration-memory: cannot read 'lots' as a size (examples: 70GiB, 512MB, 1073741824)"),
    (["--hf-config", "{hf_good}", "--shapes", "1x64,2x64,1x128"], 2,
     "--shapes, --calibration-memory and --vocab-size apply to --model (measured)"),
    (["--hf-config", "{hf_good}", "--world-size", "8"], 2,
     "--world-size needs --sharding zero1|zero2|zero3|fsdp (replicated states do not shrink)"),
    (["--hf-config", "{root}/missing.json"], 3, "--hf-config {root}/missing.json does not exist"),
    (["--hf-config", "{notjson}"], 3, "--hf-config {notjson} is not JSON"),
    (["--hf-config", "{hf_bad}"], 3, "--hf-config {hf_bad}: no positive integer vocab_size, hidden_size, "
     "intermediate_size, num_hidden_layers, num_attention_heads (varlen counts Llama-family decoders: llama, "
     "mistral, qwen2, ...)"),
]


@pytest.mark.parametrize("args, code, message", CALIBRATE_ERRORS)
def test_calibrate_bad_inputs(files, tmp_path, args, code, message):
    args = [a.format(**files) for a in args]
    result = runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json")] + args)
    assert_user_error(result, code, message.format(**files))
    assert not (tmp_path / "p.json").exists()


def test_calibrate_refuses_existing_output(files):
    result = runner.invoke(app, ["calibrate", "--hf-config", files["hf_good"], "-o", files["exists"]])
    assert_user_error(result, 4, f"output {files['exists']} already exists; pass --overwrite to replace it")


PLAN_ERRORS = [
    (["--max-memory", "1GiB"], 2, "--max-memory and --memory-profile go together"),
    (["--memory-profile", "{good}"], 2, "--max-memory and --memory-profile go together"),
    (["--memory-profile", "{good}", "--max-memory", "70 GB?"], 2,
     "--max-memory: cannot read '70 GB?' as a size (examples: 70GiB, 512MB, 1073741824)"),
    (["--memory-profile", "{good}", "--max-memory", "0"], 2, "--max-memory must be > 0 (got '0')"),
    (["--memory-profile", "{good}", "--max-memory", "2MiB"], 2,
     "--max-memory 2MiB (minus the 0.05 margin: 1.90 MiB) is below the profile's fixed memory c0 = 2.00 MiB "
     "(parameters, gradients, optimizer states): no microbatch fits"),
    (["--memory-profile", "{good}", "--max-memory", "1GiB", "--memory-margin", "1.5"], 2,
     "--memory-margin must be in [0, 1) (got 1.5)"),
    (["--memory-profile", "{good}", "--max-memory", "1GiB", "--max-tokens", "4096"], 2,
     "--max-tokens and --max-memory exclude each other (the budget comes from the profile)"),
    (["--memory-profile", "{good}", "--max-memory", "1GiB", "--attention-cost", "0.01"], 2,
     "--attention-cost and --max-memory exclude each other (A comes from the profile)"),
    (["--memory-profile", "{root}/none.json", "--max-memory", "1GiB"], 3,
     "memory profile {root}/none.json does not exist; create one with `varlen calibrate`"),
    (["--memory-profile", "{notjson}", "--max-memory", "1GiB"], 3,
     "{notjson} is not a varlen memory profile (not JSON); create one with `varlen calibrate`"),
    (["--memory-profile", "{other}", "--max-memory", "1GiB"], 3,
     '{other} is not a varlen memory profile (no "format": "varlen-memory-profile"); create one with '
     "`varlen calibrate`"),
    (["--memory-profile", "{negative}", "--max-memory", "1GiB"], 3,
     "{negative}: fit coefficients must be finite and >= 0 (got [2097152.0, 16000.0, -1.0])"),
    (["--memory-profile", "{flat}", "--max-memory", "1GiB"], 3,
     "{flat}: the fit does not grow with B x T (c1 = c2 = 0); re-run `varlen calibrate`"),
    (["--memory-profile", "{root}", "--max-memory", "1GiB"], 3,
     "memory profile {root} is a directory, not a profile file"),
]


@pytest.mark.parametrize("args, code, message", PLAN_ERRORS)
def test_plan_memory_bad_inputs(files, tmp_path, args, code, message):
    args = [a.format(**files) for a in args]
    out = tmp_path / "plan.parquet"
    result = runner.invoke(app, ["plan", files["metrics"], "-o", str(out)] + args)
    assert_user_error(result, code, message.format(**files))
    assert not out.exists()


def test_validate_memory_needs_a_profile(files, tmp_path):
    out = str(tmp_path / "plan.parquet")
    assert runner.invoke(app, ["plan", files["metrics"], "-o", out, "--max-tokens", "2048"]).exit_code == 0
    result = runner.invoke(app, ["validate", out, "--max-memory", "1GiB"])
    assert_user_error(result, 2, "--max-memory needs --memory-profile (the plan records no memory profile)")
    result = runner.invoke(app, ["validate", out, "--memory-profile", files["good"]])
    assert_user_error(result, 2, "--memory-profile needs --max-memory (the plan records no memory limit)")


# -- plan, validate, inspect, loader with a given profile (fast) -----------------------------------
def test_plan_with_max_memory_records_predictions(files, tmp_path):
    from varlen_cli.loader import Plan, predicted_memory

    out = str(tmp_path / "plan.parquet")
    result = runner.invoke(app, ["plan", files["metrics"], "-o", out, "--memory-profile", files["good"],
                                 "--max-memory", "64MiB", "--num-shapes", "3", "--dp", "2"])
    assert result.exit_code == 0, result.output
    assert "predicted peak max" in result.output
    plan = Plan.open(out)
    meta = plan.meta
    c0, c1, c2 = 2 * MiB, 16_000.0, 80.0
    import pyarrow.parquet as pq

    t = pq.read_table(out, columns=["step", "batch_size", "seqlen", "shape_id"]).to_pydict()
    b, s = np.array(t["batch_size"], float), np.array(t["seqlen"], float)
    peak = c0 + c1 * b * s + c2 * b * s * s
    assert peak.max() <= 64 * MiB * 0.95 * (1 + 1e-12)
    assert meta["memory"]["predicted_peak_max"] == pytest.approx(peak.max())
    for k, shape_peak in enumerate(meta["memory"]["predicted_peak_per_shape"]):
        assert shape_peak == pytest.approx(peak[np.array(t["shape_id"]) == k].max())
    step = 3
    want = int(np.ceil(peak[np.array(t["step"]) == step].max()))
    assert predicted_memory(plan, step) == want
    assert predicted_memory(out, step, rank=1) <= want
    ok = runner.invoke(app, ["validate", out, "--json"])  # no --max-memory: the plan's own limit is checked
    checks = {c["name"]: c for c in json.loads(ok.stdout)["checks"]}
    assert checks["memory"]["ok"] and "<= 64.00 MiB in every microbatch" in checks["memory"]["detail"]
    ok = runner.invoke(app, ["validate", out, "--max-memory", "64MiB"])  # profile recorded in the plan
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(app, ["validate", out, "--max-memory", f"{int(peak.max()) - 1}",
                              "--memory-profile", files["good"]])
    assert bad.exit_code == 6 and "violation: memory:" in bad.stderr
    info = json.loads(runner.invoke(app, ["inspect", out, "--json"]).stdout)
    assert info["metadata"]["memory"]["max_memory"] == 64 * MiB
    assert "predicted peak max" in runner.invoke(app, ["inspect", out]).output


def test_packed_plan_with_max_memory(files, tmp_path):
    out = str(tmp_path / "packed.parquet")
    result = runner.invoke(app, ["plan", files["metrics"], "-o", out, "--memory-profile", files["good"],
                                 "--max-memory", "64MiB", "--packing", "--seq-len", "256"])
    assert result.exit_code == 0, result.output
    from varlen_cli.loader import Plan

    plan = Plan.open(out)
    rows = plan.microbatch(0, 0, 0).batch_size
    c0, c1, c2 = 2 * MiB, 16_000.0, 80.0
    limit = 64 * MiB * 0.95
    # R rows of 256 tokens, attention over whole rows: the most rows that fit
    assert c0 + c1 * rows * 256 + c2 * rows * 256**2 <= limit < c0 + c1 * (rows + 1) * 256 + c2 * (rows + 1) * 256**2


# -- measured on CPU (slow: one fresh process per shape) -------------------------------------------
def _c_form(fit: dict, b, t) -> float:
    return fit["c0"] + fit["c1"] * b * t + fit["c2"] * b * t * t


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    from varlen_cli.memory import CalibrateConfig, calibrate

    path = str(tmp_path_factory.mktemp("calib") / "tiny.json")
    profile = calibrate(CalibrateConfig(output=path, model=TINY, shapes=CALIBRATION_SHAPES))
    return path, profile


@pytest.mark.slow
def test_measured_profile_predicts_held_out_shapes(tiny_profile):
    """Within 10% of the measured peak: on the calibration's held-out shapes and on shapes measured
    afresh here, none of them on the calibration grid."""
    from varlen_cli.memory.measure import MeasureSetup, measure_shape

    path, profile = tiny_profile
    on_disk = json.loads(open(path).read())
    assert on_disk["format"] == PROFILE_FORMAT and on_disk["device"] == "cpu" and on_disk["torch_version"]
    assert on_disk["model"] == TINY and on_disk["dtype"] == "float32" and on_disk["varlen_version"]
    fit = on_disk["fit"]
    assert min(fit["c0"], fit["c1"], fit["c2"]) >= 0 and fit["c2"] > 0  # materialised attention: c2 matters
    held = [p for p in on_disk["points"] if p["heldout"]]
    assert len(held) >= 3
    for p in held:
        assert abs(_c_form(fit, p["batch_size"], p["seqlen"]) / p["peak_bytes"] - 1) <= 0.10, p
    setup = MeasureSetup(model=TINY)
    for b, t in ((6, 96), (3, 192)):
        measured = measure_shape(setup, b, t)["peak_bytes"]
        assert abs(_c_form(fit, b, t) / measured - 1) <= 0.10, (b, t, measured)
    # the attention term is real: at 8x256 it is a large part of the peak
    assert fit["c2"] * 8 * 256**2 > 0.2 * _c_form(fit, 8, 256)


@pytest.mark.slow
def test_measurement_does_not_depend_on_the_callers_heap(tiny_profile):
    """The CPU child is forked from the caller: after the caller ran training steps (its heap holds
    tens of MB of free chunks, as in a long test session), a shape still measures what the profile
    predicts (without plugging the inherited chunks it read 1.5-2.5x high at 4x256)."""
    import ctypes

    import torch

    from tests.memory_models import TinyLM
    from varlen_cli.memory.measure import MeasureSetup, _MallInfo2, measure_shape

    model = TinyLM(dim=128)
    opt = torch.optim.AdamW(model.parameters())
    for b, t in ((4, 300), (2, 512), (8, 64)):
        ids = torch.randint(0, 256, (b, t))
        torch.nn.functional.cross_entropy(model(ids).reshape(-1, 256), ids.reshape(-1)).backward()
        opt.step()
    del model, opt, ids
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    assert libc.mallinfo2().fordblks > 16 * MiB  # the precondition: a heap with free chunks to inherit
    _, profile = tiny_profile
    measured = measure_shape(MeasureSetup(model=TINY), 4, 256)["peak_bytes"]
    assert abs(_c_form(profile["fit"], 4, 256) / measured - 1) <= 0.10, measured


@pytest.mark.slow
def test_plan_with_max_memory_runs_under_the_limit(tiny_profile, tmp_path):
    """A plan made with --max-memory X, run through the loader: every microbatch's measured peak
    (each distinct B x T measured in a fresh process on the loader's own batch; the peak does not
    depend on the ids' values) is <= X, and the largest uses >= 75% of X."""
    from varlen_cli.loader import Plan, dataloader_for_plan
    from varlen_cli.memory.measure import MeasureSetup, measure_shape

    path, _ = tiny_profile
    lengths = np.random.default_rng(1).integers(24, 250, 600)
    metrics = write_metrics(tmp_path / "metrics", lengths)
    out = str(tmp_path / "plan.parquet")
    limit = 48 * MiB
    result = runner.invoke(app, ["plan", metrics, "-o", out, "--memory-profile", path, "--max-memory", "48MiB",
                                 "--num-shapes", "3", "--static-shapes"])
    assert result.exit_code == 0, result.output
    plan = Plan.open(out)
    dataset = [{"input_ids": np.arange(n) % 256} for n in lengths]
    loader = dataloader_for_plan(dataset, plan, rank=0, world_size=1)
    first_of_shape = {}
    for batch in loader:
        ids = batch["input_ids"]
        first_of_shape.setdefault(tuple(ids.shape), ids.clamp(min=0).numpy())
    assert len(first_of_shape) == 3
    setup = MeasureSetup(model=TINY)
    peaks = {shape: measure_shape(setup, *shape, input_ids=ids)["peak_bytes"] for shape, ids in first_of_shape.items()}
    assert max(peaks.values()) <= limit, peaks
    assert max(peaks.values()) >= 0.75 * limit, peaks


@pytest.mark.slow
@pytest.mark.parametrize("name", ["small", "medium"])
def test_analytic_profile_matches_measurement(name, tmp_path):
    """The analytic profile of a config-built Llama (no weights, no torch) against the measured
    peak of the same model built by transformers: within 15%."""
    pytest.importorskip("transformers")
    from tests import memory_llama
    from varlen_cli.memory.measure import MeasureSetup, measure_shape

    config = _write(tmp_path / "config.json", memory_llama.config_json(getattr(memory_llama, name.upper())))
    out = tmp_path / "analytic.json"
    result = runner.invoke(app, ["calibrate", "--hf-config", config, "--dtype", "fp32", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    profile = json.loads(out.read_text())
    assert profile["mode"] == "analytic" and profile["fit_error"]["heldout_max_abs_rel"] is not None
    setup = MeasureSetup(model=f"tests.memory_llama:{name}_llama")
    for b, t in ((8, 256), (2, 512)):  # where attention matters, and the largest fit error on this grid
        measured = measure_shape(setup, b, t)
        assert measured["num_parameters"] == profile["num_parameters"]
        assert abs(_c_form(profile["fit"], b, t) / measured["peak_bytes"] - 1) <= 0.15, (b, t, measured)


@pytest.mark.slow
def test_cpu_peak_sees_a_known_allocation():
    """The CPU reading (static tensors + resident growth over the step, in a fresh process) sees a
    48 MiB buffer that lives only inside forward, and next to nothing without it."""
    from tests.memory_models import BALLAST_BYTES
    from varlen_cli.memory.measure import MeasureSetup, measure_shape

    with_buffer = measure_shape(MeasureSetup(model="tests.memory_models:ballast"), 4, 64)
    without = measure_shape(MeasureSetup(model="tests.memory_models:no_ballast"), 4, 64)
    assert with_buffer["hwm_reset"] and without["hwm_reset"]
    assert without["peak_bytes"] - without["static_bytes"] < 2 * MiB
    grown = with_buffer["peak_bytes"] - with_buffer["static_bytes"]
    assert BALLAST_BYTES - MiB // 4 <= grown <= BALLAST_BYTES + 2 * MiB, grown  # page-level noise


def test_auto_grid_grows_until_the_calibration_memory():
    """Synthetic peaks: the grid doubles T, multiplies B by 4, never keeps a shape above the cap,
    skips (does not measure) a B whose linear extrapolation passes it, and stops at the first T
    where B = 1 does not fit."""
    from varlen_cli.memory.calibrate import auto_grid

    c0, c1, c2 = 10 * MiB, 20_000.0, 100.0
    cap = 200 * MiB
    measured = []

    def measure(b, t):
        measured.append((b, t))
        return {"batch_size": b, "seqlen": t, "peak_bytes": c0 + c1 * b * t + c2 * b * t * t, "static_bytes": c0}

    points = auto_grid(measure, cap, max_seqlen=4096)
    assert all(p["peak_bytes"] <= cap for p in points)
    over = [(b, t) for b, t in measured if c0 + c1 * b * t + c2 * b * t * t > cap]
    assert len(over) <= len({t for _, t in measured})  # at most one miss per T: the rest are extrapolated
    ts = sorted({p["seqlen"] for p in points})
    assert ts == [32 * 2**k for k in range(len(ts))]
    t_next = 2 * ts[-1]
    assert c0 + c1 * t_next + c2 * t_next**2 > cap or ts[-1] == 4096  # B = 1 at the next T would not fit
    for t in ts:
        bs = [p["batch_size"] for p in points if p["seqlen"] == t]
        assert bs == [4**k for k in range(len(bs))]
        nxt = 4 * bs[-1]
        assert c0 + c1 * nxt * t + c2 * nxt * t * t > cap  # the next B would not have fitted


def test_packed_plan_per_segment_attention(files, tmp_path):
    """Packed plans record, beside the whole-row bound the budget guarantees, the per-segment
    (varlen attention) peak c0 + c1*R*T + c2*sum(s_i^2); the loader reports both."""
    import pyarrow.parquet as pq

    from varlen_cli.loader import Plan, predicted_memory

    out = str(tmp_path / "packed.parquet")
    result = runner.invoke(app, ["plan", files["metrics"], "-o", out, "--memory-profile", files["good"],
                                 "--max-memory", "64MiB", "--packing", "--seq-len", "256", "--grad-accum", "2"])
    assert result.exit_code == 0, result.output
    c0, c1, c2 = 2 * MiB, 16_000.0, 80.0
    rows = pq.read_table(out).to_pylist()
    seg = [c0 + c1 * r["batch_size"] * r["seqlen"] + c2 * sum(s * s for s in r["sample_lengths"]) for r in rows]
    full = [c0 + c1 * r["batch_size"] * r["seqlen"] + c2 * r["batch_size"] * r["seqlen"] ** 2 for r in rows]
    meta = Plan.open(out).meta["memory"]
    assert meta["predicted_peak_max_per_segment"] == pytest.approx(max(seg))
    assert meta["predicted_peak_max"] == pytest.approx(max(full)) and max(seg) < max(full)
    plan = Plan.open(out)
    step0 = [i for i, r in enumerate(rows) if r["step"] == 0]
    assert predicted_memory(plan, 0, attention="segment") == int(np.ceil(max(seg[i] for i in step0)))
    assert predicted_memory(plan, 0) == int(np.ceil(max(full[i] for i in step0)))


def test_plan_names_the_memory_limit_when_samples_do_not_fit(files, tmp_path):
    result = runner.invoke(app, ["plan", files["metrics"], "-o", str(tmp_path / "p.parquet"), "--memory-profile",
                                 files["good"], "--max-memory", "4MiB"])
    # (4 MiB x 0.95 - 2 MiB) / 16000 B = 117 tokens per microbatch; attention A = 80 / 16000
    assert_user_error(result, 3, re.compile(r"[\d,]+ samples do not fit the budget --max-memory 4MiB \(max_tokens 117 "
                                            r"from the profile\) \(the longest has \d+ tokens\); raise --max-memory "
                                            r"or pass --drop-long"))


def _terms(tmp_path, **options) -> dict:
    from varlen_cli.memory.analytic import analytic_profile_fields

    config = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048}
    path = _write(tmp_path / "config.json", config)
    fields = analytic_profile_fields(path, **options)
    return {t["name"]: t for t in fields["analytic"]["terms"]}, fields


def test_analytic_states_shard_as_documented(tmp_path):
    """Parameters, gradients and optimizer states divide by the world size exactly for the
    strategies that shard them (ZeRO-1: states; ZeRO-2: + gradients; ZeRO-3/FSDP: + parameters,
    plus one gathered layer)."""
    # parameters of this Llama by hand: embeddings and head 2 x 1000 x 64; per layer q/o 2 x 64 x 64,
    # k/v 2 x 64 x 16 (2 kv heads of 8 dims), MLP 3 x 64 x 128, two norms 2 x 64; final norm 64
    layer = 2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 128 + 2 * 64
    params = 2 * 1000 * 64 + 4 * layer + 64
    base, fields = _terms(tmp_path, dtype="bf16")
    assert fields["num_parameters"] == params
    assert base["parameters"]["bytes"] == base["gradients"]["bytes"] == 2 * params
    assert base["optimizer states"]["bytes"] == 2 * 2 * params
    for sharding, sharded in (("zero1", {"optimizer states"}), ("zero2", {"optimizer states", "gradients"}),
                              ("zero3", {"optimizer states", "gradients", "parameters"}),
                              ("fsdp", {"optimizer states", "gradients", "parameters"})):
        terms, _ = _terms(tmp_path, dtype="bf16", sharding=sharding, world_size=8)
        for name in ("parameters", "gradients", "optimizer states"):
            want = base[name]["bytes"] / (8 if name in sharded else 1)
            assert terms[name]["bytes"] == want, (sharding, name)
        assert ("gathered layer" in terms) == (sharding in ("zero3", "fsdp"))
        if "gathered layer" in terms:
            assert terms["gathered layer"]["bytes"] == 2 * 2 * layer


def test_analytic_attention_and_checkpointing(tmp_path):
    _, eager = _terms(tmp_path, dtype="float32")
    _, sdpa = _terms(tmp_path, dtype="float32", attention="sdpa")
    _, ckpt = _terms(tmp_path, dtype="float32", checkpointing=True)
    assert eager["fit"]["c2"] > 0 and sdpa["fit"]["c2"] == 0  # only eager materialises scores
    assert ckpt["fit"]["c1"] < eager["fit"]["c1"] and ckpt["fit"]["c2"] < eager["fit"]["c2"]
    for fields in (eager, sdpa, ckpt):
        assert fields["fit"]["c0"] == pytest.approx(4 * 4 * fields["num_parameters"], rel=0.02)  # fp32 AdamW


@pytest.mark.slow
def test_calibrate_command_measures_and_prints(tmp_path):
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["calibrate", "--model", "tests.memory_models:no_ballast", "-o", str(out),
                                 "--shapes", "1x16,4x16,1x32,4x32", "--optimizer", "sgd"])
    assert result.exit_code == 0, result.output
    assert "held-out error" in result.output and "c0 (fixed)" in result.output
    profile = json.loads(out.read_text())
    assert profile["optimizer"] == "sgd" and len(profile["points"]) == 4 and profile["vocab_size"] == 16
    assert [p["heldout"] for p in profile["points"]] == [False, True, False, False]


def test_memory_package_and_cli_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, varlen_cli.cli, varlen_cli.memory, varlen_cli.plan; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_plan_warns_when_the_margin_is_below_the_fit_error(files, tmp_path):
    profile = _write(tmp_path / "p.json", _profile(fit_error={"heldout_max_under": 0.08}))
    result = runner.invoke(app, ["plan", files["metrics"], "-o", str(tmp_path / "p.parquet"), "--memory-profile",
                                 profile, "--max-memory", "64MiB"])
    assert result.exit_code == 0, result.output
    assert "consider --memory-margin 0.09" in " ".join(result.output.split())
