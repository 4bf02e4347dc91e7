"""The torch-free local group of ``--nproc N`` on the CPU (``varlen_cli.runtime.local_group``).

Real worker processes (fork and spawn) joined by real pipes: every collective against values
computed here from the same inputs; arrays several times a pipe's buffer, empty shares, datetime
rows; a peer that fails, exits early or stalls; and torch never imported by the workers.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from varlen_cli.errors import InputError, UsageError, WorkerError
from varlen_cli.runtime.dist import launch

P = 3


def _rows_for(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank r's (rows, sends): rows of 2 int64 each, an uneven split, nothing for its right neighbour."""
    rng = np.random.default_rng(rank)
    sends = rng.integers(0, 400_000, P)
    sends[(rank + 1) % P] = 0
    rows = rng.integers(0, 1 << 60, (int(sends.sum()), 2))
    return rows, sends


def _collectives(tag: str) -> dict:
    from varlen_cli.runtime.dist import session

    with session("cpu") as d:
        rows, sends = _rows_for(d.rank)
        recvs = d.exchange_counts(sends)
        got = d.all_to_all_rows(rows, sends, recvs)
        stamps = np.arange(d.rank * 10, d.rank * 10 + 5).astype("datetime64[s]")
        stamps_back = d.all_to_all_rows(stamps, [2, 2, 1], d.exchange_counts(np.array([2, 2, 1])))
        if d.rank == 1:
            d.send_rows(np.arange(3_000_000, dtype=np.float32), dst=2)
        p2p = d.recv_rows(np.empty(3_000_000, dtype=np.float32), src=1) if d.rank == 2 else None
        d.barrier()
        progress = d.add_progress(d.rank + 1)
        d.barrier()
        return {"backend": d.backend, "rank": d.rank, "objects": d.all_gather_object((tag, d.rank, "x" * d.rank)),
                "sum": d.all_reduce(np.array([d.rank, 2 * d.rank], dtype=np.int64)),
                "max": d.all_reduce(np.array([float(d.rank)]), op="max"),
                "min": d.all_reduce(np.array([d.rank + 5]), op="min"), "ints": d.all_gather_int(7 * d.rank),
                "recvs": recvs, "got": got, "stamps": stamps_back, "p2p_ok": p2p is None or bool(
                    np.array_equal(p2p, np.arange(3_000_000, dtype=np.float32))),
                "progress_total": d.progress_total() if progress else None,
                "torch_imported": "torch" in sys.modules}


def _gather_results(tag: str) -> list:
    """Entry: every rank's collectives, gathered on rank 0."""
    from varlen_cli.runtime.dist import session

    mine = _collectives(tag)
    with session("cpu") as d:
        return d.all_gather_object(mine)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_collectives_match_values_computed_here(method, monkeypatch):
    monkeypatch.setenv("VARLEN_START_METHOD", method)
    results = launch(_gather_results, "t", P)
    everyone = [_rows_for(r) for r in range(P)]
    for rank, res in enumerate(results):
        assert res["backend"] == "local" and res["rank"] == rank
        assert res["objects"] == [("t", r, "x" * r) for r in range(P)]
        assert res["sum"].tolist() == [3, 6] and res["max"].tolist() == [2.0] and res["min"].tolist() == [5]
        assert res["ints"].tolist() == [0, 7, 14]
        # What rank `rank` must receive: from each src, the rows src addressed to it, in src order.
        want = []
        for rows, sends in everyone:
            lo = int(sends[:rank].sum())
            want.append(rows[lo:lo + int(sends[rank])])
        assert res["recvs"].tolist() == [int(everyone[s][1][rank]) for s in range(P)]
        assert np.array_equal(res["got"], np.concatenate(want))
        stamp_want = [np.arange(s * 10, s * 10 + 5).astype("datetime64[s]")[[0, 2, 4][rank]:[2, 4, 5][rank]]
                      for s in range(P)]
        assert np.array_equal(res["stamps"], np.concatenate(stamp_want))
        assert res["p2p_ok"] and res["progress_total"] == 1 + 2 + 3
        assert not res["torch_imported"] or method == "fork" and "torch" in sys.modules


def _fails_on(spec: str) -> None:
    from varlen_cli.runtime.dist import session

    with session("cpu") as d:
        d.barrier()
        kind, rank = spec.split(":")
        if d.rank == int(rank):
            if kind == "user":
                raise InputError("bad input on one worker")
            if kind == "exit":
                os._exit(0)  # gone without a word: its peers must not wait for it
            if kind == "stall":
                import time

                time.sleep(30)
        d.all_gather_object(d.rank)


@pytest.mark.parametrize("spec,error,message", [
    ("user:1", InputError, "bad input on one worker"),
    ("exit:2", WorkerError, r"worker \d failed: worker 2 stopped before"),
    ("stall:0", WorkerError, r"worker [12] failed: worker [12] waited more than 1 s for its peers \(VARLEN_TIMEOUT\)"),
])
def test_a_failing_worker_fails_the_job_with_its_error(spec, error, message, monkeypatch):
    monkeypatch.setenv("VARLEN_START_METHOD", "fork")
    monkeypatch.setenv("VARLEN_TIMEOUT", "1")
    with pytest.raises(error, match=message):
        launch(_fails_on, spec, P)


ORPHAN = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
os.environ["VARLEN_START_METHOD"] = "fork"
from varlen_cli.runtime.dist import launch

def entry(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(60)

launch(entry, sys.argv[1], 2)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_workers_die_with_a_killed_launcher(tmp_path):
    import signal
    import subprocess
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launcher = subprocess.Popen([sys.executable, "-c", ORPHAN, str(tmp_path), root])
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [int(name) for name in os.listdir(tmp_path)]
    assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers)


@pytest.mark.parametrize("env,message", [
    ({"VARLEN_LAUNCHER": "gloo"}, "VARLEN_LAUNCHER must be auto, local or torch, not 'gloo'"),
    ({"VARLEN_LAUNCHER": "local", "DEVICE": "cuda"},
     "VARLEN_LAUNCHER=local starts CPU workers; --device cuda needs VARLEN_LAUNCHER=auto or torch"),
])
def test_bad_launcher_settings(env, message, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("VARLEN_LAUNCHER", env["VARLEN_LAUNCHER"])
    with pytest.raises(UsageError) as info:
        launch(_fails_on, SimpleNamespace(device=env.get("DEVICE", "cpu")), 2)
    assert info.value.message == message


# -- any worker count on any input (issue 31) -------------------------------------------------------
def _source(folder, fmt: str, units: int) -> tuple[list[str], list[int], int]:
    """A source of ``fmt`` in ``units`` work units (at the chunk bytes returned), and its lengths."""
    from tests.analyze_helpers import write_jsonl
    from tests.formats_helpers import wds_samples, write_webdataset

    rng = np.random.default_rng(units)
    sizes = rng.integers(1, 6, units).tolist()
    lengths = rng.integers(0, 50, sum(sizes)).tolist()
    cuts = np.cumsum([0, *sizes]).tolist()
    if fmt == "parquet":  # a row group a unit
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = str(folder / "a.parquet")
        with pq.ParquetWriter(path, pa.schema([("n", pa.int64())])) as w:
            for a, b in zip(cuts[:-1], cuts[1:]):
                w.write_table(pa.table({"n": pa.array(lengths[a:b], pa.int64())}))
        return [path], lengths, 32 << 20
    if fmt == "jsonl":  # a file a unit
        import pyarrow as pa

        for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            write_jsonl(pa.table({"n": lengths[a:b]}), folder / f"{k}.jsonl")
        return [str(folder)], lengths, 32 << 20
    if fmt == "nemo":  # a NeMo shard range of a file a unit, 8..: sorted paths would put shard 10 first
        import pyarrow as pa

        for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            write_jsonl(pa.table({"n": lengths[a:b]}), folder / f"m_{8 + k}.json")
        return [str(folder / f"m__OP_8..{7 + units}_CL_.json")], lengths, 32 << 20
    if fmt == "webdataset":  # a shard a unit
        for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            samples = wds_samples(b - a, seed=k, first=a)
            write_webdataset(str(folder / f"{k}.tar"), samples)
            lengths[a:b] = [s["json"]["num_tokens"] for s in samples]
        return [str(folder)], lengths, 32 << 20
    # megatron (varlen's writer of the layout: megatron-core would import torch into the forked workers):
    # 4 bytes of lengths (one sequence) a unit, as many units as sequences
    from varlen_cli.analyze.formats.megatron import write_index

    write_index(str(folder / "c.idx"), lengths[:units], np.arange(units + 1), np.uint16)
    return [str(folder / "c.idx")], lengths[:units], 4


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(["parquet", "jsonl", "webdataset", "megatron", "nemo"]), units=st.integers(1, 3),
       workers=st.integers(1, 5))
@example(fmt="parquet", units=1, workers=3)  # the case: one row group, more workers
@example(fmt="megatron", units=2, workers=4)
@example(fmt="jsonl", units=3, workers=1)
@example(fmt="nemo", units=3, workers=5)  # issue 36: a shard range in its own order
def test_any_worker_count_gives_the_same_metrics(tmp_path_factory, monkeypatch, fmt, units, workers):
    """Any number of workers, 1 to more than the work units, on any source: the metrics of the data
    (workers without a unit write an empty part), and sorted by as many workers. The executor runs the
    count asked for (the --nproc cap is the stages' choice: a torchrun world larger than the units gets
    the same)."""
    from tests.analyze_helpers import read_metrics
    from varlen_cli.analyze import AnalyzeConfig, run_in_group
    from varlen_cli.runtime import artifacts
    from varlen_cli.runtime.executor import execute

    monkeypatch.setenv("VARLEN_START_METHOD", "fork")
    folder, out = tmp_path_factory.mktemp(fmt), tmp_path_factory.mktemp("out") / "m"
    sources, lengths, chunk = _source(folder, fmt, units)
    length = "value:json.num_tokens" if fmt == "webdataset" else "value:length" if fmt == "megatron" else "value:n"
    config = AnalyzeConfig(sources=tuple(sources), output=str(out), length=length, nproc=workers,
                           chunk_bytes=chunk, progress=False)
    res = execute(run_in_group, config)
    got = read_metrics(out)
    assert got.column("length").to_pylist() == lengths and got.column("sample_id").to_pylist() == list(
        range(len(lengths)))
    manifest = artifacts.read_manifest(str(out))
    assert manifest["world_size"] == workers and res.num_parts == workers
    assert sum(p["rows"] for p in manifest["parts"]) == len(lengths)
    # sort on as many workers (more than the rows, some examples): the rows by (length, sample_id)
    from varlen_cli.sort import SortConfig
    from varlen_cli.sort.core import run_in_group as sort_in_group

    execute(sort_in_group, SortConfig(metrics_dir=str(out), output=str(out) + "-sorted", by=("length",),
                                      nproc=workers, progress=False))
    order = read_metrics(str(out) + "-sorted").column("sample_id").to_pylist()
    assert order == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))


@dataclasses.dataclass(frozen=True)
class _Config:
    nproc: int


def test_nproc_is_capped_by_the_units_and_the_cores(monkeypatch):
    """--nproc above the work units or the cores: capped, with one note saying why; within both: as asked."""
    from varlen_cli.runtime import dist, notes

    monkeypatch.setattr(dist, "available_cores", lambda: 4)
    notes.start()
    assert dist.cap_workers(_Config(1000), lambda: (2, "work unit")).nproc == 2
    assert dist.cap_workers(_Config(6), lambda: (10, "row")).nproc == 4
    assert dist.cap_workers(_Config(3), lambda: (1, "chunk job")).nproc == 1
    assert dist.cap_workers(_Config(3), lambda: (3, "row")).nproc == 3
    assert dist.cap_workers(_Config(1), lambda: 1 / 0).nproc == 1  # one worker: nothing counted
    assert notes.current() == ["--nproc 1000 capped to 2 workers: 2 work units, 4 cores",
                               "--nproc 6 capped to 4 workers: 10 rows, 4 cores",
                               "--nproc 3 capped to 1 worker: 1 chunk job, 4 cores"]


def test_nproc_1000_on_one_row_group_is_one_worker_and_says_so(tmp_path, monkeypatch):
    """`analyze --nproc 1000` of a one-row-group Parquet file (the issue's case, exit 5 before): one
    worker, the note on stderr as it is decided and in --json; sort and plan the same way (on one
    core here, so that all three run in this process)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from varlen_cli.cli import app
    from varlen_cli.runtime import dist

    monkeypatch.setattr(dist, "available_cores", lambda: 1)
    pq.write_table(pa.table({"num_tokens": list(range(1, 201))}), tmp_path / "one.parquet")
    runner = CliRunner()
    cases = [(["analyze", str(tmp_path / "one.parquet"), "-o", str(tmp_path / "m")], "1 work unit"),
             (["sort", str(tmp_path / "m"), "-o", str(tmp_path / "s")], "200 rows"),
             (["plan", str(tmp_path / "m"), "-o", str(tmp_path / "p.parquet"), "--max-tokens", "1000"], "1 chunk job")]
    for args, why in cases:
        result = runner.invoke(app, [*args, "--nproc", "1000", "--json", "--no-progress"])
        assert result.exit_code == 0, result.output
        note = f"--nproc 1000 capped to 1 worker: {why}, 1 core"
        assert result.stderr.splitlines() == [f"varlen: note: {note}"]
        assert json.loads(result.stdout)["notes"] == [note]
