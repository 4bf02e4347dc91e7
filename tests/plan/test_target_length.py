"""Plans over metrics with ``target_length`` (``varlen analyze --target-length``): a mixture counts each
source's loss tokens as its metrics do (``target_length`` where a source has it, ``l - 1`` per sample
where it has not), and ``varlen validate --metrics`` checks ``step_loss_tokens`` against the metrics'
``target_length`` instead of skipping the check."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.plan_helpers import write_metrics
from varlen_cli.cli import app
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.validate import ValidateConfig, validate


def _source(n: int, seed: int, with_targets: bool):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 120, n)
    targets = (rng.random(n) * lengths).astype(np.int64) if with_targets else None  # 0 <= target <= length
    return lengths, targets


def _expected_step_loss(rows: list, per_source: list) -> dict:
    """Per step: each entry's loss tokens, counted entry by entry from its source's columns."""
    out: dict = {}
    for row in rows:
        sources = row.get("source") or [0] * len(row["sample_ids"])
        n = 0
        for sid, src in zip(row["sample_ids"], sources):
            lengths, targets = per_source[src]
            n += int(targets[sid]) if targets is not None else max(int(lengths[sid]) - 1, 0)
        out[row["step"]] = out.get(row["step"], 0) + n
    return out


def _loss_check(report):
    return next(c for c in report.checks if c.name == "loss tokens")


@pytest.mark.parametrize("order", ["random", "curriculum"])
def test_mixture_counts_each_sources_loss_tokens(tmp_path, order):
    sources = [_source(90, 1, True), _source(70, 2, False)]
    sorted_by = "length" if order == "curriculum" else None
    dirs = [write_metrics(tmp_path / f"s{k}", lengths, targets=targets, sorted_by=sorted_by)
            for k, (lengths, targets) in enumerate(sources)]
    out = str(tmp_path / "mix.parquet")
    res = plan(PlanConfig(input="", mix=f"a={dirs[0]}:1,b={dirs[1]}:1.5", output=out, max_tokens=600, dp=2,
                          order=order, tail="drop", lr_scale_by="tokens", progress=False))
    assert res.metadata["loss_tokens"] == "target_length"
    rows = pq.read_table(out).to_pylist()
    want = _expected_step_loss(rows, sources)
    assert all(r["step_loss_tokens"] == want[r["step"]] for r in rows)
    base = res.metadata["base_batch_size"]
    assert all(abs(r["lr_scale"] - r["step_loss_tokens"] / base) < 1e-9 for r in rows)  # what is trained
    report = validate(ValidateConfig(plan=out))
    assert report.ok, report.violations


def test_mixture_without_target_length_counts_lengths(tmp_path):
    sources = [_source(50, 3, False), _source(40, 4, False)]
    dirs = [write_metrics(tmp_path / f"s{k}", lengths) for k, (lengths, _) in enumerate(sources)]
    out = str(tmp_path / "mix.parquet")
    res = plan(PlanConfig(input="", mix=f"a={dirs[0]}:1,b={dirs[1]}:1", output=out, max_tokens=600,
                          progress=False))
    assert "loss_tokens" not in res.metadata
    rows = pq.read_table(out).to_pylist()
    want = _expected_step_loss(rows, sources)
    assert all(r["step_loss_tokens"] == want[r["step"]] for r in rows)


def _tampered(src: str, dst: str) -> str:
    table = pq.read_table(src)
    cols = {n: table.column(n).to_pylist() for n in table.column_names}
    cols["step_loss_tokens"][0] += 1
    pq.write_table(pa.table({n: pa.array(cols[n], type=table.schema.field(n).type) for n in cols},
                            schema=table.schema), dst)
    return dst


def test_validate_checks_target_length_loss_tokens(tmp_path):
    lengths, targets = _source(150, 5, True)
    metrics = write_metrics(tmp_path / "m", lengths, targets=targets, parts=2)
    out = str(tmp_path / "plan.parquet")
    plan(PlanConfig(input=metrics, output=out, max_tokens=500, dp=2, grad_accum=2, lr_scale_by="tokens",
                    progress=False))
    check = _loss_check(validate(ValidateConfig(plan=out, metrics=metrics)))
    assert check.ok and not check.skipped and "target_length" in check.detail
    skipped = _loss_check(validate(ValidateConfig(plan=out)))
    assert skipped.ok and skipped.skipped and "needs --metrics" in skipped.detail
    bad = _loss_check(validate(ValidateConfig(plan=_tampered(out, str(tmp_path / "bad.parquet")), metrics=metrics)))
    assert not bad.ok and "step_loss_tokens wrong in 1 rows" in bad.detail
    # the same plan against metrics whose target_length differs (same dataset, same artifact id)
    other = write_metrics(tmp_path / "m2", lengths, targets=np.maximum(targets - 1, 0), parts=2)
    assert not _loss_check(validate(ValidateConfig(plan=out, metrics=other))).ok
    # against metrics without the column: one line, exit 3
    plain = write_metrics(tmp_path / "m3", lengths, parts=2)
    result = CliRunner().invoke(app, ["validate", out, "--metrics", plain])
    assert_user_error(result, 3, f"the plan counts the metrics' target_length as its loss tokens, but {plain} has no "
                                 "target_length column (analyze --target-length); pass the metrics the plan was made "
                                 "from")


def test_planner_checks_its_target_loss_tokens(tmp_path, monkeypatch):
    """The plan's own check covers target_length plans: a planner that counted them wrong writes nothing."""
    from varlen_cli import format
    from varlen_cli.errors import InternalConsistencyError

    lengths, targets = _source(60, 6, True)
    metrics = write_metrics(tmp_path / "m", lengths, targets=targets)
    real = format.loss_targets
    calls = {"n": 0}

    def off_by_one(entry_length, final=None, target=None):
        calls["n"] += 1
        out = real(entry_length, final, target)
        return out + 1 if calls["n"] == 1 and target is not None else out  # the planner's count, not the check's

    monkeypatch.setattr(format, "loss_targets", off_by_one)
    with pytest.raises(InternalConsistencyError, match="loss tokens"):
        plan(PlanConfig(input=metrics, output=str(tmp_path / "p.parquet"), max_tokens=500, progress=False))
    assert not (tmp_path / "p.parquet").exists()
    assert json.loads((tmp_path / "m" / "_manifest.json").read_text())["columns"]["target_length"] == "int64"
