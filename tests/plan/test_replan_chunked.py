"""varlen replan of chunked plans, in bounded memory (issue 25).

Parents of several chunks (``chunk_samples`` 700 over 3,000 samples): the consumed samples are read
from the parent window by window (the rest of the epoch in progress as a bitmap of one bit per sample)
and the chunked planner plans the first epoch from its chunks without them, then the later epochs;
the single-process planner never runs. The replan passes ``varlen validate`` (its lineage's consumed
samples), every sample of the epoch in progress is in exactly one of the two plans, the later epochs
are those a fresh plan for the new layout plans, and 1 and 2 workers write the same file. When a split
sample has chunks on both sides of the step, the split samples' chunks left keep their cuts (pieces),
and every token of the epoch is planned once across the two plans.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.plan_helpers import write_metrics
from varlen_cli import format
from varlen_cli.plan.core import PlanConfig, plan
from varlen_cli.plan.replan import ReplanConfig, replan
from varlen_cli.validate import ValidateConfig, validate

N = 3000
CHUNK = 700  # 5 chunks of 600 samples


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("replan-chunked")
    lengths = np.clip(np.random.default_rng(9).lognormal(5.0, 1.0, N), 1, 3000).astype(np.int64)
    return {"lengths": lengths, "metrics": write_metrics(root / "m", lengths),
            "sorted": write_metrics(root / "s", lengths, sorted_by="length", parts=2)}


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
    one, two = str(tmp_path / "1.parquet"), str(tmp_path / "2.parquet")
    replan(ReplanConfig(plan=parent, output=one, dp=2, from_step=5, progress=False))
    replan(ReplanConfig(plan=parent, output=two, dp=2, from_step=5, progress=False, nproc=2))
    with open(one, "rb") as a, open(two, "rb") as b:
        assert a.read() == b.read()


def _spans(path, epoch, below=None, at_least=None) -> dict:
    """Each sample's token spans (start, start + length) in the plan's ``epoch`` (steps in the range)."""
    t = pq.read_table(path, columns=["epoch", "step", "sample_ids", "sample_starts", "sample_lengths"]).to_pydict()
    out: dict = {}
    for e, s, ids, starts, lens in zip(t["epoch"], t["step"], t["sample_ids"], t["sample_starts"],
                                       t["sample_lengths"]):
        if e == epoch and (below is None or s < below) and (at_least is None or s >= at_least):
            for i, a, n in zip(ids, starts, lens):
                out.setdefault(i, []).append((a, a + n))
    return out


def test_a_split_sample_cut_by_the_step_keeps_its_cuts(data, tmp_path):
    """--split-long: when a sample has chunks on both sides of the step, the chunks left of the split
    samples enter the replan's first epoch as pieces (their cuts kept), planned by the chunked planner
    (several chunks): across the two plans every token of the epoch is planned once."""
    parent = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=data["metrics"], output=parent, chunk_samples=CHUNK, packing=True, seq_len=256,
                    split_long=True, dp=2, progress=False))
    t = pq.read_table(parent, columns=["step", "sample_ids"]).to_pydict()
    steps = {}  # each sample's first and last step (rows in step order)
    for s, ids in zip(t["step"], t["sample_ids"]):
        for i in ids:
            steps.setdefault(i, [s, s])[1] = s
    step = next(last for first, last in steps.values() if last > first)  # a sample split across steps
    out = str(tmp_path / "r.parquet")
    replan(ReplanConfig(plan=parent, output=out, dp=3, from_step=step, progress=False))
    assert validate(ValidateConfig(plan=out, metrics=data["metrics"])).ok
    assert _meta(out)["chunks"] == {"samples": CHUNK, "count": 5}
    lengths = data["lengths"]
    done, rest = _spans(parent, 0, below=step), _spans(out, 0)
    assert set(done) | set(rest) == set(range(N))
    for i in range(N):
        spans = sorted(done.get(i, []) + rest.get(i, []))
        assert spans[0][0] == 0 and spans[-1][1] == lengths[i], i
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), i  # no token twice, none lost
