"""Memory-aware budgets: `varlen calibrate` (measured on CPU, analytic from a HF config), `varlen plan
--max-memory`, validate/inspect, and `varlen_cli.loader.predicted_memory`.

The slow tests measure real training steps of small models on CPU, one fresh process per shape
(see docs/memory.md for what the CPU peak is); expected values come from those measurements, never
from the fit's own report."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from hypothesis import given, settings
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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 512), st.integers(8, 4096), st.floats(0.0, 0.3)), min_size=4, max_size=16),
       st.floats(1e6, 1e9), st.floats(1.0, 1e5), st.floats(0.0, 1e3))
def test_envelope_is_above_every_point(points, c0, c1, c2):
    """The measured profile's fit: non-negative, at or above every measured peak (noise included), and
    exactly the generating coefficients when there is no noise."""
    from varlen_cli.memory import fit_envelope

    b = np.array([p[0] for p in points])
    t = np.array([p[1] for p in points])
    exact = c0 + c1 * b * t + c2 * b * t * t
    noisy = exact * (1 + np.array([p[2] for p in points]))
    got = fit_envelope(b, t, noisy)
    assert min(got) >= 0
    pred = got[0] + got[1] * b * t + got[2] * b * t * t
    assert np.all(pred >= noisy * (1 - 1e-9))
    if len({(x, y) for x, y in zip(b.tolist(), t.tolist())}) >= 3 and len(set(t.tolist())) >= 2:
        exact_fit = fit_envelope(b, t, exact)
        np.testing.assert_allclose(exact_fit[0] + exact_fit[1] * b * t + exact_fit[2] * b * t * t, exact, rtol=1e-6,
                                   atol=1e-6 * exact.max())


def test_envelope_fit_reports_heldout_error_of_the_other_points():
    """fit_error of an envelope profile: the envelope of the fitting points against the held-out ones;
    the coefficients are the envelope of all points (so every point is at or under its prediction)."""
    from varlen_cli.memory import fit_points

    b = [1, 4, 16, 1, 4, 16, 1, 2, 4]
    t = [32, 32, 32, 128, 128, 128, 512, 512, 512]
    peak = [5e8 + 5e5 * x * y + 40 * x * y * y for x, y in zip(b, t)]
    peak[4] *= 1.04  # a held-out point 4% above the others' envelope
    points = [{"batch_size": x, "seqlen": y, "peak_bytes": p} for x, y, p in zip(b, t, peak)]
    fit, error = fit_points(points, "envelope")
    assert fit["method"] == "envelope" and fit["heldout_points"] == 3
    assert [p["heldout"] for p in points] == [False, True, False, False, True, False, False, True, False]
    assert error["heldout_max_under"] == pytest.approx(1 - 1 / 1.04, rel=1e-3)
    assert fit["allowance"] == pytest.approx(0.04 * peak[4] / 1.04, rel=1e-6)  # raised by what it missed
    assert all(p["predicted_bytes"] >= p["peak_bytes"] * (1 - 1e-9) for p in points)


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
    out = {
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
        "tiny_c1": _write(root / "tiny_c1.json", _profile(c1=1e-300, c2=0.0)),
        "tiny_c2": _write(root / "tiny_c2.json", _profile(c1=0.0, c2=1e-300)),
        "huge": _write(root / "huge.json", _profile(c1=1e300, c2=1e300)),
        "root": str(root),
    }
    os.mkfifo(root / "fifo.json")
    out["fifo"] = str(root / "fifo.json")
    return out


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


def test_calibrate_needs_an_output(files):
    result = runner.invoke(app, ["calibrate", "--hf-config", files["hf_good"]])
    assert_user_error(result, 2, "give -o/--output FILE: the memory profile to write (or --verify PLAN to check a "
                                 "plan)")


def test_calibrate_refuses_a_fifo_config(files, tmp_path):
    result = runner.invoke(app, ["calibrate", "--hf-config", files["fifo"], "-o", str(tmp_path / "p.json")])
    assert_user_error(result, 3, f"--hf-config {files['fifo']} is a FIFO (named pipe), not a regular file")


def _safety_case(tmp_path, case: str):
    """(args, output path, exit code, message, the output's content that must stay as it was)."""
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4}))
    model_py = tmp_path / "mymodel.py"
    model_py.write_text("def build():\n    raise SystemExit('never run')\n")
    notes = tmp_path / "notes.json"
    notes.write_text('{"my": "notes"}')
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"format": PROFILE_FORMAT}))
    link = tmp_path / "link.json"
    os.symlink(target, link)
    (tmp_path / "sub").mkdir()
    cases = {
        "its own --hf-config": (["--hf-config", str(hf)], hf, 4, f"output {hf} is the input {hf}; write the output "
                                "elsewhere"),
        "its own --model .py": (["--model", f"{model_py}:build"], model_py, 4,
                                f"output {model_py} is the input {model_py}; write the output elsewhere"),
        "a foreign notes.json": (["--hf-config", str(hf)], notes, 4,
                                 f"output {notes} is not a varlen memory profile; --overwrite replaces only varlen "
                                 "outputs"),
        "a symlink": (["--hf-config", str(hf)], link, 4,
                      f"output {link} is a symbolic link; --overwrite does not replace links or their targets "
                      "(remove the link or give the real path)"),
        "a directory": (["--hf-config", str(hf)], tmp_path / "sub", 4,
                        f"output {tmp_path / 'sub'} is a directory; give a file name such as profile.json"),
    }
    return cases[case]


@pytest.mark.parametrize("case", ["its own --hf-config", "its own --model .py", "a foreign notes.json", "a symlink",
                                  "a directory"])
def test_calibrate_output_safety(tmp_path, case):
    """`calibrate -o ... --overwrite` never replaces an input, a file varlen did not make, or a link."""
    args, out, code, message = _safety_case(tmp_path, case)
    before = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and not p.is_symlink()}
    result = runner.invoke(app, ["calibrate", "-o", str(out), "--overwrite"] + args)
    assert_user_error(result, code, message)
    assert {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and not p.is_symlink()} == before
    assert os.path.islink(tmp_path / "link.json")


def test_calibrate_overwrites_its_own_profile(files, tmp_path):
    out = tmp_path / "p.json"
    for _ in range(2):
        result = runner.invoke(app, ["calibrate", "--hf-config", files["hf_good"], "-o", str(out), "--overwrite"])
        assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["format"] == PROFILE_FORMAT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no temporaries or locks left


VERIFY_ERRORS = [
    (["--hf-config", "{hf_good}"], 2, "--verify runs the plan's microbatches with --model MODULE:FUNCTION (not "
     "--hf-config)"),
    (["--model", TINY, "-o", "{root}/x.json"], 2,
     "--verify writes no profile: drop -o/--output (--json prints the measurements)"),
    (["--model", TINY, "--shapes", "1x8,2x8,1x16"], 2,
     "--shapes, --max-seqlen and --calibration-memory apply to calibrating, not to --verify"),
    (["--model", TINY, "--verify-count", "0"], 2, "--verify-count must be >= 1 (got 0)"),
]


@pytest.mark.parametrize("args, code, message", VERIFY_ERRORS)
def test_verify_bad_options(files, args, code, message):
    args = [a.format(**files) for a in args]
    result = runner.invoke(app, ["calibrate", "--verify", files["good"]] + args)
    assert_user_error(result, code, message.format(**files))


def test_verify_bad_plans(files, tmp_path):
    """A missing plan, a FIFO, a file that is no plan, a plan made without --max-memory, a profile of
    another step: one line each, before any model runs."""
    plain = str(tmp_path / "plain.parquet")
    assert runner.invoke(app, ["plan", files["metrics"], "-o", plain, "--max-tokens", "2048"]).exit_code == 0
    memory = str(tmp_path / "memory.parquet")
    assert runner.invoke(app, ["plan", files["metrics"], "-o", memory, "--memory-profile", files["good"],
                               "--max-memory", "64MiB"]).exit_code == 0
    cuda = _write(tmp_path / "cuda.json", _profile(device="cuda", dtype="bfloat16", optimizer="adamw"))
    cases = [
        ([str(tmp_path / "none.parquet")], 3, f"plan {tmp_path / 'none.parquet'} does not exist"),
        ([files["fifo"]], 3, f"plan {files['fifo']} is a FIFO (named pipe), not a regular file"),
        ([files["good"]], 3, re.compile(rf"{re.escape(files['good'])} is not a readable Parquet file: .*")),
        ([plain], 2, f"--verify: {plain} records no memory limit (it was not planned with --max-memory); pass "
                     "--max-memory"),
        ([memory, "--memory-profile", cuda], 2,
         f"--verify: the profile ({cuda}) was made with --device cuda --dtype bfloat16; pass the same to run the "
         "same step"),
    ]
    for args, code, message in cases:
        result = runner.invoke(app, ["calibrate", "--model", TINY, "--verify"] + args)
        assert_user_error(result, code, message)


def test_verify_picks_the_largest_microbatches():
    """Per criterion the largest distinct shapes (ties in T: the larger B), each once, at its first row."""
    from varlen_cli.memory.verify import pick_rows

    b = np.array([4, 2, 8, 1, 8, 3, 2])
    t = np.array([100, 300, 64, 700, 64, 250, 300])
    cols = {"step": np.arange(7), "rank": np.zeros(7, int), "micro": np.zeros(7, int), "batch_size": b, "seqlen": t}
    coef = (1e6, 100.0, 1.0)  # peak: 1e6 + 100 BT + BT^2 -> 1x700 largest (560,000 + 490,000)
    rows = pick_rows(cols, coef, 1)
    got = {(r["batch_size"], r["seqlen"]): (r["largest_by"], r["step"]) for r in rows}
    assert got == {(1, 700): (["predicted peak", "T"], 3), (3, 250): (["B x T"], 5)}
    rows = pick_rows(cols, None, 2)
    got = {(r["batch_size"], r["seqlen"]): r["largest_by"] for r in rows}
    assert got == {(3, 250): ["B x T"], (1, 700): ["B x T", "T"], (2, 300): ["T"]}
    assert all(r["predicted_bytes"] is None for r in rows)


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
    (["--memory-profile", "{tiny_c1}", "--max-memory", "1GiB"], 3,
     "{tiny_c1}: fit coefficient c1 = 1e-300 bytes per token is below 1 (a training step holds more per token); "
     "re-run `varlen calibrate`"),
    (["--memory-profile", "{tiny_c2}", "--max-memory", "1GiB"], 3,
     "{tiny_c2}: fit coefficient c2 = 1e-300 bytes per token is below 1 (a training step holds more per token); "
     "re-run `varlen calibrate`"),
    (["--memory-profile", "{fifo}", "--max-memory", "1GiB"], 3,
     "memory profile {fifo} is a FIFO (named pipe), not a regular file"),
    (["--memory-profile", "{huge}", "--max-memory", "1GiB"], 2,
     "--max-memory 1GiB leaves 970.80 MiB above the fixed memory: less than one token (9.09e+287 TiB)"),
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


def test_calibrate_options_say_what_the_config_says():
    """Every `varlen calibrate` option's help is its CalibrateConfig field's documentation (one source)."""
    import inspect

    from varlen_cli.cli.calibrate import calibrate_command
    from varlen_cli.memory.calibrate import CalibrateConfig
    from varlen_cli.runtime.choices import field_help

    params = {n: p for n, p in inspect.signature(calibrate_command).parameters.items() if n != "json_output"}
    assert set(params) == {f for f in CalibrateConfig.__dataclass_fields__}
    for name, p in params.items():
        assert p.default.help == field_help(CalibrateConfig, name), name


@pytest.mark.parametrize("c0, c1, c2, limit", [(380 * MiB, 25_000.0, 200.0, 640 * MiB),
                                               (550 * MiB, 500_000.0, 60.0, 1536 * MiB),
                                               (20 << 30, 2_000_000.0, 0.0, 78 << 30)])
def test_walk_measures_along_the_limit(c0, c1, c2, limit):
    """Synthetic peaks: T doubles from 16; at every T the largest B measured is the largest that fits (or
    within 10% of the limit), nothing is measured more than 5% over it, and the last shape is B = 1 at the
    longest T that fits, so no plannable T lies beyond the measured ones."""
    from varlen_cli.memory.grid import walk

    def peak(b, t):
        return c0 + c1 * b * t + c2 * b * t * t

    points = walk(lambda b, t: {"batch_size": b, "seqlen": t, "peak_bytes": peak(b, t)}, limit)
    assert all(p["peak_bytes"] <= 1.05 * limit for p in points)
    assert len(points) <= 24 and len({(p["batch_size"], p["seqlen"]) for p in points}) == len(points)
    ts = sorted({p["seqlen"] for p in points})
    assert ts[:-1] == [16 * 2**k for k in range(len(ts) - 1)]
    for t in ts:
        top = max((p for p in points if p["seqlen"] == t), key=lambda p: p["batch_size"])
        assert top["peak_bytes"] >= 0.9 * limit or peak(top["batch_size"] + 1, t) > 0.97 * limit, (t, top)
    longest = max(ts)
    assert peak(1, longest) <= limit and peak(1, int(longest * 1.06)) > 0.97 * limit


def test_walk_steps_down_after_out_of_memory():
    """A device that runs out of memory below the limit: the walk comes back under it and goes on."""
    from varlen_cli.memory.grid import walk

    c0, c1, limit, device = 100 * MiB, 100_000.0, 1000 * MiB, 800 * MiB

    def measure(b, t):
        p = c0 + c1 * b * t
        return {"batch_size": b, "seqlen": t, "oom": True} if p > device else {"batch_size": b, "seqlen": t,
                                                                               "peak_bytes": p}

    points = walk(measure, limit)
    assert points and all(p["peak_bytes"] <= device for p in points)
    assert len({p["seqlen"] for p in points}) >= 3
