"""The torch-free local group of ``--nproc N`` on the CPU (``varlen_cli.runtime.local_group``).

Real worker processes (fork and spawn) joined by real pipes: every collective against values
computed here from the same inputs; arrays several times a pipe's buffer, empty shares, datetime
rows; a peer that fails, exits early or stalls; and torch never imported by the workers.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

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
