"""`varlen plan` in a torchrun job of two nodes (issue 25: multi-node planning).

Two torchrun agents on this machine stand for two nodes (``--nnodes 2 --node-rank 0|1``, one worker
each, static rendezvous at 127.0.0.1): each node's worker sees ``LOCAL_WORLD_SIZE=1`` and
``WORLD_SIZE=2``, as on a real two-node job with a shared filesystem. The plan must be the one a
single process writes (the same command), byte for byte. (A plan for object storage is refused:
tests/storage/test_s3_pipeline.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys

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

