"""``varlen sort`` with real gloo process groups: 2, 3 and 4 local workers give byte-identical
concatenated output to 1 worker, balanced; a worker that dies fails the whole job, leaves nothing,
and a re-run succeeds. Several sorts share one launch to keep process starts few."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.sort.test_sort import mixed_kind_keys
from tests.sort_helpers import (
    distribution,
    manifest_of,
    metrics_columns,
    read_sorted,
    reference_order,
    sort_many,
    write_metrics,
)
from varlen_cli.errors import WorkerError
from varlen_cli.runtime import dist
from varlen_cli.sort import SortConfig, sort

N = 20_011


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sortdist")
    rng = np.random.default_rng(7)
    # A: a metrics directory as analyze writes it: contiguous ids, integral difficulty, 90% one value.
    a = metrics_columns(distribution("90%-one-value", N, seed=1))
    # B: fractional float keys (two-word composite key), ids not contiguous (a sorted directory).
    b = metrics_columns(np.round(rng.normal(size=N), 3), lengths=rng.integers(0, 9, N),
                        ids=rng.permutation(N).astype(np.int64) * 3 + 11)
    c = metrics_columns(np.full(N, 5.0))  # all keys equal
    tiny = metrics_columns([2.0, 0.0, 1.0])
    # D: integral keys in the first and last third, fractional ones in the middle: each of 3 ranks
    # sees one kind only, so the key coding must be chosen over all ranks.
    d = metrics_columns(mixed_kind_keys(N), lengths=np.ones(N, dtype=np.int64))
    empty = metrics_columns(np.zeros(0))
    paths = {
        "a": write_metrics(root / "a", a, parts=3, row_group_size=4000),
        "b": write_metrics(root / "b", b, parts=[5000, 0, N - 5000], row_group_size=3000),
        "c": write_metrics(root / "c", c, parts=1),
        "tiny": write_metrics(root / "tiny", tiny, parts=1),
        "d": write_metrics(root / "d", d, parts=3),
        "empty": write_metrics(root / "empty", empty, parts=[0]),
    }
    return root, paths, {"a": a, "b": b, "c": c, "d": d, "tiny": tiny, "empty": empty}


def _cfg(src, out, **kw) -> SortConfig:
    return SortConfig(metrics_dir=src, output=str(out), progress=False, **kw)


def _same_rows(path_x, path_y) -> None:
    x, y = read_sorted(path_x), read_sorted(path_y)
    assert x.schema == y.schema and x.num_rows == y.num_rows
    for name in x.column_names:
        assert x.column(name).to_numpy().tobytes() == y.column(name).to_numpy().tobytes(), name


def _one_worker(root, src, name, **kw):
    out = root / f"{name}-p1"
    if not out.exists():
        sort(_cfg(src, out, **kw))
    return out


B_ORDER = dict(by=("difficulty", "length"), descending=True, ties="shuffle", seed=12345)


def test_worker_death_fails_the_job_then_rerun_succeeds(data, monkeypatch):
    root, paths, cols = data
    out = root / "a-p2"
    monkeypatch.setenv("VARLEN_FAULT", "sort.exchange:1")
    with pytest.raises(WorkerError) as err:
        sort(_cfg(paths["a"], out, nproc=2))
    assert err.value.exit_code == 5
    assert err.value.message == "worker 1 was killed by signal 9; all workers were stopped"
    assert not out.exists() and not (root / ".a-p2.varlen-tmp").exists()
    monkeypatch.delenv("VARLEN_FAULT")

    res = sort(_cfg(paths["a"], out, nproc=2))
    assert res.world_size == 2 and res.rows_per_worker == [N // 2, N - N // 2] and res.balance <= 1.02
    _same_rows(out, _one_worker(root, paths["a"], "a"))
    a = cols["a"]
    got = read_sorted(out)
    want = np.lexsort((a["sample_id"], a["difficulty"]))
    assert np.array_equal(got.column("sample_id").to_numpy(), a["sample_id"][want])
    m = manifest_of(out)
    assert [p["rows"] for p in m["parts"]] == [N // 2, N - N // 2] and m["world_size"] == 2
    assert m["parts"][0]["last_key"] <= m["parts"][1]["first_key"]


@pytest.mark.slow
def test_three_workers(data):
    """The torch-free local group (what ``--nproc 3`` on the CPU uses)."""
    root, paths, cols = data
    configs = [
        _cfg(paths["a"], root / "a-p3"),
        _cfg(paths["a"], root / "a-p3-torch", engine="torch"),
        _cfg(paths["a"], root / "a-p3-single", single_file=True, row_group_size=3000),
        _cfg(paths["b"], root / "b-p3", **B_ORDER),
        _cfg(paths["d"], root / "d-p3"),
    ]
    results = dist.launch(sort_many, configs, 3)
    assert [r.world_size for r in results] == [3, 3, 3, 3, 3]
    d = cols["d"]
    assert np.array_equal(read_sorted(root / "d-p3").column("sample_id").to_numpy(),
                          d["sample_id"][reference_order(d, ("difficulty",))])
    del results[4]
    _same_rows(root / "a-p3", _one_worker(root, paths["a"], "a"))
    _same_rows(root / "a-p3-torch", root / "a-p3")
    del results[1]
    _same_rows(root / "a-p3-single", root / "a-p3")
    assert os.listdir(root / "a-p3-single") == ["_manifest.json", "part-00000.parquet"] or sorted(
        os.listdir(root / "a-p3-single")) == ["_manifest.json", "part-00000.parquet"]
    single = manifest_of(root / "a-p3-single")
    assert single["parts"][0]["rows"] == N and single["rows_per_worker"] == results[1].rows_per_worker
    _same_rows(root / "b-p3", _one_worker(root, paths["b"], "b", **B_ORDER))
    b = cols["b"]
    order = reference_order(b, ("difficulty", "length"), True, "shuffle", 12345)
    assert np.array_equal(read_sorted(root / "b-p3").column("sample_id").to_numpy(), b["sample_id"][order])
    for r in results:
        assert max(r.rows_per_worker) - min(r.rows_per_worker) <= 1 and r.balance <= 1.02


@pytest.mark.slow
def test_four_workers(data, monkeypatch):
    """torch's elastic launcher and a gloo group (what torchrun and ``--device cuda`` use)."""
    monkeypatch.setenv("VARLEN_LAUNCHER", "torch")
    root, paths, cols = data
    configs = [
        _cfg(paths["a"], root / "a-p4-torch", engine="torch"),
        _cfg(paths["b"], root / "b-p4", **B_ORDER),
        _cfg(paths["c"], root / "c-p4"),
        _cfg(paths["tiny"], root / "tiny-p4", single_file=True),
        _cfg(paths["tiny"], root / "tiny-p4-parts"),
        _cfg(paths["empty"], root / "empty-p4"),
    ]
    results = dist.launch(sort_many, configs, 4)
    _same_rows(root / "a-p4-torch", _one_worker(root, paths["a"], "a"))
    _same_rows(root / "b-p4", _one_worker(root, paths["b"], "b", **B_ORDER))
    # All keys equal: still perfectly balanced (the splitters use the whole composite key).
    assert results[2].balance <= 1.02 and max(results[2].rows_per_worker) - min(results[2].rows_per_worker) <= 1
    assert np.array_equal(read_sorted(root / "c-p4").column("sample_id").to_numpy(), np.arange(N))
    # More workers than rows.
    for name in ("tiny-p4", "tiny-p4-parts"):
        assert read_sorted(root / name).column("sample_id").to_pylist() == [1, 2, 0]
    assert results[4].rows_per_worker == [0, 1, 1, 1] and len(manifest_of(root / "tiny-p4-parts")["parts"]) == 4
    assert results[3].num_parts == 1
    # Empty input: a valid empty output.
    assert results[5].num_rows == 0 and read_sorted(root / "empty-p4").num_rows == 0


@pytest.mark.slow
@pytest.mark.parametrize("single_file", [True, False], ids=["single-file", "parts"])
def test_full_disk_in_a_worker_is_an_output_error(data, tmp_path, single_file):
    """A file-size limit (RLIMIT_FSIZE, what `ulimit -f` sets: writes fail with EFBIG as on a full
    disk) under `sort --nproc 2`: the worker's OutputError keeps exit code 4 (it was 5 with
    --single-file), one line, and nothing is left beside the output."""
    import re
    import resource
    import subprocess
    import sys

    from tests.conftest import ROOT

    root, paths, _ = data
    limit = 16 << 10  # the sorted part is larger; the lock, the manifest and the error records are not

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = [sys.executable, "-m", "varlen_cli", "sort", paths["a"], "-o", str(tmp_path / "s"), "--nproc", "2",
            "--no-progress"] + (["--single-file"] if single_file else [])
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run(args, capture_output=True, text=True, env=env, preexec_fn=small_files, timeout=300)
    assert result.returncode == 4, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(r"varlen: error: cannot write .*/\.s\.varlen-tmp-[0-9a-f]+/"
                                            r"part-0000[01]\.parquet: .*File too large", lines[0]), lines
    assert os.listdir(tmp_path) == []
