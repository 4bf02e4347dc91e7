"""``varlen analyze`` over real gloo process groups: 1 vs 2 workers, the --nproc launcher, failures.

Each launch costs a few seconds (process start + torch import), so each test checks several things.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from tests.analyze_helpers import (
    ipc_bytes,
    leftovers,
    read_metrics,
    run,
    text_table,
    write_jsonl,
    write_parquet,
    write_text,
)
from tests.conftest import ROOT, sample
from varlen_cli.errors import InputError, WorkerError
from varlen_cli.runtime import artifacts

TOK = sample("tokenizer.json")
RUNTIME_KEYS = {"created_at", "world_size", "parts", "host", "python"}


def _mixed_sources(tmp_path):
    """Text in three formats, several units each (Parquet row groups, JSONL and text byte chunks)."""
    texts = pa.concat_tables([text_table(400, seed=s, first_id=1000 * s) for s in range(3)])
    write_parquet(texts.slice(0, 400), tmp_path / "a.parquet", row_group_size=50)
    write_jsonl(texts.slice(400, 400), tmp_path / "b.jsonl")
    write_text(texts.slice(800, 400).column("text").to_pylist(), tmp_path / "c.txt", newline="\r\n")
    return [tmp_path / "a.parquet", tmp_path / "b.jsonl", tmp_path / "c.txt"], texts


def _comparable(manifest: dict) -> dict:
    m = {k: v for k, v in manifest.items() if k not in RUNTIME_KEYS}
    m["config"] = {k: v for k, v in m["config"].items() if k not in artifacts.RUNTIME_FIELDS}
    return m


def test_two_workers_equal_one_worker(tmp_path):
    sources, texts = _mixed_sources(tmp_path)
    opts = dict(length="tokens:text", tokenizer=TOK, difficulty="vocab-rarity", chunk_bytes=2048)
    res1, one = run(tmp_path / "one", *sources, **opts)
    res2, two = run(tmp_path / "two", *sources, nproc=2, **opts)
    # Byte-identical concatenated output, for a two-pass distributed metric over three formats.
    assert ipc_bytes(two) == ipc_bytes(one)
    assert one.column("sample_id").to_pylist() == list(range(1200))
    m1, m2 = artifacts.read_manifest(str(tmp_path / "one")), artifacts.read_manifest(str(tmp_path / "two"))
    assert m2["world_size"] == 2 and [p["file"] for p in m2["parts"]] == ["part-00000.parquet", "part-00001.parquet"]
    assert all(p["rows"] > 0 for p in m2["parts"]) and sum(p["rows"] for p in m2["parts"]) == 1200
    assert _comparable(m2) == _comparable(m1)
    assert m2["artifact_id"] == m1["artifact_id"] and m2["config"]["nproc"] == 2
    assert res2.num_samples == 1200 and res2.num_parts == 2 and res2.stats == res1.stats
    assert [f["rows"] for f in m2["dataset"]["files"]] == [400, 400, 400]
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # no temporary directories


def test_nproc_launcher_from_the_command_line(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, VARLEN_NO_PROGRESS="1", COLUMNS="120")
    cmd = [sys.executable, "-m", "varlen_cli", "analyze", sample("audio_manifest.jsonl"), sample("text.jsonl"),
           "-o", str(out), "--length", "value:duration", "--frames-per-second", "50", "--nproc", "2"]
    # The two files do not share the column: a user error in one worker is the job's one-line error.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"varlen: error: column 'duration' not found in {sample('text.jsonl')} (columns: id, text)")
    assert leftovers(tmp_path) == []
    shutil.copy(sample("audio_manifest.jsonl"), tmp_path / "b.jsonl")  # two files: two work units, two workers
    cmd[cmd.index(sample("text.jsonl"))] = str(tmp_path / "b.jsonl")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "2,000" in proc.stdout and "value:duration" in proc.stdout and "parts" in proc.stdout
    m = artifacts.read_manifest(str(out))
    assert m["world_size"] == 2 and len(m["parts"]) == 2
    _, ref = run(tmp_path / "ref", sample("audio_manifest.jsonl"), str(tmp_path / "b.jsonl"), length="value:duration",
                 frames_per_second=50.0)
    assert ipc_bytes(read_metrics(out)) == ipc_bytes(ref)


def test_worker_killed_fails_the_job_and_a_rerun_succeeds(tmp_path, monkeypatch):
    sources, _ = _mixed_sources(tmp_path)
    monkeypatch.setenv("VARLEN_FAULT", "analyze.unit:1")
    monkeypatch.setenv("VARLEN_TIMEOUT", "60")
    with pytest.raises(WorkerError) as err:
        run(tmp_path / "out", *sources, length="chars:text", nproc=2, chunk_bytes=2048)
    assert err.value.exit_code == 5 and "worker 1" in err.value.message
    assert leftovers(tmp_path) == []
    monkeypatch.delenv("VARLEN_FAULT")
    res, got = run(tmp_path / "out", *sources, length="chars:text", chunk_bytes=2048)
    assert res.num_samples == 1200 and leftovers(tmp_path) == ["out"]


def test_user_error_in_one_worker(tmp_path):
    """Bad values only in the second worker's rows: its InputError is the job's error; nothing is left."""
    n = np.arange(1000, dtype=np.float64)
    n[900] = -5.0
    write_parquet(pa.table({"n": n}), tmp_path / "n.parquet", row_group_size=100)
    with pytest.raises(InputError) as err:
        run(tmp_path / "out", tmp_path / "n.parquet", length="value:n", nproc=2)
    assert err.value.message == f"column 'n' has 1 negative values in {tmp_path / 'n.parquet'} (first: -5)"
    assert leftovers(tmp_path) == []
