"""A pytest plugin: the CPU seconds of every test (this process, its reaped children, and the test
launcher's zygote with the ranks it forked: tests/launcher.py), sorted, in CPU_REPORT (default
cpu_report.txt). CPU time, not wall time: a shared machine's load distorts it much less.

    PYTHONPATH=.:benchmarks python -m pytest -q -n 0 -p pytest_cpu tests/... ; sort -rn cpu_report.txt | head
"""

from __future__ import annotations

import os
import resource
import time

import pytest

_rows: list = []


def _zygote_cpu() -> float:
    """The zygote's own CPU and that of the ranks it reaped (/proc: utime, stime, cutime, cstime)."""
    try:
        import tests.launcher as launcher

        zygote = launcher._zygote
        if zygote is None or zygote.proc.poll() is not None:
            return 0.0
        fields = open(f"/proc/{zygote.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (ImportError, OSError, AttributeError):
        return 0.0


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _zygote_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.time()
    yield
    _rows.append((_cpu() - cpu, time.time() - wall, item.nodeid))


def pytest_sessionfinish(session, exitstatus):
    with open(os.environ.get("CPU_REPORT", "cpu_report.txt"), "w") as fh:
        for cpu, wall, nodeid in sorted(_rows, reverse=True):
            fh.write(f"{cpu:7.2f} {wall:7.2f} {nodeid}\n")
        fh.write(f"TOTAL {sum(r[0] for r in _rows):.1f}\n")
