"""``varlen simulate``: closed forms with identical microbatches, a brute-force event simulation on
random variable microbatches, the proportionate flow-shop makespan, real plans, the CLI and its errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import ROOT, assert_user_error
from tests.simulate_helpers import brute_force, write_plan
from varlen_cli.cli import app
from varlen_cli.schedule import FORWARD, PlanCosts, Scheme, SimulateConfig, make_scheme, simulate, simulate_scheme

USER_MODULE = __name__  # user-supplied scheme functions below are loaded as MODULE:FUNCTION

runner = CliRunner()


def uniform(tmp_path, *, steps=1, dp=1, grad_accum=4, b=2, t=8):
    """A plan of identical microbatches b x t: cost c = b*t units per stage forward."""
    return write_plan(tmp_path / "u.parquet", np.full((steps, dp * grad_accum), b), t, dp=dp)


def run(plan, schedule, stages, r=2.0, **kw):
    return simulate(SimulateConfig(plan=plan, schedule=schedule, stages=stages, backward_ratio=r, **kw)).results[0]


# -- closed forms, identical microbatches (docs/schedules.md) ---------------------------------------
@pytest.mark.parametrize("S,B,r", [(1, 1, 2.0), (4, 8, 2.0), (4, 2, 2.0), (3, 5, 1.0), (8, 3, 0.5)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_closed_forms(tmp_path, schedule, S, B, r):
    c = 2 * 8
    res = run(uniform(tmp_path, steps=2, grad_accum=B), schedule, S, r)
    assert res.workers == S
    assert res.steps.tolist() == [(1 + r) * (B + S - 1) * c] * 2
    assert res.bubble == pytest.approx((S - 1) / (B + S - 1))
    assert res.work == pytest.approx(2 * (1 + r) * S * B * c)
    held = [B] * S if schedule == "gpipe" else [min(S - s, B) for s in range(S)]
    assert res.peak_activation.tolist() == [h * c for h in held]
    assert res.peak_activation.max() == (B if schedule == "gpipe" else min(S, B)) * c
    # every microbatch crosses each of the S-1 boundaries twice (activation, then gradient) per step
    # worker s receives each microbatch's activation from s-1 and its gradient from s+1, twice (2 steps)
    assert res.activation_transfers.tolist() == [2 * B * c * ((s > 0) + (s < S - 1)) for s in range(S)]
    assert res.weight_transfers.tolist() == [0] * S


@pytest.mark.parametrize("schedule", ["ddp", "fsdp"])
@pytest.mark.parametrize("S,W,m", [(1, 1, 3), (4, 2, 3), (5, 3, 1), (2, 4, 2)])
def test_data_parallel_closed_forms(tmp_path, schedule, S, W, m):
    c, r = 16, 2.0
    res = run(uniform(tmp_path, steps=3, dp=W, grad_accum=m), schedule, S, r)
    assert res.workers == W
    assert res.steps.tolist() == [(1 + r) * S * m * c] * 3
    assert res.bubble == pytest.approx(0.0, abs=1e-12)
    assert res.peak_activation.tolist() == [S * c] * W  # all S stages' activations of one microbatch
    assert res.activation_transfers.tolist() == [0] * W
    if schedule == "ddp":
        assert res.weight_transfers.tolist() == [0] * W
        return
    # FSDP: worker w stores the stages s = w mod W and fetches a foreign stage unless its previous job
    # had the same stage: F(S-1) -> B(S-1) and B(0) -> next F(0) reuse the weights in hand.
    for w in range(W):
        foreign = {s for s in range(S) if s % W != w}
        per_step = m * (2 * len(foreign) - ((S - 1) in foreign)) - (m - 1) * (0 in foreign)
        assert res.weight_transfers[w] == 3 * per_step, w


@pytest.mark.parametrize("S,R,B", [(4, 2, 3), (4, 2, 1), (6, 3, 2), (6, 2, 5), (4, 4, 3)])
def test_looped_pipeline_closed_form(tmp_path, S, R, B):
    """LPP, L = S / R loops over R workers, breadth first: (1 + r)(L max(B, R) + min(B, R) - 1)."""
    c, r, L = 16, 2.0, S // R
    plan = uniform(tmp_path, grad_accum=B)
    for schedule in ("lpp", "fslpp"):
        res = run(plan, schedule, S, r, workers=R, groups=1)
        assert res.workers == R
        assert res.steps.tolist() == [(1 + r) * (L * max(B, R) + min(B, R) - 1) * c]
        assert res.peak_activation.tolist() == [L * B * c] * R
        assert res.weight_transfers.tolist() == [0] * R  # one group: FSLPP stores every stage where it runs


def test_fslpp_weight_transfers_per_step(tmp_path):
    """FSLPP with G groups: stage s stored on group (s // R) mod G; a foreign stage is fetched once
    for the forward and once for the backward, except the top stage of a worker (backward follows
    its forward directly)."""
    S, R, G, B = 8, 2, 2, 3
    res = run(uniform(tmp_path, steps=2, dp=G, grad_accum=B), "fslpp", S, workers=G * R, groups=G)
    for g in range(G):
        for p in range(R):
            mine = [p + k * R for k in range(S // R)]
            foreign = [s for s in mine if (s // R) % G != g]
            expected = 2 * len(foreign) - (mine[-1] in foreign)
            assert res.weight_transfers[g * R + p] == 2 * expected
    lpp = run(uniform(tmp_path, steps=2, dp=G, grad_accum=B), "lpp", S, workers=G * R, groups=G)
    assert lpp.weight_transfers.sum() == 0 and lpp.steps.tolist() == res.steps.tolist()


# -- variable microbatches: brute force and flow shop -----------------------------------------------
SCHEMES = st.sampled_from(["ddp", "fsdp", "gpipe", "1f1b", "lpp", "fslpp"])


@st.composite
def cases(draw):
    name = draw(SCHEMES)
    S = draw(st.integers(1, 4))
    units = draw(st.integers(1, 2))
    n = draw(st.integers(1, 4))
    workers = None
    if name in ("lpp", "fslpp"):
        workers = units * draw(st.integers(1, S))
    scheme = make_scheme(name, stages=S, microbatches=units * n, dp=units, workers=workers,
                         groups=None if name in ("ddp", "fsdp") else units)
    costs = draw(st.lists(st.integers(1, 20), min_size=units * n, max_size=units * n))
    tokens = draw(st.lists(st.integers(1, 50), min_size=units * n, max_size=units * n))
    r = draw(st.sampled_from([0.5, 1.0, 2.0, 3.0]))
    return scheme, costs, tokens, r


def _simulate_one_step(scheme, costs, tokens, r):
    pc = PlanCosts(path="", dp=1, grad_accum=len(costs), cost=np.array([costs], dtype=float),
                   tokens=np.array([tokens], dtype=float))
    return simulate_scheme(scheme, pc, r, gantt_step=0)


@settings(max_examples=150, deadline=None)
@given(cases())
def test_matches_brute_force_event_simulation(case):
    scheme, costs, tokens, r = case
    res = _simulate_one_step(scheme, costs, tokens, r)
    expected, peak, fetches = brute_force(scheme, costs, tokens, r)
    got = {(stage, micro, d): (w, a, e) for w, a, e, micro, d, stage in res.gantt}
    assert got == expected
    assert res.steps[0] == max(e for _, _, e in expected.values())
    assert res.peak_activation.tolist() == peak.tolist()
    assert res.weight_transfers.tolist() == fetches.tolist()


@st.composite
def arbitrary_schemes(draw):
    """Any compute/store/priority functions (chains=False: the general scheduler)."""
    S, N, W = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    where = draw(st.lists(st.integers(0, W - 1), min_size=2 * S * N, max_size=2 * S * N))
    keys = draw(st.permutations(range(2 * S * N)))
    owners = draw(st.lists(st.integers(0, W - 1), min_size=S, max_size=S))

    def job(s, b, d):
        return (d == "B") * S * N + s * N + b

    scheme = Scheme(name="random", stages=S, microbatches=N, workers=W, compute=lambda s, b, d: where[job(s, b, d)],
                    store=lambda s: owners[s], priority=lambda s, b, d: (keys[job(s, b, d)] // 2,),
                    flush=draw(st.booleans()))
    costs = draw(st.lists(st.integers(1, 9), min_size=N, max_size=N))
    return scheme, costs, draw(st.lists(st.integers(1, 9), min_size=N, max_size=N)), draw(st.sampled_from([1.0, 2.0]))


@settings(max_examples=100, deadline=None)
@given(arbitrary_schemes())
def test_general_scheduler_matches_brute_force(case):
    """Arbitrary schemes (workers shared between stages and microbatches, priorities with ties)
    through the general scheduler."""
    test_matches_brute_force_event_simulation.hypothesis.inner_test(case)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(1, 1000), min_size=1, max_size=12), st.sampled_from([0.5, 1.0, 2.0]))
def test_proportionate_flow_shop(S, costs, r):
    """The forward of a pipeline is a proportionate flow shop: its makespan is sum(c) + (S-1) max(c)
    whatever the costs; GPipe's backward is another one, so GPipe takes (1 + r) times that. 1F1B
    cannot beat a worker's own work nor the longest microbatch's chain."""
    flow = sum(costs) + (S - 1) * max(costs)
    gpipe = _simulate_one_step(make_scheme("gpipe", stages=S, microbatches=len(costs), dp=1), costs, costs, r)
    forward_end = max(e for _, _, e, _, d, _ in gpipe.gantt if d == FORWARD)
    assert forward_end == flow
    assert gpipe.steps[0] == pytest.approx((1 + r) * flow, rel=1e-12)
    one = _simulate_one_step(make_scheme("1f1b", stages=S, microbatches=len(costs), dp=1), costs, costs, r)
    assert one.steps[0] >= max((1 + r) * sum(costs), (1 + r) * S * max(costs)) - 1e-9
    assert max(e for _, _, e, _, d, _ in one.gantt if d == FORWARD) >= flow


@pytest.mark.parametrize("name", ["ddp", "fsdp", "gpipe", "1f1b", "lpp"])
def test_gantt_of_a_later_step_matches_brute_force(name):
    rng = np.random.default_rng(7)
    cost, tokens = rng.integers(1, 30, (5, 6)).astype(float), rng.integers(1, 30, (5, 6)).astype(float)
    scheme = make_scheme(name, stages=3, microbatches=6, dp=2)
    res = simulate_scheme(scheme, PlanCosts(path="", dp=2, grad_accum=3, cost=cost, tokens=tokens), 2.0, gantt_step=3)
    expected, _, _ = brute_force(scheme, cost[3].tolist(), tokens[3].tolist(), 2.0)
    assert {(s, b, d): (w, a, e) for w, a, e, b, d, s in res.gantt} == expected
    for k in range(5):
        assert res.steps[k] == max(e for _, _, e in brute_force(scheme, cost[k].tolist(), tokens[k].tolist(),
                                                                2.0)[0].values())


# -- real plans ---------------------------------------------------------------------------------------
def _real_plan(tmp_path, **kw):
    from tests.plan_helpers import write_metrics
    from varlen_cli.plan import PlanConfig, plan

    rng = np.random.default_rng(3)
    metrics = write_metrics(tmp_path / "m", rng.integers(5, 400, 600))
    out = str(tmp_path / "plan.parquet")
    plan(PlanConfig(input=metrics, output=out, **kw))
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_real_plan_data_parallel_and_work(tmp_path, packed):
    import pyarrow.parquet as pq

    kw = {"packing": True, "seq_len": 512, "max_tokens": 1024} if packed else {"max_tokens": 1024}
    path = _real_plan(tmp_path, dp=2, grad_accum=3, **kw)
    t = pq.read_table(path, columns=["step", "rank", "batch_size", "seqlen"]).to_pandas()
    t["cost"] = t.batch_size * t.seqlen * (1 + 0.01 * t.seqlen)
    S, r = 3, 2.0
    per_rank = t.groupby(["step", "rank"]).cost.sum().unstack()
    ddp = run(path, "ddp", S, r, attention_cost=0.01)
    assert ddp.steps == pytest.approx(((1 + r) * S * per_rank.max(axis=1)).to_numpy())
    assert ddp.work == pytest.approx((1 + r) * S * t.cost.sum())
    for schedule in ("gpipe", "1f1b", "lpp", "fslpp"):
        res = run(path, schedule, S, r, attention_cost=0.01)
        assert res.work == pytest.approx(ddp.work) and res.workers == 2 * S
        assert res.utilization == pytest.approx(res.work / (res.workers * res.makespan))
        # no schedule beats the busiest worker: each pipeline worker does one stage of its group's microbatches
        assert np.all(res.steps >= (1 + r) * per_rank.max(axis=1).to_numpy() - 1e-6)


# -- command line -------------------------------------------------------------------------------------
KEYS = {"schedule", "workers", "stages", "makespan", "steps", "work", "utilization", "bubble", "peak_activation",
        "activation_transfers", "weight_transfers"}


def test_cli_json_single_and_all(tmp_path):
    plan = write_plan(tmp_path / "p.parquet", np.random.default_rng(0).integers(1, 9, (5, 8)), 16, dp=2)
    result = runner.invoke(app, ["simulate", plan, "--schedule", "1f1b", "--stages", "4", "--json"])
    assert result.exit_code == 0, result.output
    one = json.loads(result.stdout)
    assert KEYS <= set(one) and one["schedule"] == "1f1b" and one["workers"] == 8 and len(one["steps"]) == 5
    assert one["makespan"] == pytest.approx(sum(one["steps"]))
    assert one["utilization"] == pytest.approx(one["work"] / (one["workers"] * one["makespan"]))
    assert one["bubble"] == pytest.approx(1 - one["utilization"])
    assert len(one["peak_activation"]) == len(one["weight_transfers"]) == len(one["activation_transfers"]) == 8
    result = runner.invoke(app, ["simulate", plan, "--schedule", "all", "--stages", "4", "--json"])
    assert result.exit_code == 0, result.output
    every = json.loads(result.stdout)
    assert [o["schedule"] for o in every] == ["ddp", "fsdp", "gpipe", "1f1b", "lpp", "fslpp"]
    assert every[3] == one
    result = runner.invoke(app, ["simulate", plan, "--schedule", "gpipe", "--stages", "2", "--json",
                                 "--gantt-step", "4"])
    out = json.loads(result.stdout)
    assert len(out["gantt"]) == 2 * 2 * 8 and max(j["end"] for j in out["gantt"]) == out["steps"][4]


def test_cli_all_with_workers_and_groups(tmp_path):
    """--schedule all: DDP/FSDP on dp workers, --groups for the pipelines, --workers for LPP/FSLPP."""
    plan = write_plan(tmp_path / "p.parquet", np.full((2, 8), 2), 4, dp=2)
    result = runner.invoke(app, ["simulate", plan, "--stages", "4", "--workers", "4", "--groups", "2", "--json"])
    assert result.exit_code == 0, result.output
    every = json.loads(result.stdout)
    assert [(o["schedule"], o["workers"], o["groups"]) for o in every] == [
        ("ddp", 2, 2), ("fsdp", 2, 2), ("gpipe", 8, 2), ("1f1b", 8, 2), ("lpp", 4, 2), ("fslpp", 4, 2)]
    # LPP, 2 loops over R = 2 workers, B = 4 >= R equal microbatches of 8 tokens: (1 + 2)(2 * 4 + 2 - 1) units
    assert every[4]["steps"] == [3 * 9 * 8] * 2


def test_cli_table_and_gantt(tmp_path):
    plan = uniform(tmp_path, grad_accum=3)
    result = runner.invoke(app, ["simulate", plan, "--schedule", "gpipe", "--stages", "2", "--gantt-step", "0",
                                 "--width", "30"])
    assert result.exit_code == 0, result.output
    rows = [line[5:] for line in result.stdout.splitlines() if re.match(r"w\d ", line)]
    # 2 stages, 3 equal microbatches, r = 2: makespan (1 + 2)(3 + 1) = 12 units, 2.5 columns a unit (a
    # column shows the job at its middle). w0: F0 F1 F2 in [0, 3), idle, B0 B1 B2 in [6, 12);
    # w1: idle, F0 F1 F2 in [1, 4), B0 B1 B2 in [4, 10), idle.
    assert rows == ["00" + "111" + "22" + "." * 8 + "00000" + "11111" + "22222",
                    ".." + "000" + "11" + "222" + "00000" + "11111" + "22222" + "." * 5]
    assert "gpipe" in result.stdout and "bubble" in result.stdout


def user_scheme(stages, microbatches, workers):
    """A test scheme: stages alternate between two workers, weights on worker 0, GPipe order."""
    from varlen_cli.schedule import breadth_first

    return Scheme(name="alternate", stages=stages, microbatches=microbatches, workers=2,
                  compute=lambda s, b, d: s % 2, store=lambda s: 0, priority=breadth_first(stages), flush=True)


def test_user_scheme_module_function(tmp_path):
    costs = [[3, 1, 4, 1, 5, 9]]
    plan = write_plan(tmp_path / "p.parquet", costs, 1)
    result = runner.invoke(app, ["simulate", plan, "--schedule", USER_MODULE + ":user_scheme", "--stages", "3",
                                 "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    scheme = user_scheme(3, 6, 1)
    expected, peak, fetches = brute_force(scheme, costs[0], costs[0], 2.0)
    assert out["steps"] == [max(e for _, _, e in expected.values())]
    assert out["peak_activation"] == peak.tolist() and out["weight_transfers"] == fetches.tolist()


def not_a_scheme(stages, microbatches, workers):
    return 42


def test_no_torch_import():
    code = ("import sys; from varlen_cli.cli import app; import varlen_cli.schedule, varlen_cli.cli.simulate; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})


def _not_parquet(tmp):
    (tmp / "x.parquet").write_bytes(b"PAR1 nope PAR1")
    return str(tmp / "x.parquet")


def _no_metadata(tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": [1]}), tmp / "y.parquet")
    return str(tmp / "y.parquet")


BAD = [
    ("missing plan", lambda t: str(t / "none.parquet"), [], 3, re.compile(r"plan file not found: .*none\.parquet")),
    ("directory", lambda t: str(t), [], 3, re.compile(r".* is a directory, not a plan file \(.*")),
    ("not parquet", _not_parquet, [], 3, re.compile(r".*x\.parquet is not a readable Parquet file: .*")),
    ("not a plan", _no_metadata, [], 3, re.compile(r".*y\.parquet is not a varlen plan: .*")),
    ("bad schedule", None, ["--schedule", "zigzag"], 2,
     "--schedule 'zigzag' is not one of ddp, fsdp, gpipe, 1f1b, lpp, fslpp, all, or MODULE:FUNCTION"),
    ("stages 0", None, ["--stages", "0"], 2, "--stages must be >= 1 (got 0)"),
    ("groups not dividing", None, ["--schedule", "gpipe", "--groups", "3"], 2,
     "--groups 3 does not divide the microbatches of a step (dp x grad_accum) (8)"),
    ("groups not dividing workers", None, ["--schedule", "lpp", "--groups", "2", "--workers", "3"], 2,
     "--groups 2 does not divide --workers 3"),
    ("workers not dividing", None, ["--schedule", "ddp", "--workers", "3"], 2,
     "--workers 3 does not divide the microbatches of a step (dp x grad_accum) (8)"),
    ("gpipe workers", None, ["--schedule", "gpipe", "--workers", "3"], 2,
     "--schedule gpipe runs on groups x stages = 4 workers, not --workers 3 (use --schedule lpp for fewer "
     "workers than stages)"),
    ("ddp groups", None, ["--schedule", "ddp", "--groups", "2"], 2,
     "--groups does not apply to --schedule ddp (use --workers)"),
    ("backward ratio", None, ["--backward-ratio", "0"], 2, "--backward-ratio must be > 0 (got 0.0)"),
    ("attention cost", None, ["--attention-cost", "-1"], 2, "--attention-cost must be >= 0 (got -1.0)"),
    ("gantt step", None, ["--gantt-step", "7"], 2, "--gantt-step 7 is not a step of the plan (0 .. 1)"),
    # sizes are checked before any work (both ran for hours)
    ("stages 100000", None, ["--stages", "100000"], 2,
     "--schedule ddp with --stages 100000 and 8 microbatches per step has 1,600,000 jobs per step; simulate takes "
     "at most 524,288 (fewer --stages, or a plan with fewer microbatches per step)"),
    ("20 million workers", None, ["--schedule", "lpp", "--groups", "2", "--workers", "20000000"], 2,
     "--schedule lpp with --stages 2 on 20,000,000 workers is too large to simulate (stages x workers at most "
     "16,777,216)"),
    ("no module", None, ["--schedule", "no_such_module_xyz:f"], 2,
     "--schedule no_such_module_xyz:f: cannot import module 'no_such_module_xyz': ModuleNotFoundError: "
     "No module named 'no_such_module_xyz'"),
    ("no function", None, ["--schedule", USER_MODULE + ":nothing"], 2,
     "--schedule " + USER_MODULE + ":nothing: module '" + USER_MODULE + "' has no function 'nothing'"),
    ("not a scheme", None, ["--schedule", USER_MODULE + ":not_a_scheme"], 2,
     "--schedule " + USER_MODULE + ":not_a_scheme: not_a_scheme() returned int, not a varlen_cli.schedule.Scheme"),
    ("wrong signature", None, ["--schedule", USER_MODULE + ":uniform"], 2,
     "--schedule " + USER_MODULE + ":uniform: uniform() must accept stages=, microbatches=, workers= keywords"),
]


@pytest.mark.parametrize("name,build,args,code,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line_error(tmp_path, name, build, args, code, message):
    plan = build(tmp_path) if build else write_plan(tmp_path / "ok.parquet", np.ones((2, 8)), 4, dp=2)
    argv = ["simulate", plan, *args]
    if "--stages" not in args:
        argv += ["--stages", "2"]
    assert_user_error(runner.invoke(app, argv), code, message)


def test_gantt_width_is_bounded(tmp_path):
    """--width 100000000 drew for minutes: refused by the option's range (exit 2, one line via main())."""
    plan = write_plan(tmp_path / "ok.parquet", np.ones((2, 8)), 4, dp=2)
    result = subprocess.run([sys.executable, "-m", "varlen_cli", "simulate", plan, "--stages", "2", "--gantt-step",
                             "0", "--width", "100000000"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["varlen: error: Invalid value for '--width': Input should be less than or "
                                          "equal to 4096 (see `python -m varlen_cli simulate --help`)"]


# -- schedule-aware plans (varlen plan --schedule) -----------------------------------------------------
def test_candidate_orders_are_permutations():
    from varlen_cli.schedule.order import candidate_orders

    cost = np.random.default_rng(1).integers(1, 100, (20, 12)).astype(float)
    for name, perm in candidate_orders(cost, 3, 4).items():
        assert np.array_equal(np.sort(perm, axis=1), np.broadcast_to(np.arange(12), (20, 12))), name
        moved = np.take_along_axis(cost, perm, axis=1).reshape(20, 3, 4)
        if name in ("ascending", "descending", "zigzag"):  # stays on its rank
            assert np.array_equal(np.sort(moved, axis=2), np.sort(cost.reshape(20, 3, 4), axis=2)), name
        if name == "descending":
            assert np.all(np.diff(moved, axis=2) <= 0)
        if name == "zigzag":
            assert np.all(moved[:, :, 0] == moved.max(axis=2)) and np.all(moved[:, :, 1] == moved.min(axis=2))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "ddp"])
def test_schedule_aware_plan(tmp_path, schedule):
    import pyarrow.parquet as pq

    from tests.plan_helpers import write_metrics
    from varlen_cli.plan import PlanConfig, plan
    from varlen_cli.validate import ValidateConfig, validate

    metrics = write_metrics(tmp_path / "m", np.random.default_rng(5).integers(5, 900, 800))
    common = {"input": metrics, "max_tokens": 4096, "dp": 2, "grad_accum": 4, "order": "random"}
    base = str(tmp_path / "base.parquet")
    plan(PlanConfig(output=base, **common))
    ordered = str(tmp_path / "ordered.parquet")
    result = plan(PlanConfig(output=ordered, schedule=schedule, stages=3, **common))
    assert validate(ValidateConfig(plan=ordered, metrics=metrics)).ok
    a, b = pq.read_table(base).to_pylist(), pq.read_table(ordered).to_pylist()
    for step in range(result.num_steps):  # same microbatches in every step, maybe moved between slots
        same = sorted(tuple(r["sample_ids"]) for r in a if r["step"] == step)
        assert same == sorted(tuple(r["sample_ids"]) for r in b if r["step"] == step)
    report = result.metadata["schedule"]
    before, after = run(base, schedule, 3), run(ordered, schedule, 3)
    assert report["makespan_plan_order"] == pytest.approx(before.makespan)
    assert report["makespan"] == pytest.approx(after.makespan) and after.makespan <= before.makespan
    assert np.all(after.steps <= before.steps)
    assert sum(report["steps_by_order"].values()) == result.num_steps


@pytest.mark.parametrize("args,message", [
    (["--stages", "2"], "--stages needs --schedule (the parallel schedule to order the steps for)"),
    (["--schedule", "1f1b"], "--schedule needs --stages K (the pipeline stages the schedule runs)"),
    (["--schedule", "all", "--stages", "2"],
     "--schedule must be one of ddp, fsdp, gpipe, 1f1b, lpp, fslpp (got 'all')"),
    (["--schedule", "gpipe", "--stages", "0"], "--stages must be >= 1 (got 0)"),
])
def test_plan_schedule_errors(tmp_path, args, message):
    from tests.plan_helpers import write_metrics

    metrics = write_metrics(tmp_path / "m", [10, 20, 30, 40])
    result = runner.invoke(app, ["plan", metrics, "-o", str(tmp_path / "p.parquet"), "--max-tokens", "64", *args])
    assert_user_error(result, 2, message)
    assert not os.path.exists(tmp_path / "p.parquet")
