"""tests/launcher.py's log directories and varlen's clean-up of launcher directories.

`test_recipes.py::...[ddp]` once failed under load with FileNotFoundError .../varlen-launch-*/rank-0.out
and passed alone: varlen removes `varlen-launch-<pid>-...` directories of processes that no longer run
(safety.clean_launcher_dirs, run by every output lock, in any concurrent test), and the test launcher
named its directories `varlen-launch-<random>`: a random part of digits only reads as the pid of a
dead process, and the directory went while the ranks wrote into it."""

from __future__ import annotations

import os
import tempfile

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
