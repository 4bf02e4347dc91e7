"""``varlen analyze`` with object-storage sources and outputs, against the moto S3 server:
identical metrics to local files (1 and 2 workers), freshness by ETag, one-line errors for bad
input (exit 3, nothing written), and atomic remote outputs (a failure leaves nothing visible)."""

from __future__ import annotations

import json
import os
import re

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from tests.analyze_helpers import ipc_bytes, read_metrics, run, text_table, write_jsonl, write_parquet, write_text
from tests.conftest import assert_user_error
from varlen_cli import storage
from varlen_cli.cli import app


def _corpus(folder) -> pa.Table:
    """Text in Parquet (several row groups), JSONL and text files: several units each."""
    texts = pa.concat_tables([text_table(300, seed=s, first_id=1000 * s) for s in range(3)])
    os.makedirs(folder, exist_ok=True)
    write_parquet(texts.slice(0, 300), os.path.join(folder, "a.parquet"), row_group_size=40)
    write_jsonl(texts.slice(300, 300), os.path.join(folder, "b.jsonl"))
    write_text(texts.slice(600, 300).column("text").to_pylist(), os.path.join(folder, "c.txt"))
    with open(os.path.join(folder, "README.md"), "w") as fh:
        fh.write("not data\n")
    return texts


def _comparable(manifest: dict) -> dict:
    """What must not depend on where the files are: rows per file, sizes, formats, stats."""
    files = [{k: f[k] for k in ("path", "size", "rows", "format")} for f in manifest["dataset"]["files"]]
    return {"files": files, "digest": manifest["dataset"]["digest"], "stats": manifest["stats"],
            "num_rows": manifest["num_rows"]}


def test_s3_metrics_equal_local(tmp_path, s3):
    _corpus(tmp_path / "src")
    url = s3.upload_tree(str(tmp_path / "src"), s3.bucket(), "corpus")
    opts = dict(chunk_bytes=4096, length="words:text")
    local, one = run(tmp_path / "local", str(tmp_path / "src" / "*"), **opts)
    remote, two = run(tmp_path / "remote", url + "/*", **opts)
    assert ipc_bytes(two) == ipc_bytes(one) and one.num_rows == 900
    assert _comparable(remote.manifest) == _comparable(local.manifest)
    entries = remote.manifest["dataset"]["files"]
    assert remote.manifest["dataset"]["root"] == url
    assert all("etag" in e and "mtime_ns" not in e for e in entries)  # freshness by ETag, not time
    # a prefix walks the folder, skipping README.md, as a local directory would: here with a glob per format
    prefix_run, three = run(tmp_path / "prefix", url + "/**/*.parquet", **opts)
    assert three.num_rows == 300


@pytest.mark.slow
def test_s3_two_workers_equal_one(tmp_path, s3):
    _corpus(tmp_path / "src")
    url = s3.upload_tree(str(tmp_path / "src"), s3.bucket(), "corpus")
    opts = dict(chunk_bytes=4096, length="chars:text")
    _, local = run(tmp_path / "local", str(tmp_path / "src" / "*"), **opts)
    _, one = run(tmp_path / "one", url + "/*", **opts)
    res, two = run(tmp_path / "two", url + "/*", nproc=2, **opts)
    assert ipc_bytes(one) == ipc_bytes(local) == ipc_bytes(two)
    assert res.manifest["world_size"] == 2 and len(res.manifest["parts"]) == 2


def test_prefix_source_and_freshness(tmp_path, s3):
    """A prefix is a directory; plan refuses metrics whose object changed (same size, new ETag)."""
    bucket = s3.bucket()
    table = text_table(200, seed=7)
    write_parquet(table.replace_schema_metadata({"v": "1"}), tmp_path / "a.parquet", row_group_size=50)
    s3.client.upload_file(str(tmp_path / "a.parquet"), bucket, "d/a.parquet")
    before = s3.client.head_object(Bucket=bucket, Key="d/a.parquet")
    s3.client.put_object(Bucket=bucket, Key="d/_SUCCESS", Body=b"")
    s3.client.put_object(Bucket=bucket, Key="d/.hidden/x.parquet", Body=b"junk")
    runner = CliRunner()
    result = runner.invoke(app, ["analyze", f"s3://{bucket}/d/", "-o", str(tmp_path / "m"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert read_metrics(tmp_path / "m").num_rows == 200
    plan_args = ["plan", str(tmp_path / "m"), "-o", str(tmp_path / "plan.parquet"), "--max-tokens", "4096"]
    assert runner.invoke(app, plan_args).exit_code == 0
    # the same rows, one byte of schema metadata other: the same size, other bytes
    write_parquet(table.replace_schema_metadata({"v": "2"}), tmp_path / "b.parquet", row_group_size=50)
    s3.client.upload_file(str(tmp_path / "b.parquet"), bucket, "d/a.parquet")
    after = s3.client.head_object(Bucket=bucket, Key="d/a.parquet")
    assert after["ContentLength"] == before["ContentLength"] == os.path.getsize(tmp_path / "b.parquet")
    assert after["ETag"] != before["ETag"]
    result = runner.invoke(app, [*plan_args, "--overwrite"])
    assert_user_error(result, 3, re.compile(rf"{re.escape(str(tmp_path / 'm'))} is stale: source s3://{bucket}/d/"
                                            r"a\.parquet was modified \(etag .*--allow-stale.*"))
    assert runner.invoke(app, [*plan_args, "--overwrite", "--allow-stale"]).exit_code == 0


def _bad_cases(s3, bucket, closed_port: int):
    return {
        "missing key": ([f"s3://{bucket}/nope.parquet"], rf"source s3://{bucket}/nope\.parquet does not exist.*", {}),
        "missing bucket": (["s3://no-such-bucket-x/d/"], r"source s3://no-such-bucket-x/d/ does not exist.*", {}),
        "glob matches nothing": ([f"s3://{bucket}/d/*.jsonl"],
                                 rf"no data files \(Parquet, Arrow, JSONL, text\) match s3://{bucket}/d/\*\.jsonl",
                                 {}),
        "unreachable endpoint": ([f"s3://{bucket}/d/a.parquet"], rf"cannot reach s3://{bucket}/d/a\.parquet: .*",
                                 {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port}"}),
        "bad storage option": ([f"s3://{bucket}/d/a.parquet", "--storage-option", "novalue"],
                               r"--storage-option expects key=value, got 'novalue'", {}),
    }


@pytest.mark.parametrize("case", ["missing key", "missing bucket", "glob matches nothing", "unreachable endpoint",
                                  "bad storage option"])
def test_bad_input(tmp_path, s3, monkeypatch, closed_port, case):
    bucket = s3.bucket()
    write_parquet(text_table(20), tmp_path / "a.parquet")
    s3.client.upload_file(str(tmp_path / "a.parquet"), bucket, "d/a.parquet")
    args, message, env = _bad_cases(s3, bucket, closed_port)[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    result = CliRunner().invoke(app, ["analyze", *args, "-o", str(tmp_path / "out"), "--no-progress"])
    assert_user_error(result, 2 if case == "bad storage option" else 3, re.compile(message))
    assert not os.path.exists(tmp_path / "out")
    assert [k for k in s3.keys(bucket) if not k.startswith("d/")] == []


def test_bad_credentials(tmp_path, s3, iam_auth):
    result = CliRunner().invoke(app, ["analyze", "s3://any-bucket/d/", "-o", str(tmp_path / "out")])
    assert_user_error(result, 3, re.compile(r"access to s3://any-bucket/d/ was denied \(check the credentials and "
                                            r"permissions\): .*"))
    assert not os.path.exists(tmp_path / "out")


def test_missing_client_package_names_the_extra(tmp_path):
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    result = CliRunner().invoke(app, ["analyze", "gs://bucket/data/", "-o", str(tmp_path / "out")])
    assert_user_error(result, 3, 'reading gs://bucket/data/ needs gcsfs: pip install "varlen-cli[gcs]"')
    assert not os.path.exists(tmp_path / "out")


def test_storage_option_reaches_the_client(tmp_path, s3, monkeypatch):
    """With no endpoint in the environment, --storage-option endpoint_url=... finds the server."""
    bucket = s3.bucket()
    write_parquet(text_table(30), tmp_path / "a.parquet")
    s3.client.upload_file(str(tmp_path / "a.parquet"), bucket, "d/a.parquet")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    result = CliRunner().invoke(app, ["analyze", f"s3://{bucket}/d/", "-o", str(tmp_path / "m"), "--no-progress",
                                      "--storage-option", f"endpoint_url={s3.endpoint}", "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "m" / "_manifest.json").read_text())
    assert manifest["config"]["storage_options"] == ["endpoint_url=***"]  # values are never recorded


# -- outputs in object storage -------------------------------------------------------------------------
def _raising_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "boom_mod.py").write_text(
        "def boom(batch):\n    raise ValueError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "boom_mod:boom"


def test_output_to_s3_is_atomic(tmp_path, s3, monkeypatch):
    bucket = s3.bucket()
    (tmp_path / "src").mkdir()
    write_parquet(text_table(120), tmp_path / "src" / "a.parquet", row_group_size=30)
    out = f"s3://{bucket}/runs/metrics"
    runner = CliRunner()
    ok = runner.invoke(app, ["analyze", str(tmp_path / "src"), "-o", out, "--no-progress"])
    assert ok.exit_code == 0, ok.output
    first = s3.keys(bucket)
    assert first == ["runs/metrics/_manifest.json", "runs/metrics/part-00000.parquet"]
    manifest = s3.client.get_object(Bucket=bucket, Key="runs/metrics/_manifest.json")["Body"].read()

    # exists without --overwrite: exit 4, untouched
    again = runner.invoke(app, ["analyze", str(tmp_path / "src"), "-o", out, "--no-progress"])
    assert_user_error(again, 4, f"output {out} already exists; pass --overwrite to replace it")
    # a failing run with --overwrite leaves the old output exactly as it was, and no temporary prefix
    fail = runner.invoke(app, ["analyze", str(tmp_path / "src"), "-o", out, "--overwrite", "--no-progress",
                               "--difficulty", _raising_module(tmp_path, monkeypatch)])
    assert fail.exit_code == 3, fail.output
    assert s3.keys(bucket) == first
    assert s3.client.get_object(Bucket=bucket, Key="runs/metrics/_manifest.json")["Body"].read() == manifest
    # a failure with no previous output leaves nothing at all
    fresh = f"s3://{bucket}/runs/other"
    fail = runner.invoke(app, ["analyze", str(tmp_path / "src"), "-o", fresh, "--no-progress",
                               "--difficulty", "boom_mod:boom"])
    assert fail.exit_code == 3 and s3.keys(bucket) == first
    # --overwrite replaces a varlen output, never a prefix varlen did not make
    s3.client.put_object(Bucket=bucket, Key="theirs/data.bin", Body=b"x")
    theirs = runner.invoke(app, ["analyze", str(tmp_path / "src"), "-o", f"s3://{bucket}/theirs", "--overwrite"])
    assert_user_error(theirs, 4, re.compile(r"output s3://.*/theirs is a prefix varlen did not make .*"))
    redo = runner.invoke(app, ["analyze", str(tmp_path / "src"), "-o", out, "--overwrite", "--no-progress"])
    assert redo.exit_code == 0 and s3.keys(bucket) == [*first, "theirs/data.bin"]


def test_output_inside_an_input_prefix_is_refused(tmp_path, s3):
    bucket = s3.bucket()
    write_parquet(text_table(10), tmp_path / "a.parquet")
    s3.client.upload_file(str(tmp_path / "a.parquet"), bucket, "d/a.parquet")
    result = CliRunner().invoke(app, ["analyze", f"s3://{bucket}/d", "-o", f"s3://{bucket}/d/metrics"])
    assert_user_error(result, 4, f"output s3://{bucket}/d/metrics lies inside the input s3://{bucket}/d; write the "
                                 "output elsewhere")


@pytest.mark.slow
def test_sort_and_two_worker_analyze_to_s3(tmp_path, s3):
    bucket = s3.bucket()
    write_parquet(text_table(300, seed=2), tmp_path / "a.parquet", row_group_size=40)
    _, local = run(tmp_path / "local", tmp_path / "a.parquet")
    from varlen_cli.analyze import AnalyzeConfig, analyze

    res = analyze(AnalyzeConfig(sources=(str(tmp_path / "a.parquet"),), output=f"s3://{bucket}/m", nproc=2,
                                progress=False))
    assert res.output == f"s3://{bucket}/m" and s3.keys(bucket) == [
        "m/_manifest.json", "m/part-00000.parquet", "m/part-00001.parquet"]
    import pyarrow.parquet as pq

    fs, path = storage.arrow_filesystem(f"s3://{bucket}/m")
    remote = pa.concat_tables([pq.read_table(f"{path}/part-0000{r}.parquet", filesystem=fs) for r in (0, 1)])
    assert ipc_bytes(remote) == ipc_bytes(local)
    result = CliRunner().invoke(app, ["sort", str(tmp_path / "local"), "-o", f"s3://{bucket}/sorted", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "sorted/_manifest.json" in s3.keys(bucket)


def test_plan_to_s3(tmp_path, s3):
    """A plan file written to object storage: one PUT at the end; --overwrite only over a plan."""
    bucket = s3.bucket()
    write_parquet(text_table(80), tmp_path / "a.parquet")
    run(tmp_path / "m", tmp_path / "a.parquet")
    runner = CliRunner()
    target = f"s3://{bucket}/plans/plan.parquet"
    args = ["plan", str(tmp_path / "m"), "-o", target, "--max-tokens", "2048"]
    assert runner.invoke(app, args).exit_code == 0
    assert s3.keys(bucket) == ["plans/plan.parquet"]
    assert_user_error(runner.invoke(app, args), 4, f"output {target} already exists; pass --overwrite to replace it")
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0
    s3.client.put_object(Bucket=bucket, Key="plans/other.parquet", Body=b"not a plan")
    other = ["plan", str(tmp_path / "m"), "-o", f"s3://{bucket}/plans/other.parquet", "--max-tokens", "2048",
             "--overwrite"]
    assert_user_error(runner.invoke(app, other), 4,
                      f"output s3://{bucket}/plans/other.parquet is not a varlen plan; --overwrite replaces only "
                      "varlen outputs")
    local = tmp_path / "plan.parquet"
    s3.client.download_file(bucket, "plans/plan.parquet", str(local))
    assert runner.invoke(app, ["validate", str(local), "--metrics", str(tmp_path / "m")]).exit_code == 0
