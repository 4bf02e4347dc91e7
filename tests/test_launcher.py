"""tests/launcher.py's log directories and varlen's clean-up of launcher directories.

`test_recipes.py::...[ddp]` once failed under load with FileNotFoundError .../varlen-launch-*/rank-0.out
and passed alone: varlen removes `varlen-launch-<pid>-...` directories of processes that no longer run
(safety.clean_launcher_dirs, run by every output lock, in any concurrent test), and the test launcher
named its directories `varlen-launch-<random>`: a random part of digits only reads as the pid of a
dead process, and the directory went while the ranks wrote into it."""

from __future__ import annotations

import json
import os
import re
import tempfile

import pytest

from tests import launcher
from varlen_cli.runtime import safety


def test_a_launch_directory_survives_varlens_cleanup_of_dead_launchers():
    live = tempfile.mkdtemp(prefix=f"varlen-launch-{os.getpid()}-")  # as launcher.launch names it
    digits = tempfile.mkdtemp(prefix="varlen-launch-")  # the old naming, whose random part was all digits ...
    old_style = os.path.join(os.path.dirname(digits), "varlen-launch-40000000")  # ... a pid that is not running
    os.rename(digits, old_style)
    try:
        safety.clean_launcher_dirs()
        assert os.path.isdir(live) and not os.path.exists(old_style)
    finally:
        for d in (live, old_style):
            if os.path.isdir(d):
                os.rmdir(d)


def test_a_rank_that_never_started_is_reported_not_a_file_not_found(tmp_path):
    (tmp_path / "rank-0.out").write_text("started\n")
    assert launcher.read_log(str(tmp_path), 0, "out") == "started\n"
    assert "rank 1 wrote no stdout: it was stopped before it started" in launcher.read_log(str(tmp_path), 1, "out")


ENV_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
seen = {"env": dict(os.environ), "rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(total)}
with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.json"), "w") as fh:
    json.dump(seen, fh)
dist.destroy_process_group()
from varlen_cli.errors import PlanError
raise PlanError("the plan was made for 3 data-parallel rank(s) but the world size is 2: re-plan with --dp 2")
"""
REFUSAL = "the plan was made for 3 data-parallel rank(s) but the world size is 2: re-plan with --dp 2"
# what may differ between two launches, or between torchrun --standalone and tests/launcher.py: the port,
# the run id and error file path of each launch; MASTER_ADDR localhost (torchrun) vs 127.0.0.1 (the same host)
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR"}


@pytest.mark.slow
def test_the_launcher_gives_every_rank_torchruns_environment_and_a_refusal_is_one_line(tmp_path):
    """The check of tests/launcher.py against the real torchrun (the framework tests run their ranks under
    the launcher; test_hf's padded run under the real torchrun too): every variable torchrun gives its
    workers, the same values, and a process group that joins and reduces the same way. The script then
    lets a PlanError escape (as a training script's refusal): under both, each rank prints its one line
    and no traceback, and torchrun's closing summary ends with the line (it used to end with "To enable
    traceback see: ..." after a traceback per rank; varlen_cli/errors/entry.py)."""
    from tests.integration_helpers import real_torchrun

    script = tmp_path / "env.py"
    script.write_text(ENV_SCRIPT)
    seen = {}
    for how in ("torchrun", "launcher"):
        (tmp_path / how).mkdir()
        run = real_torchrun if how == "torchrun" else launcher.launch
        proc = run(str(script), str(tmp_path / how))
        ranks = sorted(line for line in proc.stderr.splitlines() if re.match(r"(\[rank\d\]: )?varlen: error: ", line))
        # varlen's hook is torch's previous one in the launcher's ranks (the zygote imported varlen before the
        # rank joined the group): torch then says the rank, "[rank0]: ", and varlen's line does not repeat it
        said = ([f"varlen: error: [rank {r}] {REFUSAL}" for r in (0, 1)] if how == "torchrun" else
                [f"[rank{r}]: varlen: error: {REFUSAL}" for r in (0, 1)])
        assert proc.returncode != 0 and ranks == said, proc.stderr
        assert 'File "' + str(script) not in proc.stderr, proc.stderr  # no worker traceback
        seen[how] = [json.loads((tmp_path / how / f"rank-{r}.json").read_text()) for r in range(2)]
        if how == "torchrun":
            summary = [line for line in proc.stderr.splitlines() if line.strip("=- ")]
            assert summary[-1].startswith("  traceback : varlen: error: [rank ") and REFUSAL in summary[-1], \
                summary[-12:]
    own = dict(os.environ, **launcher.STATIC_ENV)
    for rank, (real, ours) in enumerate(zip(seen["torchrun"], seen["launcher"])):
        added = {k: v for k, v in real["env"].items() if own.get(k) != v}  # what torchrun gives a worker
        assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE"} <= set(added)
        assert set(added) <= set(ours["env"]), set(added) - set(ours["env"])
        assert {k: v for k, v in added.items() if k not in PER_LAUNCH} == \
            {k: ours["env"][k] for k in added if k not in PER_LAUNCH}
        assert (real["rank"], real["world"], real["sum"]) == (ours["rank"], ours["world"], ours["sum"]) == (rank, 2, 3)
