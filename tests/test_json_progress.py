"""`--json` on analyze, sort, plan and run: one JSON object on stdout with the summary table's labels
as keys (plus output), values from the artifacts; and the plan's phase progress bar."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.conftest import sample
from varlen_cli.plan.progress import PlanProgress


def _cli(*args):
    env = dict(os.environ, VARLEN_NO_PROGRESS="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "varlen_cli", *args], capture_output=True, text=True, env=env)


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # the whole of stdout is one object


def _table_labels(stdout: str) -> set:
    """First-column cells of the rich summary tables (box rows `│ label │ value │`)."""
    labels = set()
    for line in stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)]
        if len(cells) >= 4 and cells[1]:
            labels.add(cells[1])
    return labels


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("json")
    metrics, sorted_dir, plan = tmp / "m", tmp / "s", tmp / "p.parquet"
    a = _json(_cli("analyze", sample("tokenized.parquet"), "-o", str(metrics), "--json"))
    s = _json(_cli("sort", str(metrics), "-o", str(sorted_dir), "--by", "length", "--json"))
    p = _json(_cli("plan", str(sorted_dir), "-o", str(plan), "--max-tokens", "4096", "--dp", "2", "--order",
                   "curriculum", "--json"))
    return tmp, (metrics, a), (sorted_dir, s), (plan, p)


def test_analyze_json_matches_the_metrics(pipeline):
    _, (metrics, a), _, _ = pipeline
    lengths = pq.read_table(metrics, columns=["length"]).column("length").to_pylist()
    assert a["output"] == os.path.abspath(metrics)
    assert a["samples"] == len(lengths) and a["total length"] == sum(lengths)
    assert a["min / p50 / p90 / p99 / max"][0] == min(lengths) and a["min / p50 / p90 / p99 / max"][-1] == max(lengths)


def test_sort_json_matches_the_sorted_dir(pipeline):
    _, (_, a), (sorted_dir, s), _ = pipeline
    manifest = json.loads((sorted_dir / "_manifest.json").read_text())
    assert s["output"] == os.path.abspath(sorted_dir)
    assert s["rows"] == a["samples"] == manifest["num_rows"] and s["workers"] == 1
    assert s["rows per worker (min / max)"] == [s["rows"], s["rows"]]
    assert set(s["seconds per phase"]) and all(v >= 0 for v in s["seconds per phase"].values())


def test_plan_json_matches_the_plan_file(pipeline):
    _, (_, a), _, (plan, p) = pipeline
    t = pq.read_table(plan)
    meta = json.loads(t.schema.metadata[b"varlen"])
    assert p["output"] == os.path.abspath(plan) and p["order"] == "curriculum"
    assert p["microbatches"] == t.num_rows and p["steps"] == max(t.column("step").to_pylist()) + 1
    assert p["samples"] == sum(t.column("num_samples").to_pylist()) == a["samples"] - p["dropped samples"]
    assert p["tokens"] == sum(t.column("tokens").to_pylist())
    assert p["straggler mean / max"] == [meta["stats"]["straggler_mean"], meta["stats"]["straggler_max"]]


@pytest.mark.parametrize("stage", ["analyze", "sort", "plan"])
def test_json_keys_are_the_table_labels(pipeline, stage):
    tmp, (metrics, a), (sorted_dir, s), (plan, p) = pipeline
    args = {"analyze": ["analyze", sample("tokenized.parquet"), "-o", str(tmp / "m2")],
            "sort": ["sort", str(metrics), "-o", str(tmp / "s2"), "--by", "length"],
            "plan": ["plan", str(sorted_dir), "-o", str(tmp / "p2.parquet"), "--max-tokens", "4096", "--dp", "2",
                     "--order", "curriculum"]}[stage]
    proc = _cli(*args)
    assert proc.returncode == 0, proc.stderr
    labels = _table_labels(proc.stdout)
    keys = set({"analyze": a, "sort": s, "plan": p}[stage]) - {"output", "seconds per phase"}
    assert keys <= labels, keys - labels
    summary_labels = labels - {"phase"}  # the sort phase table's header
    if stage == "sort":  # the phase table's rows are the keys of "seconds per phase"
        summary_labels -= {k.replace("_", " ") for k in s["seconds per phase"]}
    if stage == "analyze":  # the histogram table's rows (length ranges) are not summary labels
        summary_labels = {x for x in summary_labels if not re.fullmatch(r"[\d,\-]+", x)}
    assert summary_labels == keys


def test_run_json_is_one_object_with_every_stage(tmp_path):
    out = tmp_path / "out"
    r = _json(_cli("run", sample("tokenized.parquet"), "-o", str(out), "--order", "curriculum", "--by", "length",
                   "--json"))
    assert r["output"] == os.path.abspath(out)
    assert r["plan"]["output"] == os.path.abspath(out / "plan.parquet")
    assert r["sort"]["rows"] == r["analyze"]["samples"] and r["auto max tokens"] == 16384
    assert r["plan"]["microbatches"] == pq.read_table(out / "plan.parquet").num_rows


def test_plan_records_phase_seconds(pipeline):
    from varlen_cli.plan import PlanConfig, plan

    tmp, _, (sorted_dir, _), _ = pipeline
    res = plan(PlanConfig(input=str(sorted_dir), output=str(tmp / "p3.parquet"), max_tokens=4096, epochs=2,
                          progress=False))
    assert list(res.phases) == ["read", "form", "layout", "columns", "write"]
    assert all(v >= 0 for v in res.phases.values())


def test_progress_bar_shows_phases_on_a_terminal_only_after_the_delay(monkeypatch, capsys):
    monkeypatch.delenv("VARLEN_NO_PROGRESS", raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich: treat stderr as a terminal
    with PlanProgress(True, epochs=1, delay_s=0.0) as bar:
        bar.phase("read")
        import time

        deadline = time.monotonic() + 30
        while bar._progress is None and time.monotonic() < deadline:  # the timer thread starts the bar
            time.sleep(0.01)
        bar.phase("form epoch 1/1")
    err = capsys.readouterr().err
    assert "plan" in err and "done" in err
    with PlanProgress(True, epochs=1, delay_s=30.0) as bar:  # finishes before the delay: nothing shown
        bar.phase("read")
    with PlanProgress(False, epochs=1, delay_s=0.0) as bar:  # --no-progress
        bar.phase("read")
        time.sleep(0.2)
    assert capsys.readouterr().err == ""
    assert set(bar.seconds) == {"read"}
