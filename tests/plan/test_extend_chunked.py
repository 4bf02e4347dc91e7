"""varlen plan --extend of chunked plans, in bounded memory (issue 25).

Parents of several chunks (``chunk_samples`` 700 over 3,000 samples): the extended plan passes
``varlen validate``, begins with the parent's row groups byte for byte, holds the new epochs a fresh
plan of as many epochs plans (multi-chunk seed streams numbered from the parent's epochs), and its
metadata statistics are those recomputed from the whole file;
1 and 2 workers write the same file; a failure keeps an existing output; a parent written with
another Parquet schema has its row groups re-encoded.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.conftest import ROOT
from tests.plan_helpers import write_metrics
from varlen_cli import format
from varlen_cli.errors import OutputError
from varlen_cli.plan.core import PlanConfig, plan
from varlen_cli.plan.replan import ExtendConfig, extend
from varlen_cli.runtime import safety
from varlen_cli.validate import ValidateConfig, validate

N = 3000
CHUNK = 700  # 5 chunks of 600 samples
CASES = {
    "padded": dict(max_tokens=4096, dp=4, grad_accum=2),
    "packed, split-long": dict(packing=True, seq_len=1024, max_tokens=4096, dp=2, split_long=True),
}
ENV = dict(os.environ, VARLEN_NO_PROGRESS="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


@pytest.fixture(scope="module")
def metrics(tmp_path_factory):
    root = tmp_path_factory.mktemp("extend-chunked")
    lengths = np.clip(np.random.default_rng(7).lognormal(5.0, 1.0, N), 1, 3000).astype(np.int64)
    return write_metrics(root / "m", lengths)


def _parent(metrics, path, case, epochs=2, **more):
    plan(PlanConfig(input=metrics, output=str(path), chunk_samples=CHUNK, epochs=epochs, seed=3, progress=False,
                    **CASES[case], **more))
    return str(path)


def _meta(path):
    return json.loads(pq.read_schema(path).metadata[format.PLAN_METADATA_KEY.encode()])


def _row_group_bytes(path) -> bytes:
    """The bytes of a Parquet file's row groups (between the leading magic and the footer)."""
    with open(path, "rb") as fh:
        data = fh.read()
    footer = struct.unpack("<I", data[-8:-4])[0]
    return data[4:len(data) - 8 - footer]


def _recomputed(path) -> dict:
    """The statistics of a plan, from its whole file (numpy on every row)."""
    table = pq.read_table(path)
    meta = _meta(path)
    budget = format.plan_budget(meta)
    col = {n: table.column(n).to_numpy().astype(np.float64 if n == "lr_scale" else np.int64)
           for n in ("epoch", "step", "rank", "batch_size", "seqlen", "tokens", "num_samples", "lr_scale")}
    offsets = np.concatenate([[0], np.cumsum(pc.list_value_length(table.column("sample_ids").combine_chunks())
                                             .to_numpy(zero_copy_only=False))])
    assert not budget.needs_segment_lengths  # the cases' cost: no attention term
    cost = budget.microbatch_cost(col["tokens"], col["batch_size"], col["seqlen"])
    strag = format.straggler(col["step"], col["rank"], cost, int(meta["dp"]))
    slots = int(meta["dp"]) * int(meta["grad_accum"])
    entry_epoch = np.repeat(col["epoch"], np.diff(offsets))
    return {"steps": len(col["step"]) // slots, "microbatches": len(col["step"]),
            "samples": int(col["num_samples"].sum()), "tokens": int(col["tokens"].sum()),
            "padded_tokens": int((col["batch_size"] * col["seqlen"]).sum()),
            "straggler_mean": float(strag.mean()), "straggler_max": float(strag.max()),
            "straggler_overhead": format.straggler_overhead(col["step"], col["rank"], cost, int(meta["dp"])),
            "lr_scale_min": float(col["lr_scale"][::slots].min()),
            "lr_scale_max": float(col["lr_scale"][::slots].max()),
            "distinct_shapes": len(meta["shapes"]),
            "samples_per_epoch": np.bincount(entry_epoch, minlength=meta["epochs"]).tolist()}  # entries (pieces)


@pytest.mark.parametrize("case", sorted(CASES))
def test_extend_of_a_chunked_plan(metrics, tmp_path, case):
    parent = _parent(metrics, tmp_path / "p.parquet", case)
    out = str(tmp_path / "e.parquet")
    result = extend(ExtendConfig(plan=parent, output=out, epochs=4))
    assert validate(ValidateConfig(plan=out, metrics=metrics)).ok
    # the parent's row groups, their bytes unchanged, then the new ones
    assert _row_group_bytes(out).startswith(_row_group_bytes(parent))
    old, new = pq.read_table(parent), pq.read_table(out)
    assert new.slice(0, len(old)).to_pydict() == old.to_pydict()
    # the new epochs are those a fresh 4-epoch plan (5 chunks an epoch) plans, with the parent's base batch size
    pm, m = _meta(parent), _meta(out)
    fresh = str(tmp_path / "fresh.parquet")
    plan(PlanConfig(input=metrics, output=fresh, chunk_samples=CHUNK, epochs=4, seed=3, progress=False,
                    base_batch_size=pm["base_batch_size"], **CASES[case]))
    f, e = pq.read_table(fresh).to_pydict(), new.to_pydict()
    for name in set(e) - {"shape_id"}:
        assert e[name] == f[name], name
    assert [m["shapes"][i] for i in e["shape_id"]] == [_meta(fresh)["shapes"][i] for i in f["shape_id"]]
    assert m["steps_per_epoch"] == _meta(fresh)["steps_per_epoch"] and m["epochs"] == 4
    assert m["lineage"]["parent_steps"] == pm["num_steps"] and m["chunks"] == pm["chunks"]
    # the statistics: those of the whole file
    got, want = m["stats"], _recomputed(out)
    for key, value in want.items():
        assert got[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key
    assert got["padding_pct"] == pytest.approx(100.0 * (1 - want["tokens"] / want["padded_tokens"]), rel=1e-12)
    assert result.num_steps == m["num_steps"] == want["steps"]
    if case.startswith("packed"):  # the fresh plan's epochs 0-1 split and pack as the parent's
        assert m["packing"]["split_samples"] == _meta(fresh)["packing"]["split_samples"] > 0
        assert m["packing"]["efficiency"] == pytest.approx(_meta(fresh)["packing"]["efficiency"], rel=1e-12)


@pytest.mark.slow
def test_extend_with_two_workers_writes_the_same_file(metrics, tmp_path):
    parent = _parent(metrics, tmp_path / "p.parquet", "padded", epochs=1)
    one, two = str(tmp_path / "1.parquet"), str(tmp_path / "2.parquet")
    extend(ExtendConfig(plan=parent, output=one, epochs=3, progress=False))
    extend(ExtendConfig(plan=parent, output=two, epochs=3, progress=False, nproc=2))
    with open(one, "rb") as a, open(two, "rb") as b:
        assert a.read() == b.read()


def _leftovers(folder) -> list[str]:
    tags = (safety.TMP_TAG, safety.OLD_TAG, safety.LOCK_TAG)
    return [n for n in os.listdir(folder) if any(t in n for t in tags)]


def test_a_failed_write_keeps_the_old_output(metrics, tmp_path, monkeypatch):
    """A full disk while joining the parts: one OutputError, the old output as it was, nothing left beside."""
    from varlen_cli.runtime import parquet_concat

    parent = _parent(metrics, tmp_path / "p.parquet", "padded", epochs=1)
    out = tmp_path / "e.parquet"
    extend(ExtendConfig(plan=parent, output=str(out), epochs=2))
    before = out.read_bytes()

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(parquet_concat, "_copy", full)
    with pytest.raises(OutputError, match="No space left on device"):
        extend(ExtendConfig(plan=parent, output=str(out), epochs=3, overwrite=True))
    assert out.read_bytes() == before
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_killed_extension_keeps_the_old_output(metrics, tmp_path):
    """Killed (SIGKILL) after the extended plan is written, before it is swapped in: the old output stays;
    the next run removes what the killed one left."""
    parent = _parent(metrics, tmp_path / "p.parquet", "padded", epochs=1)
    out = tmp_path / "e.parquet"
    args = [sys.executable, "-m", "varlen_cli", "plan", "--extend", parent, "-o", str(out), "--overwrite"]
    assert subprocess.run(args + ["--epochs", "2"], env=ENV, timeout=120).returncode == 0
    before = out.read_bytes()
    killed = subprocess.run(args + ["--epochs", "3"], env=dict(ENV, VARLEN_FAULT="extend.write:0"), timeout=120)
    assert killed.returncode == -9
    assert out.read_bytes() == before and _leftovers(tmp_path)
    assert subprocess.run(args + ["--epochs", "3"], env=ENV, timeout=120).returncode == 0
    assert _leftovers(tmp_path) == [] and _meta(str(out))["epochs"] == 3


def test_a_parent_of_another_parquet_schema_is_re_encoded(metrics, tmp_path):
    """A parent whose Parquet schema differs from this writer's (list elements named ``item``, as older
    writers name them): its row groups cannot be copied, so they are re-encoded; the rows are the same."""
    parent = _parent(metrics, tmp_path / "p.parquet", "padded", epochs=1)
    table = pq.read_table(parent)
    other = str(tmp_path / "other.parquet")
    pq.write_table(table, other, use_compliant_nested_type=False, row_group_size=100)
    out = str(tmp_path / "e.parquet")
    extend(ExtendConfig(plan=other, output=out, epochs=2))
    assert validate(ValidateConfig(plan=out, metrics=metrics)).ok
    assert pq.read_table(out).slice(0, len(table)).to_pydict() == table.to_pydict()
    assert pq.ParquetFile(out).schema.to_arrow_schema().field("sample_ids").type == pa.list_(pa.int64())


def test_extend_keeps_too_long_samples_counted_not_listed(metrics, tmp_path, monkeypatch):
    """More too-long samples than a plan lists (100M-sample plans: over 10,000): the extended plan keeps
    the parent's rule (``too_long_listed: false``, the count, the length over which samples are dropped)
    and the counts add up, so it passes validate (the single-process merge lost the rule and failed)."""
    from varlen_cli.plan.chunked import finish

    monkeypatch.setattr(finish, "LIST_LIMIT", 3)
    parent = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=metrics, output=parent, chunk_samples=CHUNK, max_tokens=256, drop_long=True, dp=2,
                    progress=False))
    pm = _meta(parent)["dropped"]
    assert pm["too_long_listed"] is False and pm["too_long_count"] > 3
    out = str(tmp_path / "e.parquet")
    extend(ExtendConfig(plan=parent, output=out, epochs=3))
    m = _meta(out)["dropped"]
    assert (m["too_long_listed"], m["too_long_count"], m["too_long_over"]) == (False, pm["too_long_count"], 256)
    assert m["reason"]["too_long"] == 3 * pm["too_long_count"] == m["count"]
    for given in (None, metrics):
        assert validate(ValidateConfig(plan=out, metrics=given)).ok
