"""``varlen simulate PLAN --trace TRACE.json`` (issue 35): valid Chrome trace events, one track per
(worker, stage), one event per forward and backward at the times an independent event-by-event
simulation (tests/simulate_helpers.py) gives, steps end to end: the trace ends at ``--json``'s makespan."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.simulate_helpers import brute_force, write_plan
from varlen_cli.cli import app
from varlen_cli.schedule import make_scheme

runner = CliRunner()
CHROME_PHASES = {"X", "M"}


def _plan(tmp_path, steps=4, dp=2, grad_accum=2):
    rng = np.random.default_rng(7)
    return write_plan(tmp_path / "p.parquet", rng.integers(1, 9, (steps, dp * grad_accum)), 16, dp=dp), \
        rng, (steps, dp, grad_accum)


def _trace(path) -> dict:
    data = json.load(open(path))
    assert list(data)[0] == "format" and data["format"] == "varlen-trace"
    assert isinstance(data["traceEvents"], list) and data["displayTimeUnit"] == "ms"
    for e in data["traceEvents"]:  # the Chrome trace event format: phase, pid, and times in microseconds
        assert e["ph"] in CHROME_PHASES and isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["ts"] >= 0 and e["dur"] > 0
    return data


@pytest.mark.parametrize("name,stages", [("1f1b", 2), ("lpp", 2), ("gpipe", 3), ("ddp", 1)])
def test_trace_events_are_the_simulated_schedule(tmp_path, name, stages):
    path, _, (steps, dp, accum) = _plan(tmp_path)
    trace = tmp_path / "t.json"
    res = runner.invoke(app, ["simulate", path, "--schedule", name, "--stages", str(stages), "--trace", str(trace)])
    assert res.exit_code == 0, res.output
    assert f"trace of {steps} steps → {trace}" in res.stdout
    data = _trace(trace)
    summary = json.loads(runner.invoke(app, ["simulate", path, "--schedule", name, "--stages", str(stages),
                                             "--json"]).stdout)
    events = [e for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]
    assert len(events) == steps * 2 * stages * dp * accum  # one event per microbatch, stage and direction
    assert max(e["ts"] + e["dur"] for e in data["traceEvents"] if e["ph"] == "X") == \
        pytest.approx(summary["makespan"], rel=1e-12)
    assert data["otherData"]["schedules"][0]["makespan"] == summary["makespan"]
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    cost = (t.column("batch_size").to_numpy() * t.column("seqlen").to_numpy()).reshape(steps, dp * accum)
    scheme = make_scheme(name, stages=stages, microbatches=dp * accum, dp=dp)
    offset = 0.0
    for k in range(steps):  # each step from the brute-force simulation, shifted by the steps before it
        want, _, _ = brute_force(scheme, cost[k].astype(float), cost[k], 2.0)
        got = {(e["tid"], e["args"]["microbatch"], e["cat"][0].upper()): (e["pid"], e["ts"] - offset,
                                                                          e["ts"] - offset + e["dur"])
               for e in events if e["args"]["step"] == k}
        assert got.keys() == want.keys()
        for job, (worker, start, end) in want.items():
            assert got[job] == pytest.approx((worker, start, end), rel=1e-12, abs=1e-9), (k, job)
        offset += summary["steps"][k]
        assert max(e for _, _, e in want.values()) == pytest.approx(summary["steps"][k])
    named = {(e["pid"], e["tid"]) for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in events} <= named  # every track named "stage S" of "NAME worker W"
    mb = {e["args"]["microbatch"]: (e["args"]["rank"], e["args"]["micro"]) for e in events}
    assert mb == {m: (m // accum, m % accum) for m in range(dp * accum)}


def test_trace_of_every_schedule_and_of_the_first_steps(tmp_path):
    path, _, (steps, dp, accum) = _plan(tmp_path)
    trace = tmp_path / "t.json"
    res = runner.invoke(app, ["simulate", path, "--stages", "2", "--trace", str(trace), "--trace-steps", "2"])
    assert res.exit_code == 0, res.output
    data = _trace(trace)
    schedules = data["otherData"]["schedules"]
    assert [s["schedule"] for s in schedules] == ["ddp", "fsdp", "gpipe", "1f1b", "lpp", "fslpp"]
    summary = json.loads(runner.invoke(app, ["simulate", path, "--stages", "2", "--json"]).stdout)
    for k, (s, want) in enumerate(zip(schedules, summary)):
        mine = [e for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] // 100_000 == k]
        assert {e["args"]["step"] for e in mine} == {0, 1}
        assert max(e["ts"] + e["dur"] for e in mine) == pytest.approx(sum(want["steps"][:2]), rel=1e-12)
        assert s["makespan"] == want["makespan"] and s["makespan_traced"] == pytest.approx(sum(want["steps"][:2]))
    res = runner.invoke(app, ["simulate", path, "--stages", "2", "--trace", str(trace), "--overwrite"])
    assert res.exit_code == 0, res.output  # its own trace: replaced


def test_trace_refusals_are_one_line(tmp_path, monkeypatch):
    path, _, _ = _plan(tmp_path)
    base = ["simulate", path, "--stages", "2", "--schedule", "1f1b"]
    assert_user_error(runner.invoke(app, base + ["--trace-steps", "2"]), 2, "--trace-steps needs --trace FILE")
    assert_user_error(runner.invoke(app, base + ["--overwrite"]), 2,
                      "--overwrite applies to --trace FILE (simulate writes nothing else)")
    assert_user_error(runner.invoke(app, base + ["--trace", "s3://b/t.json"]), 2,
                      "--trace s3://b/t.json: a trace is written to a local file (copy it to object storage after)")
    mine = tmp_path / "mine.json"
    mine.write_text('{"format": "mine"}')
    assert_user_error(runner.invoke(app, base + ["--trace", str(mine)]), 4,
                      f"output {mine} already exists; pass --overwrite to replace it")
    assert_user_error(runner.invoke(app, base + ["--trace", str(mine), "--overwrite"]), 4,
                      f"output {mine} is not a varlen trace; --overwrite replaces only varlen outputs")
    assert mine.read_text() == '{"format": "mine"}'
    from varlen_cli.schedule import trace

    monkeypatch.setattr(trace, "MAX_TRACE_EVENTS", 50)
    assert_user_error(runner.invoke(app, base + ["--trace", str(tmp_path / "big.json")]), 2,
                      "the trace of its 4 steps would hold 64 events (16 a step; at most 50): pass --trace-steps 3 "
                      "(or fewer), or --schedule with one scheme")
    assert not (tmp_path / "big.json").exists()
