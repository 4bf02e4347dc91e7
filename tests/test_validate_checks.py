"""Each of `varlen validate`'s checks is triggered by a plan tampered in the one way it guards against
(so a check that always passed would fail its test), and validate, inspect and the planner refuse or
report bad plans and inputs in one line (issue 23)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.conftest import assert_user_error, sample
from tests.plan_helpers import write_metrics
from varlen_cli.cli import app
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.plan.replan import ReplanConfig, replan
from varlen_cli.validate import ValidateConfig, validate

runner = CliRunner()
N = 240


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    lengths = np.random.default_rng(5).integers(1, 300, N)
    metrics = write_metrics(root / "metrics", lengths)
    profile = root / "profile.json"
    profile.write_text(json.dumps({"format": "varlen-memory-profile", "format_version": 1, "mode": "measured",
                                   "model": "m:f", "fit": {"c0": 2 * 2**20, "c1": 16000.0, "c2": 20.0}}))
    padded = str(root / "padded.parquet")
    plan(PlanConfig(input=metrics, output=padded, max_tokens=1024, dp=2, grad_accum=2, epochs=2, num_shapes=4))
    packed = str(root / "packed.parquet")
    plan(PlanConfig(input=metrics, output=packed, packing=True, seq_len=128, split_long=True, dp=2,
                    attention_cost=0.001, epochs=2))
    memory = str(root / "memory.parquet")
    plan(PlanConfig(input=metrics, output=memory, memory_profile=str(profile), max_memory="64MiB", dp=2))
    return {"root": root, "metrics": metrics, "lengths": lengths, "padded": padded, "packed": packed,
            "memory": memory, "profile": str(profile)}


def _rewrite(src: str, dst: str, columns=None, metadata=None, drop: str | None = None) -> str:
    """A copy of a plan with its columns edited (``columns(dict of lists)``), its metadata edited
    (``metadata(dict)``) or one column dropped."""
    table = pq.read_table(src)
    meta = json.loads(table.schema.metadata[b"varlen"])
    if columns is not None:
        cols = {name: table.column(name).to_pylist() for name in table.column_names}
        columns(cols)
        table = pa.table({n: pa.array(cols[n], type=table.schema.field(n).type) for n in table.column_names},
                         schema=table.schema)
    if metadata is not None:
        metadata(meta)
    if drop is not None:
        table = table.drop_columns([drop])
    pq.write_table(table.replace_schema_metadata({b"varlen": json.dumps(meta)}), dst)
    return dst


def _set(key, fn):
    def edit(cols):
        cols[key] = fn(cols[key])
    return edit


def _first_plus_one(values):
    return [values[0] + 1] + values[1:]


def _meta(*keys_value):
    def edit(meta):
        *keys, value = keys_value
        target = meta
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value(target[keys[-1]]) if callable(value) else value
    return edit


TAMPERED = [  # (plan, edit of columns, edit of metadata, dropped column, the check that must fail, message part)
    ("padded", None, None, "step_tokens", "columns", "lacks plan columns: step_tokens"),
    ("padded", _set("rank", lambda v: [v[2], v[1], v[0]] + v[3:]), None, None, "layout", "rank out of"),
    ("padded", None, _meta("steps_per_epoch", lambda s: [s[0] + 1, s[1] - 1]), None, "layout",
     "steps_per_epoch says"),
    ("padded", None, _meta("num_steps", lambda s: s + 1), None, "layout", "metadata says"),
    ("padded", _set("num_samples", _first_plus_one), None, None, "counts", "num_samples != len(sample_ids)"),
    ("padded", _set("sample_ids", lambda v: [v[0] + [v[1][0]]] + v[1:]), None, None, "coverage",
     "appear more than once in an epoch"),
    ("padded", _set("sample_ids", lambda v: [v[0][1:]] + v[1:]), None, None, "coverage", "missing from an epoch"),
    ("padded", None, _meta("dropped", lambda d: {**d, "too_long_ids": [0], "sample_ids": [0]}), None,
     "coverage", "appear more than once"),
    ("padded", None, _meta("lineage", {"kind": "replan", "consumed_samples": 10}), None, "coverage",
     "no sample of epoch 0 is missing, the lineage says 10 were consumed"),
    ("padded", None, lambda m: m.update(epochs=3, steps_per_epoch=m["steps_per_epoch"] + [0]), None, "coverage",
     f"epoch 2: {N} samples are missing from an epoch"),
    ("padded", _set("seqlen", lambda v: [4096] + v[1:]), None, None, "budget", "over the budget"),
    ("padded", _set("shape_id", lambda v: [(v[0] + 1) % 4] + v[1:]), None, None, "shapes", "differs from their shape"),
    ("padded", _set("step_samples", _first_plus_one), None, None, "step totals", "step_samples/step_tokens wrong"),
    ("padded", _set("step_tokens", _first_plus_one), None, None, "step totals", "step_samples/step_tokens wrong"),
    ("padded", _set("lr_scale", lambda v: [x * 1.5 for x in v]), None, None, "lr_scale", "is not linear"),
    ("padded", None, _meta("stats", "straggler_mean", lambda x: x * 2), None, "straggler",
     "metadata says straggler_mean"),
    ("padded", _set("step_loss_tokens", _first_plus_one), None, None, "loss tokens", "step_loss_tokens wrong"),
    ("packed", _set("sample_starts", lambda v: [[s + 1 if s else s for s in v[0]]] + v[1:]), None, None,
     "coverage", "split chunks"),
    ("packed", _set("sample_lengths", lambda v: [[x + 200 for x in v[0]]] + v[1:]), None, None, "budget",
     "packed rows hold more than seq_len"),
    ("packed", None, _meta("budget", "attention_cost", 0.5), None, "straggler", "metadata says"),
    ("memory", None, _meta("memory", "max_memory", 3 * 2**20), None, "memory", "predicted above"),
]


@pytest.mark.parametrize("which,columns,metadata,drop,check,message", TAMPERED,
                         ids=[f"{t[4]}-{t[5][:24]}" for t in TAMPERED])
def test_each_check_catches_its_tampering(plans, tmp_path, which, columns, metadata, drop, check, message):
    src = plans[which]
    assert validate(ValidateConfig(src, metrics=plans["metrics"])).ok  # the plan as written passes
    bad = _rewrite(src, str(tmp_path / "bad.parquet"), columns, metadata, drop)
    result = validate(ValidateConfig(bad, metrics=plans["metrics"]))
    failed = {c.name: c.detail for c in result.violations}
    assert check in failed, failed
    assert message in failed[check], failed[check]
    res = runner.invoke(app, ["validate", bad, "--metrics", plans["metrics"]])
    assert res.exit_code == 6 and f"violation: {check}:" in res.stderr


def test_validate_checks_the_recorded_memory_limit_by_default(plans):
    checks = {c.name: c for c in validate(ValidateConfig(plans["memory"])).checks}
    assert checks["memory"].ok and "<= 64.00 MiB" in checks["memory"].detail


def test_validate_metrics_with_out_of_range_ids(plans, tmp_path):
    """A plan id past the metrics, or metrics whose ids are not 0..N-1: a violation or one line, never a crash."""
    bad = _rewrite(plans["padded"], str(tmp_path / "far.parquet"), _set("sample_ids", lambda v: [[N + 7]] + v[1:]))
    result = validate(ValidateConfig(bad, metrics=plans["metrics"]))
    assert not result.ok and "sample ids outside 0..239" in {c.name: c.detail for c in result.violations}["coverage"]
    gappy = tmp_path / "gappy"
    write_metrics(gappy, plans["lengths"])
    table = pq.read_table(gappy / "part-00000.parquet")
    ids = table.column("sample_id").to_numpy() * 2
    pq.write_table(table.set_column(0, "sample_id", pa.array(ids)), gappy / "part-00000.parquet")
    res = runner.invoke(app, ["validate", plans["padded"], "--metrics", str(gappy)])
    assert_user_error(res, 3, f"{gappy} does not hold each sample_id 0..{N - 1} once: it is not the metrics of a "
                              "plan's input (re-run `varlen analyze`)")


def test_inspect_of_damaged_plans(plans, tmp_path):
    """A NaN lr_scale is shown ('?') and counted; a malformed memory entry is one line (exit 3)."""
    nan = _rewrite(plans["padded"], str(tmp_path / "nan.parquet"), _set("lr_scale", lambda v: [float("nan")] * len(v)))
    res = runner.invoke(app, ["inspect", nan], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "lr_scale not finite" in res.output
    bad = _rewrite(plans["memory"], str(tmp_path / "mem.parquet"), metadata=_meta("memory", "max_memory", "x"))
    for command in ("inspect", "validate", "simulate"):
        res = runner.invoke(app, [command, bad] + (["--stages", "1"] if command == "simulate" else []))
        assert res.exit_code == 3 and "malformed plan metadata: 'memory' is" in res.stderr, res.output


def test_plan_refuses_duplicate_sample_ids(tmp_path):
    src = write_metrics(tmp_path / "m", [5, 6, 7, 8])
    table = pq.read_table(tmp_path / "m" / "part-00000.parquet")
    pq.write_table(table.set_column(0, "sample_id", pa.array([0, 1, 1, 3], pa.int64())),
                   tmp_path / "m" / "part-00000.parquet")
    res = runner.invoke(app, ["plan", src, "-o", str(tmp_path / "p.parquet"), "--max-tokens", "64"])
    assert_user_error(res, 3, f"{src} has sample_id 1 more than once (and 2 never): sample ids must be the rows' "
                              "indices 0..N-1, each once (re-run `varlen analyze`)")


def test_replan_of_a_replan_validates_with_metrics(plans, tmp_path):
    """lineage.consumed_samples adds up over replans of the same epoch."""
    first, second = str(tmp_path / "r1.parquet"), str(tmp_path / "r2.parquet")
    replan(ReplanConfig(plan=plans["padded"], output=first, dp=3, from_step=2))
    replan(ReplanConfig(plan=first, output=second, dp=2, from_step=2))
    meta = json.loads(pq.read_schema(second).metadata[b"varlen"])
    done = pq.read_table(plans["padded"], filters=[("step", "<", 2)]).column("num_samples").to_numpy().sum()
    done += pq.read_table(first, filters=[("step", "<", 2)]).column("num_samples").to_numpy().sum()
    assert meta["lineage"]["consumed_samples"] == done and meta["lineage"]["first_step"] == 4
    assert validate(ValidateConfig(second, metrics=plans["metrics"])).ok


def test_replan_suggests_only_its_own_options(plans, tmp_path):
    out = str(tmp_path / "r.parquet")
    res = runner.invoke(app, ["replan", plans["padded"], "--from-step", "0", "--dp", "3", "--max-tokens", "100",
                              "-o", out])
    assert res.exit_code == 3 and res.stderr.rstrip().endswith("raise --max-tokens"), res.stderr
    assert "--drop-long" not in res.stderr and "--tail" not in res.stderr
    last = json.loads(pq.read_schema(plans["padded"]).metadata[b"varlen"])["num_steps"] - 1
    res = runner.invoke(app, ["replan", plans["padded"], "--from-step", str(last), "--dp", "64", "-o", out])
    assert res.exit_code == 3 and res.stderr.rstrip().endswith("lower --dp/--grad-accum"), res.stderr


def test_replan_of_a_memory_plan_rechecks_the_limit(plans, tmp_path):
    """--max-tokens beyond what the recorded limit allows is refused; within it the memory entry is
    recomputed; --max-memory re-derives the budget from the recorded profile."""
    out = str(tmp_path / "r.parquet")
    res = runner.invoke(app, ["replan", plans["memory"], "--from-step", "1", "--dp", "3", "--max-tokens", "100000",
                              "-o", out])
    assert res.exit_code == 2 and "are predicted above the plan's --max-memory 64.00 MiB" in res.stderr, res.stderr
    res = runner.invoke(app, ["replan", plans["memory"], "--from-step", "1", "--dp", "3", "--max-tokens", "1000",
                              "-o", out])
    assert res.exit_code == 0, res.output
    meta = json.loads(pq.read_schema(out).metadata[b"varlen"])
    assert meta["budget"]["max_tokens"] == 1000 and meta["memory"]["max_memory"] == 64 * 2**20
    assert meta["memory"]["predicted_peak_max"] <= 64 * 2**20 and validate(ValidateConfig(out)).ok
    res = runner.invoke(app, ["replan", plans["memory"], "--from-step", "1", "--dp", "3", "--max-memory", "32MiB",
                              "-o", out, "--overwrite"])
    assert res.exit_code == 0, res.output
    meta = json.loads(pq.read_schema(out).metadata[b"varlen"])
    assert meta["memory"]["max_memory"] == 32 * 2**20 and meta["budget"]["source"] == "memory"
    assert validate(ValidateConfig(out)).ok


def test_sizes_are_checked_up_front(plans, tmp_path):
    out = str(tmp_path / "p.parquet")
    res = runner.invoke(app, ["plan", plans["metrics"], "-o", out, "--max-tokens", "1024", "--epochs", "1000000"])
    assert_user_error(res, 2, "--epochs 1,000,000 is more than 100,000 epochs in one run; plan fewer and lengthen "
                              "the plan with `varlen plan --extend PLAN --epochs E`")
    res = runner.invoke(app, ["plan", "--mix", f"a={plans['metrics']}:1e7", "-o", out, "--max-tokens", "1024"])
    assert_user_error(res, 2, "--mix makes 2,400,000,000 samples per epoch, more than a plan holds (2^31); lower the "
                              "weights")
    res = runner.invoke(app, ["plan", "--mix", f"a={plans['metrics']}:1e6", "-o", out, "--max-tokens", "1024",
                              "--epochs", "20000"])
    assert res.exit_code == 2 and "GiB while planning, more than the" in res.stderr, res.stderr
    assert len(res.stderr.splitlines()) == 1


def test_every_planning_command_honours_max_memory(plans, tmp_path):
    """varlen run and plan --mix take --memory-profile/--max-memory (no --max-tokens needed)."""
    memory = ["--memory-profile", plans["profile"], "--max-memory", "64MiB"]
    res = runner.invoke(app, ["run", sample("tokenized.parquet"), "-o", str(tmp_path / "run"), "--dp", "2", *memory])
    assert res.exit_code == 0, res.output
    meta = json.loads(pq.read_schema(tmp_path / "run" / "plan.parquet").metadata[b"varlen"])
    assert meta["budget"]["source"] == "memory" and meta["memory"]["max_memory"] == 64 * 2**20
    mixed = str(tmp_path / "mix.parquet")
    res = runner.invoke(app, ["plan", "--mix", f"a={plans['metrics']}:1.5", "-o", mixed, *memory])
    assert res.exit_code == 0, res.output
    assert validate(ValidateConfig(mixed)).ok


def test_simulate_with_a_huge_attention_cost_is_refused(plans):
    res = runner.invoke(app, ["simulate", plans["padded"], "--schedule", "ddp", "--stages", "1", "--attention-cost",
                              "1e300"])
    assert res.exit_code == 2 and "--attention-cost 1e+300 is too large" in res.stderr, res.output
    assert len(res.stderr.splitlines()) == 1
    ok = runner.invoke(app, ["simulate", plans["padded"], "--schedule", "ddp", "--stages", "1", "--attention-cost",
                             "1e-3", "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["utilization"] > 0


@pytest.mark.parametrize("tamper", [None, lambda v: [[s + 1 if s else s for s in v[0]]] + v[1:],
                                    lambda v: [[s + 1 for s in row] for row in v]], ids=["good", "one", "all"])
def test_split_chunks_checked_by_key_ranges_say_what_one_pass_says(plans, tmp_path, monkeypatch, tamper):
    """The tiling of split samples checked a few keys at a time (as a billion-sample plan is) gives the
    same result and message, examples included, as one pass over every chunk."""
    from varlen_cli.checks import tiling

    src = plans["packed"]
    if tamper is not None:
        src = _rewrite(src, str(tmp_path / "bad.parquet"), _set("sample_starts", tamper))
    whole = {c.name: (c.ok, c.detail) for c in validate(ValidateConfig(src, metrics=plans["metrics"])).checks}
    monkeypatch.setattr(tiling, "TILING_PART", 3)
    parts = {c.name: (c.ok, c.detail) for c in validate(ValidateConfig(src, metrics=plans["metrics"])).checks}
    assert parts["coverage"] == whole["coverage"]
    assert whole["coverage"][0] == (tamper is None)


# -- the checks shared out: windows split among several PlanChecks and merged ---------------------------
def _plan_arrays(path: str, metrics: str):
    """A plan file as one PlanArrays (with the metrics' lengths) and its metadata."""
    from varlen_cli import format
    from varlen_cli.checks import scan
    from varlen_cli.runtime import artifacts
    from varlen_cli.validate import _metrics_per_id, window_arrays

    pf, meta = format.open_plan_file(path)
    per_id = _metrics_per_id(meta, metrics, artifacts.read_manifest(metrics))
    names = pf.schema_arrow.names
    lists = [c for c in names if c in format.PLAN_LIST_COLUMNS]
    scalars = [c for c in names if c not in lists]
    (w,) = scan.windows(pf, scalars, lists, pf.metadata.num_rows or 1)
    return window_arrays(w, per_id), meta


def _rows(a, lo: int, hi: int):
    """Rows ``[lo, hi)`` of a PlanArrays, as a window of the plan."""
    from varlen_cli.checks import PlanArrays

    s, e = int(a.offsets[lo]), int(a.offsets[hi])

    def cut(x):
        return None if x is None else x[s:e]

    return PlanArrays({k: v[lo:hi] for k, v in a.cols.items()}, a.offsets[lo:hi + 1] - s, a.ids[s:e], cut(a.lengths),
                      cut(a.rows), cut(a.starts), cut(a.source), cut(a.sample_length), cut(a.sample_target),
                      first_row=lo)


def _as_tuples(checks) -> list:
    return [(c.name, c.ok, c.detail, c.skipped) for c in checks]


def _far_repeats(v):
    """Ids of the first rows repeated in rows a quarter of the plan later (the same epoch, other windows)."""
    v = [list(x) for x in v]
    for i in range(3):
        v[len(v) // 4 + i].append(v[i][0])
    return v


MERGE_CASES = [("padded", None, None, "good-padded"), ("packed", None, None, "good-packed"),
               ("memory", None, None, "good-memory"),
               ("padded", _set("sample_ids", _far_repeats), None, "coverage-repeats-far-apart")] + \
    [(t[0], t[1], t[2], f"{t[4]}-{t[5][:24]}") for t in TAMPERED if t[3] is None]


@pytest.mark.parametrize("which,columns,metadata", [m[:3] for m in MERGE_CASES], ids=[m[3] for m in MERGE_CASES])
def test_checks_split_among_workers_and_merged_are_one_check(plans, tmp_path, which, columns, metadata):
    """A plan's windows shared out among 1-3 PlanChecks (each fed its own in plan order, as the workers
    writing a plan's segments are), pickled and merged in any order: the very results of one PlanChecks
    fed every window, for good plans and for each tampering."""
    import pickle

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from varlen_cli.checks import PlanChecks

    src = plans[which]
    if columns is not None or metadata is not None:
        src = _rewrite(src, str(tmp_path / "bad.parquet"), columns, metadata)
    a, meta = _plan_arrays(src, plans["metrics"])
    slots = int(meta["dp"]) * int(meta["grad_accum"])
    steps = a.count // slots

    def one(cuts: list) -> list:
        checks = PlanChecks(meta, lengths=True)
        for lo, hi in zip(cuts, cuts[1:]):
            checks.update(_rows(a, lo, hi))
        return _as_tuples(checks.results())

    @settings(max_examples=12, deadline=None)
    @given(data=st.data())
    def split(data):
        cut_steps = data.draw(st.lists(st.integers(1, max(steps - 1, 1)), max_size=6, unique=True))
        cuts = [0] + sorted(s * slots for s in cut_steps if s < steps) + [a.count]
        workers = data.draw(st.integers(1, 3))
        owner = data.draw(st.lists(st.integers(0, workers - 1), min_size=len(cuts) - 1, max_size=len(cuts) - 1))
        shards = [PlanChecks(meta, lengths=True, mergeable=True) for _ in range(workers)]
        for (lo, hi), w in zip(zip(cuts, cuts[1:]), owner):
            shards[w].update(_rows(a, lo, hi))
        shards = [pickle.loads(pickle.dumps(s)) for s in shards]
        order = data.draw(st.permutations(range(workers)))
        merged = shards[order[0]]
        for w in order[1:]:
            merged.merge(shards[w])
        assert _as_tuples(merged.results()) == one(cuts)

    split()


# -- split samples at scale: chunks spilled by key range, split lookups by bitmap rank -------------------
def _first_split_row(v, edit):
    """The first row with a chunk past its sample's start, its starts edited."""
    at = next(i for i, row in enumerate(v) if any(row))
    return v[:at] + [[edit(s) for s in v[at]]] + v[at + 1:]


SPILL_TAMPERS = {
    "good": None,
    "one-start": _set("sample_starts", lambda v: [[s + 1 if s else s for s in v[0]]] + v[1:]),
    "all-starts": _set("sample_starts", lambda v: [[s + 1 for s in row] for row in v]),
    "negative-start": _set("sample_starts", lambda v: _first_split_row(v, lambda s: -5 if s else s)),
    "longer-chunks": _set("sample_lengths", lambda v: [[x + 3 for x in row] for row in v]),
    "repeated-chunk": lambda cols: _repeat_split_chunk(cols),
}


def _repeat_split_chunk(cols: dict) -> None:
    """The first chunk past its sample's start, once more in the last row (every list column)."""
    at = next(i for i, row in enumerate(cols["sample_starts"]) if any(row))
    j = next(j for j, s in enumerate(cols["sample_starts"][at]) if s)
    for name in ("sample_ids", "sample_lengths", "sample_rows", "sample_starts"):
        cols[name][-1] = cols[name][-1] + [cols[name][at][j] if name != "sample_rows" else cols[name][-1][-1]]
    cols["num_samples"][-1] += 1


def _streamed(path: str, metrics: str | None, spill, steps_per_window: int) -> list:
    """validate's checks of a plan fed as windows of ``steps_per_window`` steps (with the metrics' lengths
    or, without, the split samples found by a first pass), split chunks spilled to ``spill`` or held."""
    from varlen_cli import format
    from varlen_cli.checks import PlanChecks, scan, split_info
    from varlen_cli.runtime import artifacts
    from varlen_cli.validate import _metrics_per_id, window_arrays

    pf, meta = format.open_plan_file(path)
    per_id = _metrics_per_id(meta, metrics, artifacts.read_manifest(metrics)) if metrics else None
    names = pf.schema_arrow.names
    lists = [c for c in names if c in format.PLAN_LIST_COLUMNS]
    (w,) = scan.windows(pf, [c for c in names if c not in lists], lists, pf.metadata.num_rows or 1)
    a = window_arrays(w, per_id)
    size = steps_per_window * int(meta["dp"]) * int(meta["grad_accum"])
    windows = [_rows(a, lo, min(lo + size, a.count)) for lo in range(0, a.count, size)]
    split = split_info(windows, meta) if per_id is None else None
    checks = PlanChecks(meta, split=split, lengths=per_id is not None, spill=spill)
    for window in windows:
        checks.update(window)
    return _as_tuples(checks.results())


@pytest.mark.parametrize("tamper", list(SPILL_TAMPERS), ids=list(SPILL_TAMPERS))
@pytest.mark.parametrize("lengths", [True, False], ids=["metrics", "no-metrics"])
def test_split_chunks_spilled_by_key_range_say_what_held_chunks_say(plans, tmp_path, monkeypatch, tamper, lengths):
    """The chunks of split samples spilled to files by (epoch, range of keys), a few keys a file (as a
    billion-sample plan's are), give every check's result and message, examples included, that the
    chunks held in memory give; for the plan as written and tampered (tilings that overlap, leave gaps,
    differ between copies or reach past their sample), with and without the samples' lengths, the plan
    read as one window and as windows of one step."""
    from varlen_cli.checks import coverage

    src = plans["packed"]
    if SPILL_TAMPERS[tamper] is not None:
        src = _rewrite(src, str(tmp_path / "bad.parquet"), SPILL_TAMPERS[tamper])
    metrics = plans["metrics"] if lengths else None
    held = _streamed(src, metrics, None, 10**9)
    assert all(c[1] for c in held) == (tamper == "good")  # each tampering is caught
    for part in (1 << 40, 3):  # one file an epoch, then a few keys a file
        monkeypatch.setattr(coverage, "SPILL_PART", part)
        for steps in (10**9, 1):
            spill = tmp_path / f"spill-{part}-{steps}"
            spill.mkdir()
            assert _streamed(src, metrics, str(spill), steps) == held
            files = len(list(spill.iterdir()))  # the chunks went to files: one an epoch, then many
            assert files == 2 if part > 3 else files > 4


def test_split_lookup_by_rank_is_the_largest_start_of_each_sample(monkeypatch):
    """SplitInfo (packed sort, bitmap rank) against a plain dictionary of each (epoch, key)'s largest
    start, for random chunks, also when the pairs do not pack into an int64 (huge keys) and when the
    span is too large for a bitmap (binary search)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from varlen_cli.checks import SplitInfo, split

    @settings(max_examples=60, deadline=None)
    @given(data=st.data())
    def check(data):
        size = data.draw(st.sampled_from([1, 7, 64, 200, 3 << 31]))
        epochs = data.draw(st.integers(1, 3))
        n = data.draw(st.integers(0, 300))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        epoch = rng.integers(0, epochs, n)
        keys = rng.integers(0, size, n)
        starts = np.where(rng.random(n) < 0.5, 0, rng.integers(-3, 1 << 20, n))
        if data.draw(st.booleans()):
            monkeypatch.setattr(split, "SPLIT_BITMAP_MAX", 0)
        else:
            monkeypatch.setattr(split, "SPLIT_BITMAP_MAX", 1 << 34)
        info = SplitInfo(size)
        for lo in range(0, n, 50):
            info.collect(epoch[lo:lo + 50], keys[lo:lo + 50], starts[lo:lo + 50])
        info.freeze()
        top = {}
        for e, k, s in zip(epoch.tolist(), keys.tolist(), starts.tolist()):
            if s > 0:
                top[e * size + k] = max(top.get(e * size + k, 0), s)
        ek = epoch * size + keys
        assert info.later == int((starts > 0).sum()) and info.count == len(top)
        is_split, final = info.final(ek, starts)
        want_split = np.array([k in top for k in ek.tolist()], bool)
        assert is_split.tolist() == want_split.tolist()
        assert final.tolist() == [k not in top or s == top[k] for k, s in zip(ek.tolist(), starts.tolist())]
        looked, biggest = info.lookup(ek)
        assert looked.tolist() == want_split.tolist()
        assert biggest.tolist() == [top.get(k, 0) for k in ek.tolist()]

    check()


def test_tiling_sort_packed_or_not_is_the_lexsort():
    """The chunks' sort by (key, start, length), one packed int64 where the values fit, is the lexsort's
    (and falls back to it for negative or too wide values)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from varlen_cli.checks.tiling import sorted_chunks

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(st.integers(-2, 1 << 40), st.integers(-2, 1 << 20), st.integers(-2, 1 << 14)),
                    min_size=1, max_size=40), st.booleans())
    def check(rows, need_order):
        k, s, ln = (np.array(x, np.int64) for x in zip(*rows))
        order = np.lexsort((ln, s, k))
        got = sorted_chunks(k, s, ln, need_order)
        for have, want in zip(got[:3], (k[order], s[order], ln[order])):
            assert have.tolist() == want.tolist()
        if got[3] is not None:
            assert k[got[3]].tolist() == k[order].tolist() and s[got[3]].tolist() == s[order].tolist()

    check()


def test_a_spill_that_cannot_be_written_is_an_output_error(tmp_path):
    from varlen_cli.checks import KeyRangeSpill
    from varlen_cli.errors import OutputError

    spill = KeyRangeSpill(str(tmp_path / "gone"), ("key", "start"), 100, 4)
    with pytest.raises(OutputError, match="cannot write temporary files under .*gone"):
        spill.add(np.zeros(3, np.int64), {"key": np.arange(3), "start": np.ones(3, np.int64)})
