"""varlen replan of chunked plans, in bounded memory (issue 25).

Parents of several chunks (``chunk_samples`` 700 over 3,000 samples): the consumed samples are read
from the parent window by window (the rest of the epoch in progress as a bitmap of one bit per sample)
and the chunked planner plans the first epoch from its chunks without them, then the later epochs;
the single-process planner never runs. The replan passes ``varlen validate`` (its lineage's consumed
samples), every sample of the epoch in progress is in exactly one of the two plans, the later epochs
are those a fresh plan for the new layout plans, and 1 and 2 workers write the same file. A split
sample with chunks on both sides of the step is replanned in one process, as before.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.plan_helpers import write_metrics
from varlen_cli import format
from varlen_cli.plan import parent as parent_module
from varlen_cli.plan import pipeline
from varlen_cli.plan.core import PlanConfig, plan
from varlen_cli.plan.replan import ReplanConfig, replan
from varlen_cli.validate import ValidateConfig, validate

N = 3000
CHUNK = 700  # 5 chunks of 600 samples


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("replan-chunked")
    lengths = np.clip(np.random.default_rng(9).lognormal(5.0, 1.0, N), 1, 3000).astype(np.int64)
    return {"metrics": write_metrics(root / "m", lengths),
            "sorted": write_metrics(root / "s", lengths, sorted_by="length", parts=2)}


def _tripwire(monkeypatch):
    """What ran: the single-process planner (every sample in one process) must not."""
    def refuse(*args, **kwargs):
        raise AssertionError("the single-process planner ran")

    for module in (parent_module, pipeline):
        monkeypatch.setattr(module, "plan_epochs", refuse)
    monkeypatch.setattr(parent_module, "read_input", refuse)


def _meta(path):
    return json.loads(pq.read_schema(path).metadata[format.PLAN_METADATA_KEY.encode()])


def _epoch_entries(path, epoch, below=None, at_least=None):
    t = pq.read_table(path, columns=["epoch", "step", "sample_ids"]).to_pydict()
    return sorted(i for e, s, ids in zip(t["epoch"], t["step"], t["sample_ids"])
                  if e == epoch and (below is None or s < below) and (at_least is None or s >= at_least) for i in ids)


CASES = {
    "bucket-shuffle": dict(input="metrics", max_tokens=4096, dp=4, grad_accum=2),
    "curriculum": dict(input="sorted", order="curriculum", max_tokens=4096, dp=2, curriculum_epochs=1),
    "packed": dict(input="metrics", packing=True, seq_len=4096, dp=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("frac", [0.4, 1.3])
def test_replan_of_a_chunked_plan(data, tmp_path, monkeypatch, case, frac):
    options = dict(CASES[case])
    src = data[options.pop("input")]
    parent = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=src, output=parent, chunk_samples=CHUNK, epochs=3, seed=4, progress=False, **options))
    pm = _meta(parent)
    step = int(frac * pm["steps_per_epoch"][0])
    epoch = int(np.searchsorted(np.cumsum(pm["steps_per_epoch"]), step, side="right"))
    _tripwire(monkeypatch)
    out = str(tmp_path / "r.parquet")
    result = replan(ReplanConfig(plan=parent, output=out, dp=3, grad_accum=1, from_step=step))
    m = _meta(out)
    assert validate(ValidateConfig(plan=out, metrics=src)).ok
    assert m["chunks"] == {"samples": CHUNK, "count": 5} and m["epochs"] == 3 - epoch
    # exactly once: the epoch in progress, between the parent's steps < N and the replan's first epoch
    done = _epoch_entries(parent, epoch, below=step)
    assert sorted(done + _epoch_entries(out, 0)) == list(range(N))
    assert m["lineage"]["consumed_samples"] == len(done) and m["lineage"]["first_epoch"] == epoch
    # the later epochs: what a fresh plan for the new layout plans (same chunks and seed streams)
    fresh = str(tmp_path / "fresh.parquet")
    plan(PlanConfig(input=src, output=fresh, chunk_samples=CHUNK, epochs=3, seed=4, progress=False,
                    **{**options, "dp": 3, "grad_accum": 1}, base_batch_size=pm["base_batch_size"]))
    f, r = pq.read_table(fresh).to_pydict(), pq.read_table(out).to_pydict()
    fm = _meta(fresh)
    for e in range(epoch + 1, 3):
        mine = [i for i, x in enumerate(r["epoch"]) if x == e - epoch]
        theirs = [i for i, x in enumerate(f["epoch"]) if x == e]
        for name in ("sample_ids", "rank", "micro", "seqlen", "batch_size", "lr_scale"):
            assert [r[name][i] for i in mine] == [f[name][i] for i in theirs], (e, name)
        assert m["steps_per_epoch"][e - epoch] == fm["steps_per_epoch"][e]
    assert result.num_steps == m["num_steps"]


@pytest.mark.slow
def test_replan_with_two_workers_writes_the_same_file(data, tmp_path, monkeypatch):
    parent = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=data["metrics"], output=parent, chunk_samples=CHUNK, epochs=2, max_tokens=4096, dp=4,
                    progress=False))
    _tripwire(monkeypatch)
    one, two = str(tmp_path / "1.parquet"), str(tmp_path / "2.parquet")
    replan(ReplanConfig(plan=parent, output=one, dp=2, from_step=5, progress=False))
    replan(ReplanConfig(plan=parent, output=two, dp=2, from_step=5, progress=False, nproc=2))
    with open(one, "rb") as a, open(two, "rb") as b:
        assert a.read() == b.read()


def test_a_split_sample_started_before_the_step_is_replanned_in_one_process(data, tmp_path):
    """--split-long: a sample whose first chunks were consumed keeps its other chunks as they were cut;
    that remainder is not a set of whole samples, so it is replanned in one process (as before)."""
    parent = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=data["metrics"], output=parent, chunk_samples=CHUNK, packing=True, seq_len=256,
                    split_long=True, dp=2, progress=False))
    t = pq.read_table(parent, columns=["step", "sample_ids"]).to_pydict()
    steps = {}  # each sample's first and last step (rows in step order)
    for s, ids in zip(t["step"], t["sample_ids"]):
        for i in ids:
            steps.setdefault(i, [s, s])[1] = s
    step = next(last for first, last in steps.values() if last > first)  # a sample split across steps
    left = parent_module.left_samples(parent_module.open_parent(parent), step, N)
    assert left.started
    out = str(tmp_path / "r.parquet")
    replan(ReplanConfig(plan=parent, output=out, dp=3, from_step=step))
    assert validate(ValidateConfig(plan=out, metrics=data["metrics"])).ok
    assert "chunks" not in _meta(out)  # the single-process planner wrote it
