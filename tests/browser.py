"""A real headless browser for the report tests: Debian's ``chromium`` (``.ci/run`` installs it).

Each call starts one Chromium with a fresh profile and no network services (the flags below), on
``file://`` pages: a screenshot (``--screenshot``) or the DOM after the page's scripts ran
(``--dump-dom``). Outside CI a machine without Chromium skips these tests; in CI (``CI`` set) it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--mute-audio", "--allow-file-access-from-files")  # a test page may read the reports it frames


def chromium() -> str:
    """The Chromium binary; skips the test without one (fails under CI, which installs it)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def run(url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Chromium on ``url`` with :data:`FLAGS`, a fresh ``--user-data-dir`` and ``args``."""
    binary = chromium()
    with tempfile.TemporaryDirectory(prefix="varlen-chromium-") as profile:
        proc = subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", *args, url], capture_output=True,
                              text=True, timeout=timeout, env=dict(os.environ, HOME=profile))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def screenshot(url: str, path: str, width: int, height: int) -> str:
    """A PNG of the page at ``width`` x ``height`` pixels."""
    run(url, f"--screenshot={path}", f"--window-size={width},{height}")
    assert os.path.getsize(path) > 0
    return path


def dump_dom(url: str, budget_ms: int = 5000) -> str:
    """The page's DOM after it loaded and its scripts ran (``--virtual-time-budget``)."""
    return run(url, "--dump-dom", f"--virtual-time-budget={budget_ms}").stdout
