"""The whole pipeline with every artifact in object storage (the moto S3 server): analyze -> sort ->
plan -> validate/inspect read metrics, sorted directories and plans from ``s3://`` through
:mod:`varlen_cli.storage`, and give the plan the all-local pipeline gives, with 1 and 2 workers."""

from __future__ import annotations

import json
import os
import re

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from tests.analyze_helpers import text_table, write_jsonl, write_parquet
from tests.conftest import assert_user_error
from varlen_cli import format, storage
from varlen_cli.cli import app

# What depends on where the artifacts are or when they were made, not on what was computed.
PLACE_KEYS = ("created_at", "config", "input")


def _corpus(folder) -> None:
    texts = pa.concat_tables([text_table(150, seed=s, first_id=1000 * s) for s in range(2)])
    os.makedirs(folder, exist_ok=True)
    write_parquet(texts.slice(0, 150), os.path.join(folder, "a.parquet"), row_group_size=40)
    write_jsonl(texts.slice(150, 150), os.path.join(folder, "b.jsonl"))


def _cli(*args: str) -> None:
    result = CliRunner().invoke(app, [*args, "--no-progress"] if args[0] in ("analyze", "sort", "plan") else args)
    assert result.exit_code == 0, result.output


def _pipeline(src: str, where: str, nproc: int) -> dict:
    """analyze, sort, plan, validate and inspect with every artifact below ``where``; the paths."""
    p = {k: storage.join(where, k) for k in ("metrics", "sorted", "plan.parquet")}
    _cli("analyze", src, "-o", p["metrics"], "--length", "words:text", "--nproc", str(nproc))
    _cli("sort", p["metrics"], "-o", p["sorted"], "--nproc", str(nproc))
    _cli("plan", p["sorted"], "-o", p["plan.parquet"], "--max-tokens", "512", "--dp", "2", "--order", "curriculum",
         "--seed", "3")
    _cli("validate", p["plan.parquet"], "--metrics", p["sorted"])
    _cli("validate", p["plan.parquet"], "--metrics", p["metrics"])
    return p


def _read_plan(path: str) -> tuple[pa.Table, dict]:
    pf, meta = format.open_plan_file(path)
    return pf.read(), meta


def _manifest(path: str) -> dict:
    return json.loads(storage.read_bytes(storage.join(path, format.MANIFEST_NAME)))


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_pipeline_on_s3_equals_local(tmp_path, s3, nproc):
    _corpus(tmp_path / "src")
    bucket = s3.bucket()
    url = s3.upload_tree(str(tmp_path / "src"), bucket, "corpus")
    (tmp_path / "out").mkdir()
    local = _pipeline(str(tmp_path / "src" / "*"), str(tmp_path / "out"), 1)
    remote = _pipeline(url + "/*", f"s3://{bucket}/out", nproc)
    assert s3.keys(bucket) == sorted([f"corpus/{n}" for n in ("a.parquet", "b.jsonl")] + [
        "out/plan.parquet", "out/metrics/_manifest.json", "out/sorted/_manifest.json",
        *[f"out/{d}/part-0000{r}.parquet" for d in ("metrics", "sorted") for r in range(nproc)]])
    for kind in ("metrics", "sorted"):  # the same dataset and rows (artifact ids also name the SOURCE given)
        got, want = _manifest(remote[kind]), _manifest(local[kind])
        assert got["dataset"]["digest"] == want["dataset"]["digest"] and got["stats"] == want["stats"]
        assert got["parts"] == want["parts"] if nproc == 1 else sum(p["rows"] for p in got["parts"]) == 300
    (t_remote, m_remote), (t_local, m_local) = _read_plan(remote["plan.parquet"]), _read_plan(local["plan.parquet"])
    assert t_remote.equals(t_local)  # the same plan rows, byte for byte in Arrow
    assert {k: v for k, v in m_remote.items() if k not in PLACE_KEYS + ("stats",)} == \
        {k: v for k, v in m_local.items() if k not in PLACE_KEYS + ("stats",)}
    assert {k: v for k, v in m_remote["stats"].items() if k != "seconds"} == \
        {k: v for k, v in m_local["stats"].items() if k != "seconds"}
    assert m_remote["input"]["path"] == remote["sorted"] and m_remote["input"]["relative_path"] is None
    assert {k: v for k, v in m_remote["input"].items() if "path" not in k and k != "artifact_id"} == \
        {k: v for k, v in m_local["input"].items() if "path" not in k and k != "artifact_id"}
    # --mix of directories in the store: the plan of the same directories locally
    mix = {k: f"a={where['metrics']}:1,b={where['sorted']}:0.5" for k, where in (("local", local), ("remote", remote))}
    for k, where in (("local", str(tmp_path / "mix.parquet")), ("remote", f"s3://{bucket}/mix.parquet")):
        _cli("plan", "--mix", mix[k], "-o", where, "--max-tokens", "512", "--seed", "2")
        _cli("validate", where)
    assert _read_plan(f"s3://{bucket}/mix.parquet")[0].equals(_read_plan(str(tmp_path / "mix.parquet"))[0])
    # inspect reads both kinds of artifact from the store
    for path, kind in ((remote["sorted"], "sorted"), (remote["plan.parquet"], "plan")):
        result = CliRunner().invoke(app, ["inspect", path, "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["kind"] == kind


def test_run_reads_s3_sources_with_storage_options(tmp_path, s3, monkeypatch):
    """`varlen run` takes --storage-option (given once, every stage gets it): with no endpoint in the
    environment the option finds the server; the run's record keeps the option names only."""
    _corpus(tmp_path / "src")
    url = s3.upload_tree(str(tmp_path / "src"), s3.bucket(), "corpus")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", url + "/*.parquet", "-o", str(out), "--length", "words:text",
                                      "--order", "curriculum", "--max-tokens", "512", "--no-progress",
                                      "--storage-option", f"endpoint_url={s3.endpoint}"])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "_run.json").read_text())["config"]
    assert record["analyze"]["storage_options"] == record["sort"]["storage_options"] == \
        record["plan"]["storage_options"] == ["endpoint_url=***"]
    assert json.loads((out / "metrics" / "_manifest.json").read_text())["dataset"]["root"] == url


def _bad_cases(b: str, tmp) -> dict:
    """(command, exit code, message) of artifacts in object storage that are missing, not varlen's, or
    unusable; ``b`` holds corpus/ (data), m/ (metrics), s/ (sorted), p.parquet (a plan)."""
    return {
        "missing metrics": (["plan", f"s3://{b}/nope", "-o", str(tmp / "p.parquet"), "--max-tokens", "512"], 3,
                            f"s3://{b}/nope does not exist"),
        "data, not metrics": (["sort", f"s3://{b}/corpus", "-o", str(tmp / "s")], 3,
                              f"s3://{b}/corpus is not a varlen metrics directory (no _manifest.json; or an output "
                              "still being published); create one with `varlen analyze`"),
        "a plan, not metrics": (["validate", f"s3://{b}/p.parquet", "--metrics", f"s3://{b}/p.parquet"], 3,
                                f"s3://{b}/p.parquet is not a varlen metrics directory; create one with "
                                "`varlen analyze`"),
        "missing plan": (["validate", f"s3://{b}/none.parquet"], 3,
                         f"s3://{b}/none.parquet does not exist (no such object)"),
        "data, not a plan": (["inspect", f"s3://{b}/corpus/b.jsonl"], 3,
                             f"s3://{b}/corpus/b.jsonl is not a readable Parquet file: "),
        "incomplete": (["plan", f"s3://{b}/m", "-o", str(tmp / "p.parquet"), "--max-tokens", "512"], 3,
                       f"s3://{b}/m is incomplete: part-00000.parquet listed in _manifest.json is missing"),
        "stale sorted": (["plan", f"s3://{b}/s", "-o", str(tmp / "p.parquet"), "--max-tokens", "512"], 3,
                         f"s3://{b}/s is stale: s3://{b}/m was rebuilt after it"),
        "replan of a remote plan": (["replan", f"s3://{b}/p.parquet", "-o", str(tmp / "r.parquet"), "--dp", "2",
                                     "--from-step", "0"], 3,
                                    f"plan s3://{b}/p.parquet is in object storage: replan and --extend read a local "
                                    "plan file; copy it to a local file first (its metrics may stay in object "
                                    "storage)"),
        "bad storage option": (["inspect", f"s3://{b}/m", "--storage-option", "novalue"], 2,
                               "--storage-option expects key=value, got 'novalue'"),
    }


BAD = ["missing metrics", "data, not metrics", "a plan, not metrics", "missing plan", "data, not a plan", "incomplete",
       "stale sorted", "replan of a remote plan", "bad storage option"]


@pytest.fixture(scope="module")
def built(s3_server, tmp_path_factory) -> str:
    """A bucket with corpus/ (data), m/ (its metrics), s/ (sorted) and p.parquet (a plan), made once."""
    storage.clear_cache()
    storage.configure(None)
    src = tmp_path_factory.mktemp("bad") / "src"
    _corpus(src)
    bucket = s3_server.bucket()
    s3_server.upload_tree(str(src), bucket, "corpus")
    _cli("analyze", f"s3://{bucket}/corpus/*", "-o", f"s3://{bucket}/m", "--length", "words:text")
    _cli("sort", f"s3://{bucket}/m", "-o", f"s3://{bucket}/s")
    _cli("plan", f"s3://{bucket}/s", "-o", f"s3://{bucket}/p.parquet", "--max-tokens", "512")
    return bucket


@pytest.mark.parametrize("case", BAD)
def test_bad_artifacts_in_object_storage_are_one_line(tmp_path, s3, built, case):
    bucket = s3.bucket()  # a copy of the built one, which this case may damage
    for key in s3.keys(built):
        s3.client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": built, "Key": key})
    if case == "incomplete":
        s3.client.delete_object(Bucket=bucket, Key="m/part-00000.parquet")
    if case == "stale sorted":  # the metrics rebuilt with other options after the sort (of this bucket's m/)
        _cli("sort", f"s3://{bucket}/m", "-o", f"s3://{bucket}/s", "--overwrite")
        _cli("analyze", f"s3://{bucket}/corpus/*", "-o", f"s3://{bucket}/m", "--length", "chars:text", "--overwrite")
    args, code, message = _bad_cases(bucket, tmp_path)[case]
    result = CliRunner().invoke(app, args)
    assert_user_error(result, code, re.compile(re.escape(message) + ".*"))
    assert not any(p.name.endswith(".parquet") for p in tmp_path.iterdir())


@pytest.mark.slow
def test_two_node_plan_to_s3_is_refused(tmp_path, s3):
    """A torchrun job of two nodes writing its plan to object storage has no shared place for the
    workers' chunk files: refused in one line on every node, nothing uploaded."""
    import numpy as np

    from tests.plan.test_multinode import PLAN, two_nodes
    from tests.plan_helpers import write_metrics

    write_metrics(tmp_path / "m", np.arange(1, 3001) % 500 + 1)
    bucket = s3.bucket()
    for node in two_nodes("plan", "m", "-o", f"s3://{bucket}/plan.parquet", *PLAN, cwd=tmp_path):
        assert node.returncode != 0
        assert re.search(r"varlen: error: \[rank [01]\] a plan written to object storage \(s3://\S+\) by a torchrun "
                         r"job on several nodes has no shared place for the workers' chunk files", node.stderr), \
            node.stderr[-2000:]
    assert s3.keys(bucket) == []
