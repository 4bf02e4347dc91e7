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


def _live_children_cpu() -> float:
    """CPU of this process's live child processes, with that of the children they reaped (/proc:
    utime, stime, cutime, cstime): the test launcher's zygote (tests/launcher.py) and the ranks it
    forked. Read from /proc, not from the launcher: benchmarks import nothing from tests/. A child
    reaped during a test moves from here to RUSAGE_CHILDREN with its final CPU: counted once."""
    ticks = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as fh:
                pids = fh.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    ticks += sum(int(x) for x in fh.read().rsplit(")", 1)[1].split()[11:15])
            except OSError:  # gone meanwhile: reaped, so counted in RUSAGE_CHILDREN
                pass
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _live_children_cpu()


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
