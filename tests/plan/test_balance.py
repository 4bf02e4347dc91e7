"""Compute-balanced packed plans (issue 17): the attention-aware cost, the row deal, ``auto``, and the
straggler that the summary, ``inspect`` and ``validate`` report in the plan's own cost model."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.plan_helpers import check_plan, write_metrics
from varlen_cli.budget import Budget
from varlen_cli.cli import app
from varlen_cli.errors import UsageError
from varlen_cli.inspect import InspectConfig, inspect_artifact, tables
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.plan.balance import balance_rows, deal_rows
from varlen_cli.plan.batching import packed_microbatches
from varlen_cli.plan.cost_model import flops_attention_cost
from varlen_cli.validate import ValidateConfig, validate

A = 1 / (2 * 12_800)


def long_mix(n_short: int, n_long: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """Many short samples and a tail of long documents up to 4x the row length."""
    rng = np.random.default_rng(seed)
    short = np.maximum(1, rng.lognormal(3.0, 1.0, n_short)).astype(np.int64)
    long = rng.integers(seq_len // 4, 4 * seq_len, n_long)
    x = np.concatenate([short, long])
    return x[rng.permutation(len(x))]


def row_costs_from_file(path: str, attention: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per microbatch (plan order): step, rank and tokens + A sum(l^2), recomputed row by row in Python."""
    t = pq.read_table(path, columns=["step", "rank", "sample_lengths", "sample_rows"]).to_pydict()
    cost = []
    for lens, rows in zip(t["sample_lengths"], t["sample_rows"]):
        per_row: dict = {}
        for length, row in zip(lens, rows):
            per_row.setdefault(row, 0.0)
            per_row[row] += length + attention * length * length
        cost.append(sum(per_row.values()))
    return np.array(t["step"]), np.array(t["rank"]), np.array(cost)


def straggler_by_hand(step, rank, cost, dp):
    ratios, maxes, means = [], 0.0, 0.0
    for s in range(int(step.max()) + 1):
        loads = [cost[(step == s) & (rank == r)].sum() for r in range(dp)]
        ratios.append(max(loads) / (sum(loads) / dp))
        maxes += max(loads)
        means += sum(loads) / dp
    return float(np.mean(ratios)), float(np.max(ratios)), maxes / means - 1


def check_exactly_once(d, lengths, max_per_row=None):
    """Every sample's tokens exactly once per epoch (chunks tile [0, length)); rows within the cap."""
    for epoch in set(d["epoch"]):
        got: dict = {}
        for e, ids, starts, lens, rows in zip(d["epoch"], d["sample_ids"], d["sample_starts"], d["sample_lengths"],
                                              d["sample_rows"]):
            if e != epoch:
                continue
            for i, s, n in zip(ids, starts, lens):
                got.setdefault(i, []).append((s, n))
            if max_per_row:
                assert np.bincount(rows).max() <= max_per_row
        assert sorted(got) == list(range(len(lengths)))
        for i, chunks in got.items():
            pos = 0
            for s, n in sorted(chunks):
                assert s == pos
                pos += n
            assert pos == lengths[i]


@st.composite
def balance_case(draw):
    seq_len = draw(st.sampled_from([16, 32, 64]))
    n = draw(st.integers(8, 120))
    lengths = draw(st.lists(st.integers(0, 3 * seq_len), min_size=n, max_size=n))
    return {"seq_len": seq_len, "lengths": lengths, "dp": draw(st.integers(1, 4)),
            "grad_accum": draw(st.integers(1, 3)), "rows": draw(st.sampled_from([None, 1, 2, 3])),
            "max_per_row": draw(st.sampled_from([None, 2, 5])), "epochs": draw(st.integers(1, 2)),
            "order": draw(st.sampled_from(["bucket-shuffle", "curriculum"])),
            "attention": draw(st.sampled_from([A, 0.01, 1.0])), "warmup": draw(st.booleans())}


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(balance_case())
def test_balance_keeps_exactly_once_cap_and_row_length(tmp_path_factory, case):
    """Property: a compute-balanced plan holds every sample's tokens exactly once per epoch, no row
    over the cap or the row length, no microbatch over R rows; validate (incl. the straggler) passes."""
    root = tmp_path_factory.mktemp("bal")
    lengths = np.array(case["lengths"], dtype=np.int64)
    sorted_by = "length" if case["order"] == "curriculum" else None
    metrics = write_metrics(str(root / "m"), lengths, sorted_by=sorted_by)
    out = str(root / "p.parquet")
    cfg = PlanConfig(input=metrics, output=out, packing=True, seq_len=case["seq_len"], split_long=True,
                     dp=case["dp"], grad_accum=case["grad_accum"], rows_per_microbatch=case["rows"],
                     max_per_row=case["max_per_row"], epochs=case["epochs"], order=case["order"], tail="drop",
                     attention_cost=case["attention"], compile_warmup=case["warmup"])
    try:
        plan(cfg)
    except Exception as exc:  # too few samples for the slots: a user error, not a balance problem
        assert "cannot fill" in str(exc) or "fewer than" in str(exc), exc
        event("too few samples for the slots")
        return
    event("planned")
    d, md = check_plan(out, lengths, dp=case["dp"], grad_accum=case["grad_accum"], packed=True,
                       seq_len=case["seq_len"])
    if not md["dropped"]["count"]:
        check_exactly_once(d, lengths, case["max_per_row"])
    assert md["budget"]["cost"] == "packed" and md["budget"]["attention_cost"] == case["attention"]
    assert "straggler_cost" not in md and "cost_model" not in md  # the budget is stored once
    res = validate(ValidateConfig(out, metrics))
    assert res.ok, [c.detail for c in res.violations]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 4), st.data())
def test_balance_rows_moves_whole_rows(slots_dp, grad_accum, rows_per_mb, data):
    """Property on the library: rows change microbatch, never content; every microbatch keeps 1..R rows."""
    steps = data.draw(st.integers(1, 5))
    count = steps * slots_dp * grad_accum
    num_rows = data.draw(st.integers(count, count * rows_per_mb))
    items_per_row = data.draw(st.lists(st.integers(1, 4), min_size=num_rows, max_size=num_rows))
    item_row = np.repeat(np.arange(num_rows), items_per_row)
    length = np.array(data.draw(st.lists(st.integers(0, 50), min_size=len(item_row), max_size=len(item_row))))
    samples = np.arange(len(item_row), dtype=np.int64)
    mb = packed_microbatches(samples, np.zeros(len(samples), np.int64), length, item_row, num_rows, 200,
                             rows_per_mb, count)
    out = balance_rows(mb, Budget(None, None, 0.01, packed=True), slots_dp, grad_accum,
                       keep_order=data.draw(st.booleans()), rng=np.random.default_rng(0))
    assert out.count == count
    parent = np.repeat(np.arange(count), np.diff(out.offsets))
    rows_of = {}
    for k in range(count):
        local = out.item_row[parent == k]
        assert len(local) and local.min() == 0 and local.max() < rows_per_mb
        assert (np.diff(local) >= 0).all()
        for r in np.unique(local):
            rows_of[tuple(out.samples[(parent == k) & (out.item_row == r)])] = True
    want = {tuple(samples[item_row == r]) for r in range(num_rows)}
    assert set(rows_of) == want and len(rows_of) == num_rows
    assert (out.tokens == np.bincount(parent, weights=out.item_length, minlength=count)).all()


def test_deal_rows_counts_and_loads():
    cost = np.random.default_rng(1).random(103) * 10
    bin_of, load = deal_rows(cost, 10)
    counts = np.bincount(bin_of, minlength=10)
    assert set(counts.tolist()) == {10, 11} and counts.sum() == 103
    assert np.allclose(load, np.bincount(bin_of, weights=cost, minlength=10))
    assert load.max() / load.mean() < 1.02


@pytest.mark.parametrize("grad_accum,order", [(1, "bucket-shuffle"), (4, "bucket-shuffle"), (4, "curriculum")])
def test_balanced_plan_beats_token_balance_in_attention_cost(tmp_path, grad_accum, order):
    """Long documents among many short samples: the token-balanced plan straggles in the attention-aware
    cost; the compute-balanced one does not, with the same rows (same efficiency)."""
    seq_len, dp = 1024, 8
    lengths = long_mix(40_000, 300, seq_len)
    metrics = write_metrics(str(tmp_path / "m"), lengths, sorted_by="length" if order == "curriculum" else None)
    got = {}
    for a in (0.0, 1 / 800):
        out = str(tmp_path / f"p{a}.parquet")
        res = plan(PlanConfig(input=metrics, output=out, packing=True, seq_len=seq_len, split_long=True, dp=dp,
                              grad_accum=grad_accum, attention_cost=a, order=order))
        step, rank, cost = row_costs_from_file(out, 1 / 800)
        got[a] = (straggler_by_hand(step, rank, cost, dp), res)
    (_, _, before), _ = got[0.0]
    (mean, worst, after), res = got[1 / 800]
    assert before > 0.05 and after < 0.01, (before, after)
    assert got[0.0][1].packing["efficiency"] == res.packing["efficiency"]
    # the summary is in the plan's own cost model, and equals the by-hand recomputation
    assert res.stats["straggler_mean"] == pytest.approx(mean, rel=1e-9)
    assert res.stats["straggler_max"] == pytest.approx(worst, rel=1e-9)
    assert res.stats["straggler_overhead"] == pytest.approx(after, rel=1e-6, abs=1e-12)
    series = inspect_artifact(InspectConfig(res.output))["series"]
    assert series["straggler_cost"] == {"kind": "packed", "attention_cost": 1 / 800}
    assert series["straggler_mean"] == pytest.approx(mean, rel=1e-9)
    assert series["straggler_overhead"] == pytest.approx(after, rel=1e-6, abs=1e-12)


def test_inspect_chart_and_validate_straggler(tmp_path):
    lengths = long_mix(4_000, 40, 512)
    metrics = write_metrics(str(tmp_path / "m"), lengths)
    out = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=metrics, output=out, packing=True, seq_len=512, split_long=True, dp=4,
                    attention_cost=0.001))
    info = inspect_artifact(InspectConfig(out))
    loads = np.array(info["series"]["rank_cost_first_steps"])
    assert loads.shape[1] == 4 and 1 <= len(loads) <= 48
    step, rank, cost = row_costs_from_file(out, 0.001)
    assert np.allclose(loads[0], [cost[(step == 0) & (rank == r)].sum() for r in range(4)])
    chart = [t for t in tables(info) if t.title.startswith("per-rank cost")]
    assert len(chart) == 1 and [r[0] for r in chart[0].rows] == ["0", "1", "2", "3", "busiest"]
    assert all(len(r[1]) == len(loads) for r in chart[0].rows)
    res = CliRunner().invoke(app, ["inspect", out], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "busiest" in res.output and "tokens + A sum(l^2)" in res.output
    check = [c for c in validate(ValidateConfig(out)).checks if c.name == "straggler"][0]
    assert check.ok and "kind=packed" in check.detail
    # a plan whose recorded statistics disagree with its rows fails the check
    table = pq.read_table(out)
    meta = json.loads(table.schema.metadata[b"varlen"])
    meta["stats"]["straggler_max"] += 0.5
    bad = str(tmp_path / "bad.parquet")
    pq.write_table(table.replace_schema_metadata({b"varlen": json.dumps(meta).encode()}), bad)
    check = [c for c in validate(ValidateConfig(bad)).checks if c.name == "straggler"][0]
    assert not check.ok and "straggler_max" in check.detail


def test_auto_attention_cost_from_model_shape(tmp_path):
    d, layers = 4096, 32
    assert flops_attention_cost(d, layers) == pytest.approx(1 / (12 * d))
    # with the LM head: A = 2 d L / (24 d^2 L + 2 d V)
    assert flops_attention_cost(d, layers, 32_000) == pytest.approx(2 * d * layers / (24 * d * d * layers
                                                                                      + 2 * d * 32_000))
    metrics = write_metrics(str(tmp_path / "m"), long_mix(2_000, 20, 256))
    out = str(tmp_path / "p.parquet")
    res = CliRunner().invoke(app, ["plan", metrics, "-o", out, "--packing", "--seq-len", "256", "--split-long",
                                   "--dp", "2", "--attention-cost", "auto", "--model-dim", "64", "--layers", "2"])
    assert res.exit_code == 0, res.output
    meta = json.loads(pq.read_schema(out).metadata[b"varlen"])
    want = 1 / (12 * 64)
    assert meta["budget"]["attention_cost"] == pytest.approx(want)
    assert meta["budget"]["cost"] == "packed" and meta["budget"]["source"] == "flops"
    assert meta["budget"]["model"] == {"model_dim": 64, "layers": 2, "vocab_size": 0,
                                       "formula": "A = 2 d L / (24 d^2 L + 2 d V)"}
    assert meta["config"]["attention_cost"] == "auto"
    res = validate(ValidateConfig(out, metrics))  # split samples: coverage needs the lengths
    assert res.ok, [c.detail for c in res.violations]


@pytest.mark.parametrize("args,message", [
    (["--attention-cost", "lots"], "--attention-cost must be a number >= 0 or 'auto' (got 'lots')"),
    (["--attention-cost", "-1"], "--attention-cost must be >= 0 (got -1.0)"),
    (["--attention-cost", "auto"], "--attention-cost auto needs --model-dim and --layers (the model's shape)"),
    (["--attention-cost", "auto", "--model-dim", "64"],
     "--attention-cost auto needs --model-dim and --layers (the model's shape)"),
    (["--model-dim", "64", "--layers", "2"], "--model-dim, --layers and --vocab-size need --attention-cost auto"),
    (["--attention-cost", "auto", "--model-dim", "0", "--layers", "2"], "--model-dim must be >= 1 (got 0)"),
    (["--attention-cost", "auto", "--model-dim", "8", "--layers", "2", "--vocab-size", "-3"],
     "--vocab-size must be >= 0 (got -3)"),
])
def test_bad_cost_options(tmp_path, args, message):
    metrics = write_metrics(str(tmp_path / "m"), [10, 20, 30, 40])
    res = CliRunner().invoke(app, ["plan", metrics, "-o", str(tmp_path / "p.parquet"), "--packing", "--seq-len",
                                   "64"] + args)
    assert_user_error(res, 2, message)


def test_library_rejects_auto_without_shape(tmp_path):
    metrics = write_metrics(str(tmp_path / "m"), [10, 20])
    with pytest.raises(UsageError, match="needs --model-dim and --layers"):
        plan(PlanConfig(input=metrics, output=str(tmp_path / "p.parquet"), packing=True, seq_len=64,
                        attention_cost="auto"))


def _excess(load, dp):
    groups = load.reshape(-1, dp)
    return float(((groups.max(axis=1) - groups.mean(axis=1)) / groups.mean(axis=1)).sum())


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 3), st.integers(2, 4), st.data())
def test_cut_steps_is_the_best_last_step(dp, steps, data):
    """Brute force over every set of dp rank-steps for the last step: no choice gives the other steps
    (consecutive groups of the rest, sorted) a smaller sum of (max - mean) / mean."""
    from itertools import combinations

    from varlen_cli.plan.balance import cut_steps

    n = dp * steps
    load = np.sort(np.array(data.draw(st.lists(st.sampled_from([1.0, 1.1, 3.0, 3.05, 5.0]), min_size=n,
                                               max_size=n))))[::-1].copy()
    step = cut_steps(load, dp)
    assert np.bincount(step).tolist() == [dp] * steps
    assert (step[step < steps - 1] == np.sort(step[step < steps - 1])).all()
    got = _excess(load[step < steps - 1], dp)
    best = min(_excess(np.delete(load, list(aside)), dp) for aside in combinations(range(n), dp))
    assert got <= best + 1e-9
