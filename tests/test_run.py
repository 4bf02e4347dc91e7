"""`varlen run`: the whole pipeline in one launch, its outputs, and its failure behaviour."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.conftest import sample
from varlen_cli.errors import InputError, OutputError, UsageError
from varlen_cli.run import RunConfig, run
from varlen_cli.validate import ValidateConfig, validate


def _cli(*args, cwd=None):
    env = dict(os.environ, VARLEN_NO_PROGRESS="1")
    return subprocess.run([sys.executable, "-m", "varlen_cli", *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_quick_start_run_needs_only_source_and_output(tmp_path):
    out = tmp_path / "out"
    proc = _cli("run", sample("tokenized.parquet"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["_run.json", "metrics", "plan.parquet"]
    manifest = json.loads((out / "_run.json").read_text())
    assert manifest["auto_max_tokens"] == 16384 and manifest["plan"]["num_steps"] > 0
    assert "varlen run" in proc.stdout and "padding %" in proc.stdout
    result = validate(ValidateConfig(str(out / "plan.parquet"), metrics=str(out / "metrics")))
    assert result.ok, result.violations


def test_run_curriculum_two_workers_matches_one_worker(tmp_path):
    """Analyze + sort distributed in one process group, then plan: same plan as with one worker."""
    common = dict(analyze={"tokenizer": sample("tokenizer.json"), "length": "tokens:text"},
                  plan={"order": "curriculum", "dp": 2, "grad_accum": 2, "max_tokens": 2048}, progress=False)
    one = run(RunConfig(sources=(sample("text.parquet"),), output=str(tmp_path / "one"), **common))
    two = run(RunConfig(sources=(sample("text.parquet"),), output=str(tmp_path / "two"), nproc=2, **common))
    assert one.sort is not None and two.sort is not None
    assert two.analyze.num_parts == 2
    a = pq.read_table(tmp_path / "one" / "plan.parquet")
    b = pq.read_table(tmp_path / "two" / "plan.parquet")
    assert a.equals(b)
    assert pq.read_table(tmp_path / "one" / "sorted").equals(pq.read_table(tmp_path / "two" / "sorted"))
    assert validate(ValidateConfig(str(tmp_path / "two" / "plan.parquet"), metrics=str(tmp_path / "two" / "sorted"))).ok


def test_run_failure_leaves_no_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(InputError, match="samples do not fit the budget --max-tokens 100"):
        run(RunConfig(sources=(sample("tokenized.parquet"),), output=str(out), plan={"max_tokens": 100}, progress=False))
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path)] == []


def test_run_refuses_existing_output_and_unknown_stage_option(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        run(RunConfig(sources=(sample("tokenized.parquet"),), output=str(out)))
    with pytest.raises(UsageError, match="unknown plan option"):
        run(RunConfig(sources=(sample("tokenized.parquet"),), output=str(tmp_path / "x"), plan={"budget": 3}))
