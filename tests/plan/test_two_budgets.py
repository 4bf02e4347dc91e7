"""Two budgets (``varlen plan --max-target-tokens``, issue 36): every microbatch's padded source B x T and
padded target B x T_target within their budgets, the plan's ``target_seqlen`` and ``target_tokens`` columns,
``varlen validate`` checking both, the cost over both sides, the options that refuse in one line, the same plan
for 1 and 2 workers (a plan, a mixture, a replan, an extension), and the issue's Lhotse manifest end to end."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.plan_helpers import write_metrics
from varlen_cli.budget import Budget, seq2seq_cost
from varlen_cli.cli import app
from varlen_cli.errors import InputError
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.validate import ValidateConfig, validate

runner = CliRunner()
M, MT = 2000, 1200  # the budgets of most plans here: source, target


def _pairs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 300, n), rng.integers(0, 220, n)


def _pad(x, m: int) -> np.ndarray:
    x = np.maximum(np.asarray(x, np.int64), 1)
    return -(-x // m) * m


def _checked(path: str, src: np.ndarray, tgt: np.ndarray, m: int = M, mt: int = MT, a: float = 0.0,
             pad: int = 1) -> tuple[pa.Table, dict]:
    """The plan's rows, each checked against the budgets from the data: B x T (+ A B T^2) <= m and B x T_target
    (+ A B T_target^2) <= mt, T and T_target at least the longest (padded) source and target of its samples."""
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"varlen"])
    b, t, u = (table.column(c).to_numpy().astype(np.float64) for c in ("batch_size", "seqlen", "target_seqlen"))
    assert table.schema.field("target_seqlen").type == pa.int32()
    assert (b * t + a * b * t * t <= m).all() and (b * u + a * b * u * u <= mt).all()
    for ids, seqlen, target_seqlen in zip(table.column("sample_ids").to_pylist(), t, u):
        assert _pad(src[ids], pad).max() <= seqlen and _pad(tgt[ids], pad).max() <= target_seqlen
    _target_tokens(table, tgt)
    return table, meta


def _target_tokens(table: pa.Table, tgt: np.ndarray) -> None:
    """The plan's ``target_tokens`` (int64): each microbatch's targets' ``target_length`` summed; a step's sum is
    its ``step_loss_tokens``."""
    assert table.schema.field("target_tokens").type == pa.int64()
    got = table.column("target_tokens").to_numpy()
    want = [int(tgt[ids].sum()) for ids in table.column("sample_ids").to_pylist()]
    assert got.tolist() == want
    step, loss = table.column("step").to_numpy(), table.column("step_loss_tokens").to_numpy()
    for s in np.unique(step):
        assert int(got[step == s].sum()) == int(loss[step == s][0])


def _once(table: pa.Table, n: int, epoch: int = 0, dropped=()) -> None:
    """Every sample exactly once in ``epoch``, but the ``dropped`` ones."""
    ids, epochs = table.column("sample_ids").to_pylist(), table.column("epoch").to_pylist()
    got = sorted(i for row, ep in zip(ids, epochs) if ep == epoch for i in row)
    assert got == sorted(set(range(n)) - set(dropped))


# -- the budget ---------------------------------------------------------------------------------------------
def test_the_budget_bounds_both_sides_and_records_the_second_only_when_given():
    budget = Budget(1000, 12, 0.001, max_target_tokens=600)
    t, u = np.arange(1, 400), np.arange(399, 0, -1)
    cap = budget.cap(t, u)
    cost = lambda b, x: b * x + 0.001 * b * x * x  # noqa: E731
    assert (cost(cap, t) <= 1000).all() and (cost(cap, u) <= 600).all() and (cap <= 12).all()
    full = (cost(cap + 1, t) > 1000) | (cost(cap + 1, u) > 600) | (cap == 12)  # one more sample would not fit
    assert full.all() and (budget.fits(cap, t, u)).all() and not budget.fits(cap + 1, t, u)[~(cap == 12)].any()
    assert seq2seq_cost(3, 10, 20, 0.5) == 3 * 30 + 0.5 * 3 * (100 + 400 + 200)
    assert budget.microbatch_cost(None, np.array([3]), np.array([10]), target_seqlen=np.array([20])) == 3 * 30 + \
        0.001 * 3 * 700
    assert Budget.from_metadata({"budget": budget.to_metadata()}) == budget
    assert "max_target_tokens" not in Budget(1000).to_metadata()  # one-budget plans: the entry they always had
    assert budget.describe() == "--max-tokens 1,000 and --max-target-tokens 600"


# -- which options apply -------------------------------------------------------------------------------------
BASE = ["--max-tokens", str(M), "--max-target-tokens", str(MT), "--dp", "2"]
OPTIONS = [  # (options beside BASE, None: plans and validates / (exit code, message))
    (["--order", "curriculum"], None),
    (["--order", "reverse", "--curriculum-epochs", "1", "--epochs", "2"], None),
    (["--order", "random", "--tail", "drop", "--grad-accum", "3"], None),
    (["--pad-multiple", "8", "--num-shapes", "3"], None),
    (["--attention-cost", "auto", "--model-dim", "64", "--layers", "2"], None),
    (["--max-samples", "4", "--lr-scale-by", "tokens", "--lr-scaling", "sqrt"], None),
    (["--schedule", "1f1b", "--stages", "2", "--grad-accum", "2"], None),
    (["--chunk-samples", "40", "--nproc", "1"], None),
    (["--packing", "--seq-len", "512"],
     (2, "--max-target-tokens does not apply with --packing: a packed row has no target side; plan padded "
         "microbatches")),
    (["--static-shapes", "--num-shapes", "3"],
     (2, "--max-target-tokens does not apply with --static-shapes: a shape would be (B, T, T_target); "
         "--num-shapes and --pad-multiple apply to both sides")),
    (["--compile-warmup"],
     (2, "--max-target-tokens does not apply with --compile-warmup: its warm-up covers the (B, T) shapes only")),
    (["--same-shape-per-step"],
     (2, "--max-target-tokens does not apply with --same-shape-per-step: a step would need one T_target too")),
    (["--max-target-tokens", "0"], (2, "--max-target-tokens must be >= 1 (got 0)")),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    src, tgt = _pairs(150, 1)
    src[:3], tgt[3:5] = [2500, 0, 9], [1700, 0]  # too long a source, too long a target (--drop-long), empty ones
    return {"root": root, "src": src, "tgt": tgt, "metrics": write_metrics(root / "m", src, targets=tgt),
            "sorted": write_metrics(root / "s", src, targets=tgt, sorted_by="length"),
            "plain": write_metrics(root / "plain", src)}


@pytest.mark.parametrize("extra,expected", OPTIONS, ids=[" ".join(o) for o, _ in OPTIONS])
def test_each_option_plans_under_both_budgets_or_refuses_in_one_line(corpus, tmp_path, extra, expected):
    curricular = "curriculum" in extra or "reverse" in extra
    out = str(tmp_path / "plan.parquet")
    args = ["plan", corpus["sorted" if curricular else "metrics"], "-o", out, *BASE, "--drop-long", "--no-progress",
            *extra]
    result = runner.invoke(app, args)
    if expected is not None:
        assert_user_error(result, *expected)
        assert not os.path.exists(out)
        return
    assert result.exit_code == 0, result.output
    a = 0.0
    if "auto" in extra:  # the FLOPs A of d = 64, L = 2
        a = 2 * 64 * 2 / (24 * 64 * 64 * 2)
    table, meta = _checked(out, corpus["src"], corpus["tgt"], a=a, pad=8 if "--pad-multiple" in extra else 1)
    assert meta["budget"]["max_target_tokens"] == MT and meta["config"]["max_target_tokens"] == MT
    dropped = meta["dropped"]["too_long_ids"]
    assert sorted(dropped) == [0, 3]  # too long a source, too long a target
    for e in range(meta["epochs"]):
        _once(table, 150, e, dropped + [i for t in meta["dropped"]["tail"] if t["epoch"] == e for i in t["sample_ids"]])
    if "--num-shapes" in extra:
        assert len(set(table.column("target_seqlen").to_pylist())) <= 3
    report = validate(ValidateConfig(plan=out, metrics=corpus["sorted" if curricular else "metrics"]))
    assert report.ok, report.violations


def test_inputs_and_continuations_that_do_not_apply_refuse_in_one_line(corpus, tmp_path):
    out = str(tmp_path / "p.parquet")
    assert_user_error(runner.invoke(app, ["plan", corpus["plain"], "-o", out, *BASE, "--no-progress"]), 3,
                      f"--max-target-tokens bounds the target side, but {corpus['plain']} has no target_length column: "
                      "run `varlen analyze ... --target-length KIND:PATH` (docs/plan.md, \"Two budgets\")")
    mix = f"a={corpus['metrics']}:1,b={corpus['plain']}:0.5"
    assert_user_error(runner.invoke(app, ["plan", "--mix", mix, "-o", out, *BASE, "--drop-long", "--no-progress"]),
                      3, f"--max-target-tokens bounds the target side, but source 'b' ({corpus['plain']}) has no "
                         "target_length column: run `varlen analyze ... --target-length KIND:PATH` (docs/plan.md, "
                         "\"Two budgets\")")
    assert_user_error(runner.invoke(app, ["plan", corpus["metrics"], "-o", out, *BASE, "--no-progress"]), 3,
                      "the budgets --max-tokens 2,000 and --max-target-tokens 1,200 fit 2 of the 150 samples (the "
                      "longest has 2,500 tokens, the longest target 1,700); raise --max-tokens or --max-target-tokens "
                      "or pass --drop-long")
    assert runner.invoke(app, ["plan", corpus["metrics"], "-o", out, *BASE, "--drop-long", "--no-progress"]) \
        .exit_code == 0
    assert_user_error(runner.invoke(app, ["calibrate", "--verify", out, "--model", "tests.memory_models:ballast"]), 2,
                      f"--verify does not apply to {out}: it has two budgets (--max-target-tokens), and a memory "
                      "profile's model runs one sequence of B x T")
    assert_user_error(runner.invoke(app, ["replan", out, "--from-step", "1", "--dp", "1", "-o", str(tmp_path / "r"),
                                          "--max-memory", "1GiB", "--memory-profile", str(tmp_path / "x.json")]),
                      2, "--max-memory does not apply to a plan with --max-target-tokens (a memory profile is measured "
                         "on one sequence); give --max-tokens")


# -- the property ---------------------------------------------------------------------------------------------
@settings(max_examples=int(os.environ.get("TWO_BUDGET_EXAMPLES", "30")), deadline=None, derandomize=True)
@given(pairs=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 300)), min_size=1, max_size=90),
       order=st.sampled_from(["curriculum", "reverse", "bucket-shuffle", "random"]),
       pad=st.sampled_from([1, 8]), shapes=st.sampled_from([None, 3]), attention=st.sampled_from([0.0, 0.002]),
       layout=st.sampled_from([(1, 1), (2, 1), (2, 2)]), chunk=st.sampled_from([1 << 23, 17]), seed=st.integers(0, 3))
def test_no_microbatch_exceeds_either_budget_and_every_pair_is_planned_once(tmp_path_factory, pairs, order, pad,
                                                                               shapes, attention, layout, chunk, seed):
    src, tgt = (np.array(x, np.int64) for x in zip(*pairs))
    m, mt = 1500, 900
    root = tmp_path_factory.mktemp("prop")
    metrics = write_metrics(root / "m", src, targets=tgt, sorted_by="length" if order in ("curriculum", "reverse")
                            else None)
    fits = lambda x, budget: x + attention * x * x <= budget  # noqa: E731 - one sample alone
    long_ids = np.flatnonzero(~fits(_pad(src, pad), m) | ~fits(_pad(tgt, pad), mt))
    out = str(root / "plan.parquet")
    try:
        res = plan(PlanConfig(input=metrics, output=out, max_tokens=m, max_target_tokens=mt, order=order,
                              pad_multiple=pad, num_shapes=shapes, attention_cost=attention, dp=layout[0],
                              grad_accum=layout[1], chunk_samples=chunk, seed=seed, epochs=2, drop_long=True,
                              tail="drop", progress=False))
    except InputError as exc:  # only the one-line refusals: too few samples for a step, none that fits
        assert "microbatches of one step" in exc.message or "fit none of the" in exc.message, exc.message
        event("refused")
        return
    event("planned")
    table, meta = _checked(out, src, tgt, m, mt, attention, pad)
    assert sorted(meta["dropped"]["too_long_ids"]) == long_ids.tolist()
    assert res.stats["over_budget_microbatches"] == 0
    for e in range(2):
        tail = [i for t in meta["dropped"]["tail"] if t["epoch"] == e for i in t["sample_ids"]]
        _once(table, len(src), e, list(long_ids) + tail)
    report = validate(ValidateConfig(plan=out, metrics=metrics))
    assert report.ok, report.violations


# -- validate -------------------------------------------------------------------------------------------------
def test_validate_checks_both_budgets_and_the_targets_against_target_seqlen(corpus, tmp_path):
    out = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=corpus["metrics"], output=out, max_tokens=M, max_target_tokens=MT, dp=2, drop_long=True,
                    progress=False))
    table = pq.read_table(out)
    u = table.column("target_seqlen").to_numpy().copy()
    b = table.column("batch_size").to_numpy()
    low, high = u.copy(), u.copy()
    low[0] = 0  # its targets do not fit
    high[1] = MT // b[1] + 1  # over the target budget
    for values, message in ((low, "budget: 1 microbatches have a sample whose target is longer than their "
                                  "target_seqlen; 1 microbatches whose target_tokens is not within 0..batch_size x "
                                  "target_seqlen"),
                            (high, "budget: 1 microbatches over the budget --max-tokens 2,000 and --max-target-tokens "
                                   "1,200 (e.g. rows 1)")):
        bad = str(tmp_path / "bad.parquet")
        i = table.schema.get_field_index("target_seqlen")
        pq.write_table(table.set_column(i, "target_seqlen", pa.array(values, pa.int32())), bad)
        report = validate(ValidateConfig(plan=bad, metrics=corpus["metrics"]))
        got = [f"{c.name}: {c.detail}" for c in report.violations]
        assert message in got and all(v.startswith(("budget", "straggler")) for v in got), got
    pq.write_table(table.drop_columns(["target_seqlen"]), bad)
    report = validate(ValidateConfig(plan=bad))
    assert [f"{c.name}: {c.detail}" for c in report.violations] == ["columns: lacks plan columns: target_seqlen"]


def test_target_tokens_is_checked_and_a_plan_without_it_is_refused(corpus, tmp_path):
    out = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=corpus["metrics"], output=out, max_tokens=M, max_target_tokens=MT, dp=2, drop_long=True,
                    progress=False))
    table = pq.read_table(out)
    tokens = table.column("target_tokens").to_numpy()
    b, u = table.column("batch_size").to_numpy(), table.column("target_seqlen").to_numpy()
    one_more, over = tokens.copy(), tokens.copy()
    one_more[0] += 1  # a target token the samples do not have
    over[1] = int(b[1]) * int(u[1]) + 1  # more than B x T_target holds
    bad = str(tmp_path / "bad.parquet")
    i = table.schema.get_field_index("target_tokens")
    for values, metrics, want in (
            (one_more, None, ["budget: 1 steps whose target_tokens do not sum to their step_loss_tokens"]),
            (one_more, corpus["metrics"], ["budget: 1 microbatches whose target_tokens differs from the sum of their "
                                           "samples' target_length; 1 steps whose target_tokens do not sum to their "
                                           "step_loss_tokens"]),
            (over, None, ["budget: 1 microbatches whose target_tokens is not within 0..batch_size x target_seqlen; "
                          "1 steps whose target_tokens do not sum to their step_loss_tokens"])):
        pq.write_table(table.set_column(i, "target_tokens", pa.array(values, pa.int64())), bad)  # metadata kept
        report = validate(ValidateConfig(plan=bad, metrics=metrics))
        assert [f"{c.name}: {c.detail}" for c in report.violations] == want
        assert runner.invoke(app, ["validate", bad]).exit_code != 0
    pq.write_table(table.drop_columns(["target_tokens"]), bad)
    report = validate(ValidateConfig(plan=bad))
    assert [f"{c.name}: {c.detail}" for c in report.violations] == ["columns: lacks plan columns: target_tokens"]


def test_target_tokens_of_a_plan_a_replan_and_an_extension_and_none_in_one_budget_plans(corpus, tmp_path):
    from varlen_cli.plan.replan import ExtendConfig, ReplanConfig, extend, replan

    src, tgt = corpus["src"], corpus["tgt"]
    o = {k: str(tmp_path / f"{k}.parquet") for k in ("plan", "replan", "extend", "one", "one_extend")}
    plan(PlanConfig(input=corpus["metrics"], output=o["plan"], max_tokens=M, max_target_tokens=MT, dp=2, epochs=2,
                    drop_long=True, progress=False))
    replan(ReplanConfig(plan=o["plan"], output=o["replan"], dp=3, from_step=2, progress=False))
    extend(ExtendConfig(plan=o["plan"], output=o["extend"], epochs=3, progress=False))
    for key in ("plan", "replan", "extend"):
        _checked(o[key], src, tgt)  # target_tokens: the samples' target_length summed, per microbatch and step
        assert validate(ValidateConfig(plan=o[key], metrics=corpus["metrics"])).ok
    plan(PlanConfig(input=corpus["metrics"], output=o["one"], max_tokens=3000, dp=2, progress=False))
    extend(ExtendConfig(plan=o["one"], output=o["one_extend"], epochs=2, progress=False))
    for key in ("one", "one_extend"):
        names = pq.read_schema(o[key]).names
        assert "target_seqlen" not in names and "target_tokens" not in names


def test_simulate_and_inspect_use_the_cost_over_both_sides(corpus, tmp_path):
    from varlen_cli.inspect import InspectConfig, inspect_artifact
    from varlen_cli.schedule.simulate import read_plan_costs

    out = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=corpus["metrics"], output=out, max_tokens=M, max_target_tokens=MT, dp=2,
                    attention_cost=0.001, drop_long=True, progress=False))
    table = pq.read_table(out)
    b, t, u = (table.column(c).to_numpy().astype(np.float64) for c in ("batch_size", "seqlen", "target_seqlen"))
    want = b * (t + u) + 0.001 * b * (t * t + u * u + t * u)
    costs = read_plan_costs(out)
    assert np.allclose(costs.cost.reshape(-1), want, rtol=1e-12)
    assert costs.cost_model["kind"] == "seq2seq"
    load = want.reshape(-1, 2)
    strag = load.max(axis=1) / load.mean(axis=1)
    series = inspect_artifact(InspectConfig(path=out))["series"]
    assert series["straggler_mean"] == pytest.approx(strag.mean()) and series["straggler_cost"]["kind"] == "seq2seq"


# -- workers and continuations --------------------------------------------------------------------------------
@pytest.fixture
def forked_small(monkeypatch):
    """Workers forked (cheap), small row groups, segments and layout blocks: several of each in a small plan."""
    from varlen_cli.plan import writer
    from varlen_cli.plan.chunked import epoch, segments
    from varlen_cli.runtime import dist

    monkeypatch.setenv("VARLEN_START_METHOD", "fork")
    monkeypatch.setattr(dist, "available_cores", lambda: 8)
    monkeypatch.setattr(writer, "ROW_GROUP_TARGET", 8)
    monkeypatch.setattr(segments, "SEGMENT_GROUPS", 3)
    monkeypatch.setattr(epoch, "BLOCK_ROWS", 16)
    monkeypatch.setattr(epoch, "WINDOW_STEPS", 2)


def _same(a: str, b: str) -> None:
    """The same rows and metadata (but the parent's path a continuation records)."""
    ta, tb = pq.read_table(a), pq.read_table(b)
    assert ta.equals(tb)
    ma, mb = (json.loads(t.schema.metadata[b"varlen"]) for t in (ta, tb))
    for m in (ma, mb):
        (m.get("lineage") or {}).pop("parent_path", None)
    assert ma == mb


@pytest.mark.slow
def test_plan_mixture_replan_and_extend_are_the_same_for_1_and_2_workers(tmp_path, forked_small):
    from varlen_cli.plan.replan import ExtendConfig, ReplanConfig, extend, replan

    src, tgt = _pairs(500, 7)
    a = write_metrics(tmp_path / "a", src, targets=tgt)
    b = write_metrics(tmp_path / "b", src[:200] + 5, targets=tgt[:200], sorted_by="length")
    common = dict(max_tokens=M, max_target_tokens=MT, dp=2, epochs=2, chunk_samples=120, progress=False)
    outs: dict = {}
    for nproc in (1, 2):
        o = {k: str(tmp_path / f"{k}{nproc}.parquet") for k in ("plan", "mix", "replan", "extend")}
        plan(PlanConfig(input=a, output=o["plan"], nproc=nproc, order="random", pad_multiple=8, **common))
        plan(PlanConfig(input="", mix=f"a={a}:1,b={b}:1.5", output=o["mix"], nproc=nproc, num_shapes=4,
                        order="curriculum", curriculum_epochs=1, **common))
        parent = str(tmp_path / "plan1.parquet")  # one parent for both: a continuation records its path
        replan(ReplanConfig(plan=parent, output=o["replan"], dp=3, grad_accum=2, from_step=7, nproc=nproc,
                            progress=False))
        extend(ExtendConfig(plan=str(tmp_path / "mix1.parquet"), output=o["extend"], epochs=3, nproc=nproc,
                            progress=False))
        outs[nproc] = o
    for key in outs[1]:
        _same(outs[1][key], outs[2][key])
        assert validate(ValidateConfig(plan=outs[2][key])).ok
    _checked(outs[1]["replan"], src, tgt)
    table, _ = _checked(outs[1]["extend"], np.concatenate([src, src[:200] + 5]), np.concatenate([tgt, tgt[:200]]))
    assert table.column("epoch").to_pylist()[-1] == 2


# -- the Lhotse manifest ------------------------------------------------------------------------------
def test_lhotse_cuts_frames_and_transcript_tokens_under_two_budgets(tmp_path):
    """sample_data/cuts.jsonl.gz (a Lhotse CutSet: recordings, supervisions): frames at 100 per second and the
    first supervision's tokens, planned under both budgets: no microbatch over either, every cut once."""
    from tokenizers import Tokenizer

    cuts, tok = "sample_data/cuts.jsonl.gz", "sample_data/tokenizer.json"
    metrics, out = str(tmp_path / "m"), str(tmp_path / "plan.parquet")
    result = runner.invoke(app, ["analyze", cuts, "-o", metrics, "--length", "value:duration", "--frames-per-second",
                                 "100", "--target-length", "tokens:supervisions[0].text", "--tokenizer", tok,
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    import gzip

    rows = [json.loads(line) for line in gzip.open(cuts, "rt")]
    tokenizer = Tokenizer.from_file(tok)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    frames = np.array([math.ceil(r["duration"] * 100 - 1e-9) for r in rows])
    tokens = np.array([len(tokenizer.encode(r["supervisions"][0]["text"])) for r in rows])
    result = runner.invoke(app, ["plan", metrics, "-o", out, "--max-tokens", "6000", "--max-target-tokens", "1000",
                                 "--dp", "2", "--pad-multiple", "8", "--lr-scale-by", "tokens", "--json",
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["dropped samples"] == 0
    table, _ = _checked(out, frames, tokens, 6000, 1000, pad=8)
    _once(table, len(rows))
    assert runner.invoke(app, ["validate", out, "--metrics", metrics]).exit_code == 0
