"""The end of a process group (varlen_cli.runtime.dist.session): after a success every rank meets at a
barrier before the group is destroyed (no rank tears down its gloo connections while a peer still
uses them: the "terminate called without an active exception" abort at exit); after a failure no
rank waits for a peer that is gone. Two real gloo processes on 127.0.0.1, a free port each time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

WORKER = r"""
import os, sys, time
from varlen_cli.runtime.dist import session

mode, rank = sys.argv[1], int(os.environ["RANK"])
try:
    with session("cpu") as d:
        d.barrier()  # both ranks are in the group
        entered = time.monotonic()
        if rank == 1 and mode == "late":
            time.sleep(float(sys.argv[2]))
        if rank == 1 and mode == "fail":
            raise RuntimeError("rank 1 failed")
except RuntimeError:
    sys.stdout.flush()
    os._exit(7)
print(f"rank {rank} left after {time.monotonic() - entered:.3f}", flush=True)
sys.stdout.flush()
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(mode: str, *args: str, timeout: float = 120) -> list[tuple[int, str]]:
    """Start ranks 0 and 1 as plain processes joining through env:// (what torchrun sets)."""
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", VARLEN_TIMEOUT="100", PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, mode, *args], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return out


@pytest.mark.slow
def test_ranks_meet_before_the_group_is_destroyed():
    """Rank 1 leaves its work 2 s late: rank 0 waits for it at the teardown barrier."""
    (code0, out0), (code1, out1) = _run_pair("late", "2")
    assert code0 == 0 and code1 == 0, (out0, out1)
    waited = float(out0.split("left after ")[1].split()[0])
    assert waited >= 1.9, out0


@pytest.mark.slow
def test_a_failed_peer_does_not_hold_the_others_at_teardown():
    """Rank 1 fails inside the session (no barrier on that path): rank 0 still leaves, long before the
    group's 100 s timeout."""
    t0 = time.monotonic()
    (code0, out0), (code1, out1) = _run_pair("fail")
    assert code1 == 7, out1
    assert code0 == 0, out0
    assert time.monotonic() - t0 < 60, (out0, out1)


@pytest.mark.slow
def test_a_rank_whose_peers_never_come_stops_in_one_line():
    """RANK=1 WORLD_SIZE=2 left over from another job: varlen waited 30 minutes for rank 0 (torch retries
    the store's connection in C++), deaf to SIGTERM and Ctrl-C. Now the join ends after
    VARLEN_JOIN_TIMEOUT with one line (exit 5), and a signal stops it at once (exit 143)."""
    port = str(_free_port())
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=ROOT,
               VARLEN_JOIN_TIMEOUT="2", OMP_NUM_THREADS="1")
    source = os.path.join(ROOT, "sample_data", "tokenized.parquet")
    command = [sys.executable, "-m", "varlen_cli", "analyze", source, "-o", os.devnull + "-varlen-never-written"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 5, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("varlen:")] == [
        f"varlen: error: [rank 1] could not join the process group (gloo): rank 1 of 2 waited 2 s at 127.0.0.1:{port} "
        "for the other ranks (VARLEN_JOIN_TIMEOUT); are RANK and WORLD_SIZE left over from another job?"]
    env["VARLEN_JOIN_TIMEOUT"] = "100"
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(4)  # torch imported, the join under way
        t0 = time.monotonic()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and time.monotonic() - t0 < 10, err
    assert "varlen: terminated" in err



@pytest.mark.parametrize("name,value", [("VARLEN_TIMEOUT", "abc"), ("VARLEN_TIMEOUT", "0"), ("VARLEN_TIMEOUT", "nan"),
                                        ("VARLEN_JOIN_TIMEOUT", "-1"), ("VARLEN_JOIN_TIMEOUT", "inf")])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_a_usage_error(monkeypatch, name, value):
    from varlen_cli.errors import UsageError
    from varlen_cli.runtime import dist

    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=rf"^{name} must be a positive number of seconds, got {value!r}$"):
        dist.join_timeout()  # reads VARLEN_TIMEOUT too (its default)
    monkeypatch.setenv(name, "2.5")
    assert (dist.join_timeout() if name == "VARLEN_JOIN_TIMEOUT" else dist.collective_timeout()) == 2.5


def test_a_bad_join_timeout_is_one_usage_line_before_the_join(tmp_path):
    """Under a launcher's environment: exit 2 and one line naming it, nothing written (it was a join
    failure of exit 5 after the join started; VARLEN_TIMEOUT's value was a ValueError traceback)."""
    port = str(_free_port())
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=ROOT,
               OMP_NUM_THREADS="1", VARLEN_JOIN_TIMEOUT="-1")
    out = tmp_path / "metrics"
    command = [sys.executable, "-m", "varlen_cli", "analyze", os.path.join(ROOT, "sample_data", "tokenized.parquet"),
               "-o", str(out)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "varlen: error: [rank 0] VARLEN_JOIN_TIMEOUT must be a positive number of seconds, got '-1'"]
    assert not out.exists()
