"""`varlen plan` (and `varlen run`: analyze, sort, plan) in torchrun jobs of two nodes (issue 25:
multi-node planning; issue 31: two nodes of two workers, c10d rendezvous, a node killed).

Two torchrun agents on this machine stand for two nodes (``--nnodes 2 --node-rank 0|1``, one worker
each, static rendezvous at 127.0.0.1): each node's worker sees ``LOCAL_WORLD_SIZE=1`` and
``WORLD_SIZE=2``, as on a real two-node job with a shared filesystem. The plan must be the one a
single process writes (the same command), byte for byte. (A plan for object storage is refused:
tests/storage/test_s3_pipeline.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.plan_helpers import write_metrics
from tests.test_output_safety import free_port

PLAN = ["--max-tokens", "4096", "--dp", "2", "--grad-accum", "2", "--chunk-samples", "700", "--seed", "4"]


def _env() -> dict:
    return dict(os.environ, VARLEN_NO_PROGRESS="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def two_nodes(*args: str, cwd) -> list[subprocess.CompletedProcess]:
    """``varlen ARGS`` in a torchrun job of two nodes (two agents here, one worker each)."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                               "-m", "varlen_cli", *args], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=240)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.slow
def test_two_node_plan_is_the_one_process_plan(tmp_path):
    rng = np.random.default_rng(11)
    lengths = np.clip(rng.lognormal(5.0, 1.0, 3000), 1, 2000).astype(np.int64)
    write_metrics(tmp_path / "m", lengths)
    nodes = two_nodes("plan", "m", "-o", "two.parquet", *PLAN, cwd=tmp_path)
    assert [p.returncode for p in nodes] == [0, 0], nodes[0].stderr[-2000:] + nodes[1].stderr[-2000:]
    one = subprocess.run([sys.executable, "-m", "varlen_cli", "plan", "m", "-o", "one.parquet", *PLAN], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-2000:]
    assert (tmp_path / "two.parquet").read_bytes() == (tmp_path / "one.parquet").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["m", "one.parquet", "two.parquet"]  # no chunk files left



# -- two nodes of two workers, c10d rendezvous, a local TMPDIR each (issue 31) --------------------------
RUN = ["run", "src", "--order", "curriculum", "--dp", "2", "--grad-accum", "2", "--max-tokens", "2048", "--seed", "5",
       "--no-progress"]


def c10d_nodes(args: list[str], cwd, env_of=lambda node: {}) -> list[subprocess.Popen]:
    """``varlen ARGS`` as a torchrun job of two nodes of two workers: two agents here, a c10d rendezvous
    at 127.0.0.1 on a free port, each node with its own TMPDIR (``cwd/tmpN``); started, not waited for."""
    port = str(free_port())
    procs = []
    for node in (0, 1):
        tmp = os.path.join(cwd, f"tmp{node}")
        os.makedirs(tmp, exist_ok=True)
        env = dict(_env(), TMPDIR=tmp, **env_of(node))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "varlen-two-nodes",
             "--local-addr", "127.0.0.1", "--max-restarts", "0", "-m", "varlen_cli", *args],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
    return procs


def _wait(procs, timeout=300) -> list[tuple[int, str]]:
    out = []
    try:
        for p in procs:
            _, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as fh:
                if name.isdigit() and int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _kill_node(agent: int) -> None:
    """SIGKILL a node: its agent and its workers (each in a session of its own, as torchrun starts them)."""
    workers = _children(agent)
    os.killpg(agent, signal.SIGKILL)
    for pid in workers:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _left_in(tmp) -> list[str]:
    """What is left in a node's TMPDIR (torch's elastic agent keeps its own folder there)."""
    return [name for name in os.listdir(tmp) if not name.startswith("torchelastic_")]


@pytest.mark.slow
def test_two_nodes_of_two_workers_equal_one_node_and_a_killed_node_keeps_the_old_output(tmp_path):
    """`varlen run` (analyze, sort, plan) on 4 ranks over two nodes: the metrics, sorted rows and plan of
    one process. The source has 3 work units and 1 chunk job: ranks with empty shares in analyze and
    plan. Then a node killed (agent and workers, SIGKILL) while analyze runs: the other node fails, the
    previous output is intact, and nothing of varlen's is left in a node's TMPDIR."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.analyze_helpers import ipc_bytes, read_metrics, text_table, write_parquet
    from tests.test_output_safety import tree_hash
    from varlen_cli.runtime import artifacts

    (tmp_path / "src").mkdir()
    for k in range(3):  # 3 files of one row group: 3 work units for 4 ranks
        write_parquet(text_table(60, seed=k, first_id=60 * k), tmp_path / "src" / f"{k}.parquet", row_group_size=100)
    args = [*RUN, "--length", "chars:text"]
    one = subprocess.run([sys.executable, "-m", "varlen_cli", *args, "-o", "one"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-2000:]
    nodes = _wait(c10d_nodes([*args, "-o", "two"], tmp_path))
    assert [code for code, _ in nodes] == [0, 0], nodes[0][1][-2000:] + nodes[1][1][-2000:]
    for stage in ("metrics", "sorted"):
        assert ipc_bytes(read_metrics(tmp_path / "two" / stage)) == ipc_bytes(read_metrics(tmp_path / "one" / stage))
    parts = artifacts.read_manifest(str(tmp_path / "two" / "metrics"))["parts"]
    assert len(parts) == 4 and sorted(p["rows"] for p in parts) == [0, 60, 60, 60]  # a rank without a unit
    assert pq.read_table(tmp_path / "two" / "plan.parquet").equals(pq.read_table(tmp_path / "one" / "plan.parquet"))
    assert _left_in(tmp_path / "tmp0") == [] and _left_in(tmp_path / "tmp1") == []

    before = tree_hash(str(tmp_path / "two"))
    pa.parquet.write_table(text_table(60, seed=9), tmp_path / "src" / "3.parquet")
    procs = c10d_nodes([*args, "-o", "two", "--overwrite"], tmp_path,
                       env_of=lambda node: {"VARLEN_PAUSE": "analyze.unit"} if node == 1 else {})
    deadline = time.monotonic() + 120
    while not any(name.startswith(".two.varlen-tmp") for name in os.listdir(tmp_path)):
        assert time.monotonic() < deadline and procs[0].poll() is None, "the run never started"
        time.sleep(0.1)
    time.sleep(1.0)  # node 1's workers are paused in analyze; node 0's wait for them
    _kill_node(procs[1].pid)
    (code0, err0), _ = _wait(procs, timeout=120)  # node 0 fails in seconds: its peers' sockets or the store died
    assert code0 != 0, err0[-2000:]
    assert tree_hash(str(tmp_path / "two")) == before
    assert _left_in(tmp_path / "tmp0") == []
