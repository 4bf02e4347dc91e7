"""`varlen validate` catches each kind of broken plan; `varlen inspect` shows every artifact."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.conftest import sample
from varlen_cli import format as fmt
from varlen_cli.analyze import AnalyzeConfig, analyze
from varlen_cli.cli import app
from varlen_cli.errors import InputError
from varlen_cli.inspect import InspectConfig, inspect_artifact, tables
from varlen_cli.loader import Plan, PlanError
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.validate import ValidateConfig, validate

runner = CliRunner()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("vi")
    metrics = str(root / "metrics")
    analyze(AnalyzeConfig(sources=(sample("tokenized.parquet"),), output=metrics, progress=False))
    plan_path = str(root / "plan.parquet")
    plan(PlanConfig(input=metrics, output=plan_path, max_tokens=1024, dp=2, grad_accum=2, epochs=2, num_shapes=4))
    return root, metrics, plan_path


def _tampered(src: str, dst: str, edit) -> str:
    """A copy of the plan with one column edited, metadata kept."""
    table = pq.read_table(src)
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    edit(cols)
    out = pa.table({name: pa.array(cols[name], type=table.schema.field(name).type) for name in table.column_names},
                   schema=table.schema)
    pq.write_table(out, dst)
    return dst


def test_valid_plan_passes_every_check(made):
    _, metrics, plan_path = made
    result = validate(ValidateConfig(plan_path, metrics=metrics))
    assert result.ok, [c.detail for c in result.violations]
    assert {c.name for c in result.checks} >= {"layout", "coverage", "budget", "shapes", "lr_scale", "fingerprint"}


def _dup_first_sample(c):
    c["sample_ids"][1] = c["sample_ids"][1] + [c["sample_ids"][0][0]]
    c["num_samples"][1] += 1


def _over_budget(c):
    c["seqlen"][0] = 4096


def _wrong_lr(c):
    c["lr_scale"] = [v * 1.5 for v in c["lr_scale"]]


def _bad_layout(c):
    c["rank"][0], c["rank"][2] = c["rank"][2], c["rank"][0]


def _drop_sample(c):
    c["sample_ids"][0] = c["sample_ids"][0][1:]
    c["num_samples"][0] -= 1


@pytest.mark.parametrize("edit,check,message", [
    (_dup_first_sample, "coverage", "appear more than once in an epoch"),
    (_drop_sample, "coverage", "missing from an epoch and not listed as dropped"),
    (_over_budget, "budget", "microbatches over the budget --max-tokens 1,024"),
    (_wrong_lr, "lr_scale", "rows whose lr_scale is not linear"),
    (_bad_layout, "layout", "rank out of (step, rank, micro) order"),
])
def test_validate_reports_each_violation(made, tmp_path, edit, check, message):
    _, metrics, plan_path = made
    bad = _tampered(plan_path, str(tmp_path / "bad.parquet"), edit)
    result = validate(ValidateConfig(bad, metrics=metrics))
    assert not result.ok
    assert check in {c.name for c in result.violations}
    assert any(message in c.detail for c in result.violations if c.name == check)
    cli = runner.invoke(app, ["validate", bad, "--metrics", metrics])
    assert cli.exit_code == 6


def test_validate_refuses_plan_of_another_dataset(made, tmp_path):
    _, _, plan_path = made
    other = str(tmp_path / "other")
    analyze(AnalyzeConfig(sources=(sample("audio_manifest.jsonl"),), output=other, length="value:duration",
                          frames_per_second=100, progress=False))
    result = validate(ValidateConfig(plan_path, metrics=other))
    fp = [c for c in result.checks if c.name == "fingerprint"][0]
    assert not fp.ok and "re-run `varlen analyze` and `varlen plan`" in fp.detail


@pytest.mark.parametrize("path,message", [
    ("missing.parquet", "does not exist"),
    ("notaplan.parquet", "is not a varlen plan"),
])
def test_validate_bad_inputs(tmp_path, path, message):
    pq.write_table(pa.table({"x": [1]}), tmp_path / "notaplan.parquet")
    with pytest.raises(InputError, match=message):
        validate(ValidateConfig(str(tmp_path / path)))


def test_inspect_metrics_plan_and_step(made):
    _, metrics, plan_path = made
    info = inspect_artifact(InspectConfig(metrics))
    token_lists = pq.read_table(sample("tokenized.parquet")).column("input_ids").to_pylist()
    assert info["kind"] == "metrics" and info["manifest"]["num_rows"] == len(token_lists)
    info = inspect_artifact(InspectConfig(plan_path, step=3))
    meta = info["metadata"]
    assert info["kind"] == "plan" and info["series"]["steps"] == meta["num_steps"]
    assert len(info["step"]) == meta["dp"] * meta["grad_accum"]
    assert {r["step"] for r in info["step"]} == {3}
    total = sum(len(ids) for ids in token_lists)
    assert sum(info["series"]["real_tokens_per_rank"]) == 2 * total  # two epochs of the sample data
    for args in (["inspect", metrics], ["inspect", plan_path, "--step", "0"]):
        out = runner.invoke(app, args)
        assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["inspect", plan_path, "--json"])
    assert json.loads(out.output)["metadata"]["dp"] == 2
    out = runner.invoke(app, ["inspect", plan_path, "--step", "100000"])
    assert out.exit_code == 2 and "outside the plan's steps" in out.output


def test_split_samples_count_once_in_step_samples(made, tmp_path):
    """--split-long: a sample cut into chunks counts once in step_samples (with its last chunk), and
    step_loss_tokens is the step's next-token targets, counted here from the samples' lengths."""
    _, metrics, _ = made
    out = str(tmp_path / "split.parquet")
    plan(PlanConfig(input=metrics, output=out, packing=True, seq_len=128, split_long=True, dp=2, grad_accum=1))
    t = pq.read_table(out)
    steps = t.column("step").to_numpy()
    first_row_of_step = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    ids = [i for row in t.column("sample_ids").to_pylist() for i in row]
    lengths = [len(x) for x in pq.read_table(sample("tokenized.parquet")).column("input_ids").to_pylist()]
    want_entries = sum(max(1, -(-n // 128)) for n in lengths)  # chunks of at most 128 tokens
    assert len(ids) == want_entries > len(lengths)
    assert int(t.column("step_samples").to_numpy()[first_row_of_step].sum()) == len(lengths)
    targets = sum(max(n - 1, 0) for n in lengths)  # every token but the last of each sample
    assert int(t.column("step_loss_tokens").to_numpy()[first_row_of_step].sum()) == targets
    result = validate(ValidateConfig(out, metrics=metrics))
    assert result.ok, [c.detail for c in result.violations]


@pytest.fixture(scope="module")
def packed_plan(made):
    root, metrics, _ = made
    out = str(root / "packed.parquet")
    plan(PlanConfig(input=metrics, output=out, packing=True, seq_len=512, dp=2, grad_accum=2))
    return out


def _plan_of(kind, made, packed_plan):
    return made[2] if kind == "padded" else packed_plan


def _without(src: str, dst: str, column: str) -> str:
    table = pq.read_table(src)
    pq.write_table(table.drop_columns([column]).replace_schema_metadata(table.schema.metadata), dst)
    return dst


PADDED_COLUMNS = [name for name, _ in fmt.plan_columns(packed=False)]
PACKED_COLUMNS = [name for name, _ in fmt.plan_columns(packed=True)]


@pytest.mark.parametrize("kind,column",
                         [("padded", c) for c in PADDED_COLUMNS] + [("packed", c) for c in PACKED_COLUMNS])
def test_validate_and_loader_agree_on_every_column(made, packed_plan, tmp_path, kind, column):
    """Dropping any column of a plan makes both `varlen validate` and `Plan.open` reject it."""
    src = _plan_of(kind, made, packed_plan)
    assert validate(ValidateConfig(src, metrics=made[1])).ok and Plan.open(src)  # the intact plan passes both
    bad = _without(src, str(tmp_path / "bad.parquet"), column)
    result = validate(ValidateConfig(bad))
    assert not result.ok and [c.name for c in result.violations] == ["columns"]
    assert column in result.violations[0].detail
    with pytest.raises(PlanError, match=rf"lacks plan columns: {column}$"):
        Plan.open(bad)
    cli = runner.invoke(app, ["validate", bad])
    assert cli.exit_code == 6 and f"lacks plan columns: {column}" in cli.output


@pytest.mark.parametrize("column,value", [("lr_scale", "x"), ("step_samples", 1.5), ("sample_ids", [1.5])])
def test_validate_and_loader_agree_on_column_types(made, tmp_path, column, value):
    src = made[2]
    table = pq.read_table(src)
    bad = str(tmp_path / "bad.parquet")
    replaced = table.set_column(table.schema.get_field_index(column), column, pa.array([value] * table.num_rows))
    pq.write_table(replaced.replace_schema_metadata(table.schema.metadata), bad)
    result = validate(ValidateConfig(bad))
    assert not result.ok and f"has column {column} of type" in result.violations[0].detail
    with pytest.raises(PlanError, match=f"has column {column} of type"):
        Plan.open(bad)


def _independent_straggler(path: str, cost_of) -> tuple[float, float]:
    """Per step: max over ranks of the summed microbatch cost / mean over ranks, from the rows."""
    rows = pq.read_table(path, columns=["step", "rank", "tokens", "batch_size", "seqlen"]).to_pylist()
    load: dict = {}
    for r in rows:
        load.setdefault(r["step"], {}).setdefault(r["rank"], 0.0)
        load[r["step"]][r["rank"]] += cost_of(r)
    ratios = [max(v.values()) / (sum(v.values()) / 2) for v in load.values()]  # dp = 2 in both plans
    return sum(ratios) / len(ratios), max(ratios)


@pytest.mark.parametrize("kind", ["attention", "packed"])
def test_inspect_straggler_equals_plan_summary(made, packed_plan, tmp_path, kind):
    """One straggler: the plan records its cost; inspect and the plan's summary show the same numbers,
    and both equal a per-row recomputation (attention term for padded plans, tokens for packed)."""
    _, metrics, _ = made
    if kind == "attention":
        path = str(tmp_path / "attn.parquet")
        result = plan(PlanConfig(input=metrics, output=path, max_tokens=1024, dp=2, grad_accum=1,
                                 attention_cost=0.002, order="random"))
        stats = result.stats

        def cost_of(r):
            return r["batch_size"] * r["seqlen"] + 0.002 * r["batch_size"] * r["seqlen"] ** 2
    else:
        path = packed_plan
        stats = json.loads(pq.read_schema(path).metadata[b"varlen"])["stats"]

        def cost_of(r):
            return float(r["tokens"])
    meta = json.loads(pq.read_schema(path).metadata[b"varlen"])
    want = {"kind": "tokens"} if kind == "packed" else {"kind": "padded", "attention_cost": 0.002}
    assert meta["budget"]["cost"] == ("packed" if kind == "packed" else "padded")
    assert meta["budget"]["attention_cost"] == (0.0 if kind == "packed" else 0.002)
    series = inspect_artifact(InspectConfig(path))["series"]
    assert series["straggler_cost"] == want
    mean, worst = _independent_straggler(path, cost_of)
    assert series["straggler_mean"] == pytest.approx(stats["straggler_mean"], rel=1e-12)
    assert series["straggler_max"] == pytest.approx(stats["straggler_max"], rel=1e-12)
    assert (mean, worst) == pytest.approx((stats["straggler_mean"], stats["straggler_max"]), rel=1e-9)
    if kind == "attention":  # B x T alone (what inspect used to show) gives another number here
        bt_mean, _ = _independent_straggler(path, lambda r: r["batch_size"] * r["seqlen"])
        assert bt_mean != pytest.approx(mean, rel=1e-6)


def test_inspect_tables_are_text(made):
    """The library returns text tables; printing them is the CLI's job."""
    _, metrics, plan_path = made
    for info in (inspect_artifact(InspectConfig(metrics)), inspect_artifact(InspectConfig(plan_path, step=0))):
        out = tables(info)
        assert out and all(isinstance(cell, str) for t in out for row in t.rows for cell in row)
        assert all(len(row) == len(t.columns) for t in out for row in t.rows)


def test_inspect_says_what_the_lr_scale_range_means(made, tmp_path):
    """The default scales the LR by the step's loss tokens (about 1 under a token budget); inspect says
    so, with the base and the range, derived here from the plan's own columns; by samples it says the
    LR swings with the samples per step."""
    import re

    from varlen_cli.plan.lr import describe

    _, metrics, plan_path = made
    by_samples = str(tmp_path / "samples.parquet")
    plan(PlanConfig(input=metrics, output=by_samples, max_tokens=1024, dp=2, grad_accum=2, epochs=2, num_shapes=4,
                    lr_scale_by="samples"))
    for path, column, unit in ((plan_path, "step_loss_tokens", "loss tokens"), (by_samples, "step_samples", "samples")):
        t = pq.read_table(path, columns=["step", column, "lr_scale"]).to_pydict()
        per_step = dict(zip(t["step"], t[column]))
        base = float(np.mean(list(per_step.values())))
        lr = np.array(t["lr_scale"])
        meta = inspect_artifact(InspectConfig(path))["metadata"]
        assert meta["base_batch_size"] == pytest.approx(base)
        said = describe(meta)
        assert said.startswith(f"your LR x {unit} of the step / {base:,.6g} (1 at a step of {base:,.6g} {unit}")
        assert said.endswith(f"{lr.min():.3g} to {lr.max():.3g} in this plan")
        out = runner.invoke(app, ["inspect", path], env={"COLUMNS": "200"})
        assert re.sub(r"[\s│]+", " ", said) in re.sub(r"[\s│]+", " ", out.output)
    assert "about 1 under a token budget" in describe(inspect_artifact(InspectConfig(plan_path))["metadata"])
    assert "swings with the samples per step" in describe(inspect_artifact(InspectConfig(by_samples))["metadata"])
