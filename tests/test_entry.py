"""A varlen refusal is one line, also in a training script and under torchrun (varlen_cli/errors/entry.py):
an uncaught PlanError prints `varlen: error: [rank R] MESSAGE` instead of a traceback, the examples exit
with its code, and under torchrun the line is the rank's recorded error, which torchrun's summary ends
with (it used to say "To enable traceback see: ..." after a 44-97-line traceback per rank: under the
real torchrun in tests/test_launcher.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launcher import ROOT
from varlen_cli.errors import PlanError
from varlen_cli.errors.entry import error_line, exit_on_error, message_of


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT, **env})


def test_an_uncaught_plan_error_in_a_script_is_one_line(tmp_path):
    """A recipe (no helper): importing varlen_cli installs the hook; under torchrun it also writes the
    rank's error file; VARLEN_DEBUG=1 shows the traceback; other exceptions are untouched."""
    raise_it = "from varlen_cli.errors import PlanError\nraise PlanError('bad plan')"  # any varlen import hooks
    error_file = tmp_path / "error.json"
    proc = _python(raise_it, RANK="1", WORLD_SIZE="2", TORCHELASTIC_ERROR_FILE=str(error_file))
    assert proc.returncode == 1 and proc.stderr == "varlen: error: [rank 1] bad plan\n"
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "PlanError: bad plan"
    assert recorded["extraInfo"]["py_callstack"] == "varlen: error: [rank 1] bad plan"
    debug = _python(raise_it, VARLEN_DEBUG="1")
    assert "Traceback" in debug.stderr and debug.stderr.rstrip().endswith("PlanError: bad plan")
    other = _python("import varlen_cli\nraise ValueError('not ours')")
    assert "Traceback" in other.stderr and other.stderr.rstrip().endswith("ValueError: not ours")


def test_exit_on_error_exits_with_the_errors_code_and_finds_a_wrapped_one(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def wrapped():
        try:
            raise PlanError("inner cause")
        except PlanError as exc:
            raise RuntimeError("a framework's wrapper") from exc

    with pytest.raises(SystemExit) as stop:
        exit_on_error(wrapped)
    assert stop.value.code == 6 and capsys.readouterr().err == "varlen: error: inner cause\n"
    assert exit_on_error(lambda x: x + 1, 1) == 2
    with pytest.raises(KeyError):
        exit_on_error(lambda: {}["x"])


def test_a_dataloader_workers_error_is_its_last_line(monkeypatch):
    """torch re-raises a worker's exception with the worker's traceback as its message (PlanError keeps
    its own line itself; any other varlen error, such as a source's InputError, is cut here)."""
    import torch

    from varlen_cli.errors import InputError

    class Refusing(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            raise InputError("cannot read row 0 of s3://bucket/data.parquet")

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    loader = torch.utils.data.DataLoader(Refusing(), num_workers=1, multiprocessing_context="fork")
    with pytest.raises(InputError) as caught:
        next(iter(loader))
    assert "Original Traceback" in str(caught.value)
    assert message_of(caught.value) == "cannot read row 0 of s3://bucket/data.parquet"
    assert error_line(caught.value) == "varlen: error: cannot read row 0 of s3://bucket/data.parquet"
