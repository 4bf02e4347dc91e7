"""Object storage never loses what varlen did not write, and never hangs (issue 31), against the moto
S3 server and misbehaving real socket servers (tests/storage/fake_store.py).

Every refusal is checked with its exact message and exit code, and with the bucket listed (and each
object's bytes compared) before and after: nothing of the user's is deleted, nothing is left behind.
docs/commands.md "Output safety" and docs/analyze.md "Outputs in object storage" / "Timeouts" list
what these tests hold.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from typer.testing import CliRunner

from tests.analyze_helpers import run, text_table, write_parquet
from tests.conftest import assert_user_error
from tests.storage.fake_store import FakeS3, Proxy, SilentStore
from varlen_cli import storage
from varlen_cli.cli import app
from varlen_cli.errors import InputError, UsageError
from varlen_cli.runtime import remote_output

runner = CliRunner()
PLAN = ["--max-tokens", "4096"]


def _snapshot(s3, bucket: str) -> dict[str, bytes]:
    """Every object of the bucket and its bytes."""
    return {k: s3.client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in s3.keys(bucket)}


@pytest.fixture(autouse=True)
def _fresh_storage():
    """A command's --storage-option stays this process's default: each test starts and ends without."""
    storage.configure(None)
    storage.clear_cache()
    yield
    storage.configure(None)
    storage.clear_cache()


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """src/a.parquet (a source) and m/ (its metrics), local."""
    root = tmp_path_factory.mktemp("trust")
    (root / "src").mkdir()
    write_parquet(text_table(120, seed=3), root / "src" / "a.parquet", row_group_size=30)
    run(root / "m", root / "src" / "a.parquet")
    return root


@pytest.fixture(scope="module")
def built(s3_server, local) -> str:
    """A bucket with d/a.parquet, d/b.parquet (sources), m/ (varlen metrics of d/) and the user's
    keep/README.md, made once; each case works on a copy."""
    storage.clear_cache()
    storage.configure(None)
    bucket = s3_server.bucket()
    for name in ("a.parquet", "b.parquet"):
        s3_server.client.upload_file(str(local / "src" / "a.parquet"), bucket, f"d/{name}")
    s3_server.client.put_object(Bucket=bucket, Key="keep/README.md", Body=b"the user's")
    assert runner.invoke(app, ["analyze", f"s3://{bucket}/d", "-o", f"s3://{bucket}/m"]).exit_code == 0
    return bucket


def _copy(s3, built: str) -> str:
    bucket = s3.bucket()
    for key in s3.keys(built):
        s3.client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": built, "Key": key})
    return bucket


def _user_objects(s3, b: str) -> None:
    """What a user adds into varlen's outputs: m/README.md, m/eval/results.json, an old-style commit
    marker at the bucket root (an older varlen left it), a note in sorted/."""
    for key in ("m/README.md", "m/eval/results.json"):
        s3.client.put_object(Bucket=b, Key=key, Body=b"mine")
    s3.client.put_object(Bucket=b, Key="_varlen_commit.json", Body=json.dumps({"from": f"s3://{b}/.x.varlen-tmp-1"}))


# -- bad inputs -> (exit code, message), nothing lost ------------------------------------------------
# Each case: (command line with B = the bucket and L = the local workspace, exit code, message
# (a re pattern where it names a port), environment). Every case runs on a copy of `built` plus
# _user_objects, listed before and after.
CASES = {
    "--overwrite of a varlen output holding user objects": (
        "analyze L/src -o s3://B/m --overwrite", 4,
        "output s3://B/m holds objects varlen did not write (README.md, eval/); --overwrite replaces only what "
        "varlen made: move them out first", {}),
    "sort --overwrite, a note in the sorted output": (
        "sort s3://B/m -o s3://B/sorted --overwrite", 4,
        "output s3://B/sorted holds objects varlen did not write (notes.txt); --overwrite replaces only what varlen "
        "made: move them out first", {}),
    "--overwrite of a prefix varlen did not make": (
        "analyze L/src -o s3://B/keep --overwrite", 4,
        "output s3://B/keep is a prefix varlen did not make (no varlen _manifest.json or _run.json); --overwrite "
        "replaces only varlen outputs", {}),
    "bucket root": (
        "analyze L/src -o s3://B --overwrite", 4,
        "output s3://B is a whole bucket: varlen writes an output beside its temporary, inside a bucket, and "
        "replaces only what it wrote; give a prefix such as s3://B/metrics", {}),
    "bucket root with a slash": (
        "analyze L/src -o s3://B/", 4,
        "output s3://B/ is a whole bucket: varlen writes an output beside its temporary, inside a bucket, and "
        "replaces only what it wrote; give a prefix such as s3://B/metrics", {}),
    "plan to a bucket root": (
        "plan L/m -o s3://B --max-tokens 4096 --overwrite", 4,
        "output s3://B is a whole bucket: varlen writes an output beside its temporary, inside a bucket, and "
        "replaces only what it wrote; give a key such as s3://B/plan.parquet", {}),
    "plan to a key ending in /": (
        "plan L/m -o s3://B/dir/ --max-tokens 4096", 4,
        "output s3://B/dir/ ends with '/', which names a folder; give a file name such as s3://B/dir/plan.parquet",
        {}),
    "plan to a local name ending in /": (
        "plan L/m -o L/newdir/ --max-tokens 4096", 4,
        "output L/newdir/ ends with '/', which names a folder; give a file name such as L/newdir/plan.parquet", {}),
    "plan inside its own metrics": (
        "plan s3://B/m -o s3://B/m/plan.parquet --max-tokens 4096", 4,
        "output s3://B/m/plan.parquet lies inside the input s3://B/m; write the output elsewhere", {}),
    "output inside an input named by a ? glob": (
        "analyze s3://B/d/?.parquet -o s3://B/d/metrics", 4,
        "output s3://B/d/metrics lies inside the input s3://B/d/?.parquet; write the output elsewhere", {}),
    "output inside an input named by a [ glob": (
        "analyze s3://B/d/[ab].parquet -o s3://B/d/metrics", 4,
        "output s3://B/d/metrics lies inside the input s3://B/d/[ab].parquet; write the output elsewhere", {}),
    "output holding an input's glob folder": (
        "analyze s3://B/d/sub/*.parquet -o s3://B/d --overwrite", 4,
        "output s3://B/d contains the input s3://B/d/sub/*.parquet; write the output elsewhere", {}),
    "an empty segment in the output's key": (  # it left a temporary under "/d/..." and ended in an internal error
        "analyze L/src -o s3://B//d/m", 4,
        "output s3://B//d/m has an empty segment ('//') in its key, which object-storage listings do not keep "
        "(varlen could not find what it wrote); give s3://B/d/m", {}),
    "directory output is an object": (
        "analyze L/src -o s3://B/keep/README.md --overwrite", 4,
        "output s3://B/keep/README.md exists and is not a directory", {}),
    "missing bucket (output)": (
        "analyze L/src -o s3://no-such-bucket-31/m", 4, "cannot write s3://no-such-bucket-31/m/: no such bucket", {}),
    "missing bucket (plan output)": (
        "plan L/m -o s3://no-such-bucket-31/p.parquet --max-tokens 4096", 4,
        "cannot write s3://no-such-bucket-31/p.parquet: no such bucket", {}),
    "closed port (output)": (
        "analyze L/src -o s3://B/new", 4,
        re.compile(r'cannot reach s3://B/new: Could not connect to the endpoint URL: "http://127\.0\.0\.1:\d+/B/new"'),
        {"AWS_ENDPOINT_URL": "closed"}),
    "closed port (plan output)": (
        "plan L/m -o s3://B/p.parquet --max-tokens 4096", 4,
        re.compile(r'cannot reach s3://B/p\.parquet: Could not connect to the endpoint URL: "http://127\.0\.0\.1:\d+/'
                   r'\S+"'), {"AWS_ENDPOINT_URL": "closed"}),
    "config_kwargs not a JSON object": (
        "analyze L/src -o s3://B/new --storage-option config_kwargs=notadict", 2,
        '--storage-option config_kwargs must be a JSON object such as {"region_name": "eu-west-1"}, got \'notadict\'',
        {}),
    "read_timeout not a number": (
        "analyze s3://B/d -o L/out --storage-option read_timeout=soon", 2,
        "--storage-option read_timeout must be a number of seconds > 0 (such as 30), got 'soon'", {}),
    "a timeout of 0": (
        'analyze L/src -o s3://B/new --storage-option config_kwargs={"read_timeout":0}', 2,
        "--storage-option config_kwargs.read_timeout must be a number of seconds > 0 (such as 30), got 0", {}),
    "retries not a JSON object": (
        'plan L/m -o s3://B/p.parquet --max-tokens 4096 --storage-option config_kwargs={"retries":3}', 2,
        '--storage-option config_kwargs.retries must be a JSON object such as {"total_max_attempts": 3}, got 3', {}),
    "unknown config_kwargs key": (
        'analyze s3://B/d -o L/out --storage-option config_kwargs={"read_timout":3}', 2,
        "unknown key read_timout in --storage-option config_kwargs (the keywords of botocore's Config: "
        "connect_timeout, read_timeout, retries, region_name, max_pool_connections...)", {}),
    "unknown s3 option": (
        "sort s3://B/m -o s3://B/sorted2 --storage-option bogus=1", 2,
        "unknown --storage-option bogus for s3:// (the keywords of s3fs.S3FileSystem: endpoint_url, anon, key, "
        "secret, token, profile, client_kwargs, config_kwargs...)", {}),
    "asynchronous true": (  # "cannot write ...: Loop is not running", exit 4
        "analyze L/src -o s3://B/new --storage-option asynchronous=true", 2,
        "--storage-option asynchronous is not for varlen: it calls the store synchronously, with s3fs's own event loop",
        {}),
    "anon not a boolean": (
        "analyze s3://B/d -o L/out --storage-option anon=5", 2, "--storage-option anon must be true or false, got 5",
        {}),
}


def _fill(text: str, bucket: str, ws) -> str:
    return text.replace("s3://B", f"s3://{bucket}").replace("/B/", f"/{bucket}/").replace("L/", f"{ws}/")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_loses_nothing(s3, built, local, tmp_path, monkeypatch, closed_port, case):
    bucket = _copy(s3, built)
    _user_objects(s3, bucket)
    if case.startswith("sort --overwrite"):
        assert runner.invoke(app, ["sort", f"s3://{bucket}/m", "-o", f"s3://{bucket}/sorted"]).exit_code == 0
        s3.client.put_object(Bucket=bucket, Key="sorted/notes.txt", Body=b"mine")
    if not case.startswith(("--overwrite of a varlen", "sort", "bucket root")):
        for key in ("m/README.md", "m/eval/results.json"):  # m/ stays a clean varlen output
            s3.client.delete_object(Bucket=bucket, Key=key)
    command, code, message, env = CASES[case]
    ws = tmp_path / "ws"
    os.symlink(local, ws)  # L/ in the messages: a short path of this test's own
    for k, v in env.items():
        monkeypatch.setenv(k, f"http://127.0.0.1:{closed_port}" if v == "closed" else v)
    storage.clear_cache()
    before = _snapshot(s3, bucket)
    result = runner.invoke(app, _fill(command, bucket, ws).split())
    if isinstance(message, re.Pattern):
        message = re.compile(_fill(message.pattern, re.escape(bucket), ws))
    else:
        message = _fill(message, bucket, ws)
    assert_user_error(result, code, message)
    assert _snapshot(s3, bucket) == before  # nothing deleted, nothing added (no temporary left)
    assert not os.path.exists(local / "out") and not os.path.exists(local / "newdir")


def test_bad_credentials_on_the_output_side_are_exit_4(s3, local, iam_auth):
    result = runner.invoke(app, ["analyze", str(local / "src"), "-o", "s3://any-bucket-31/m"])
    assert_user_error(result, 4, re.compile(r"access to s3://any-bucket-31/m was denied \(check the credentials and "
                                            r"permissions\): .*"))


# -- what --overwrite replaces -----------------------------------------------------------------------
def test_overwrite_replaces_exactly_what_varlen_wrote(s3, built, local):
    """A publish killed after its commit marker: --overwrite refuses while a user object is there, then
    replaces exactly the objects the marker lists (the new output's parts count may differ)."""
    bucket = _copy(s3, built)
    m = f"s3://{bucket}/m"
    s3.client.delete_object(Bucket=bucket, Key="m/_manifest.json")  # the old manifest goes first
    s3.client.put_object(Bucket=bucket, Key="m/part-00001.parquet", Body=b"a new part, half copied")
    marker = {"format": "varlen-commit", "from": f"s3://{bucket}/.m.varlen-tmp-0123456789ab",
              "files": ["_manifest.json", "part-00000.parquet", "part-00001.parquet"],
              "replaces": ["_manifest.json", "part-00000.parquet"]}
    s3.client.put_object(Bucket=bucket, Key="m/_varlen_commit.json", Body=json.dumps(marker))
    s3.client.put_object(Bucket=bucket, Key="m/notes.txt", Body=b"mine")
    args = ["analyze", str(local / "src"), "-o", m, "--overwrite"]
    before = _snapshot(s3, bucket)
    assert_user_error(runner.invoke(app, args), 4, f"output {m} holds objects varlen did not write (notes.txt); "
                                                   "--overwrite replaces only what varlen made: move them out first")
    assert _snapshot(s3, bucket) == before
    s3.client.delete_object(Bucket=bucket, Key="m/notes.txt")
    assert runner.invoke(app, args).exit_code == 0
    assert s3.keys(bucket) == ["d/a.parquet", "d/b.parquet", "keep/README.md", "m/_manifest.json",
                               "m/part-00000.parquet"]
    manifest = json.loads(s3.client.get_object(Bucket=bucket, Key="m/_manifest.json")["Body"].read())
    assert manifest["num_rows"] == 120


def test_stale_temporaries_are_removed_only_varlen_s_own(s3, built, local):
    """Temporaries beside the output: a killed run's of this host (dead pid) is removed, a live run's and
    a young one of another host stay; objects varlen does not write there, and prefixes of other names,
    stay; an old one without an owner record goes after STALE_TMP_S."""
    import platform
    import subprocess
    import sys

    bucket = _copy(s3, built)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owners = {"0000000000a1": dead.pid, "0000000000a2": os.getppid()}
    for tag, pid in owners.items():
        owner = json.dumps({"pid": pid, "host": platform.node(), "time": time.time()})
        s3.client.put_object(Bucket=bucket, Key=f".new.varlen-tmp-{tag}/_varlen_tmp.json", Body=owner)
        s3.client.put_object(Bucket=bucket, Key=f".new.varlen-tmp-{tag}/part-00000.parquet", Body=b"part")
    other = json.dumps({"pid": 1, "host": "another-host", "time": time.time()})
    s3.client.put_object(Bucket=bucket, Key=".new.varlen-tmp-0000000000b1/_varlen_tmp.json", Body=other)
    s3.client.put_object(Bucket=bucket, Key=".new.varlen-tmp-0000000000a1/mine.txt", Body=b"mine")
    s3.client.put_object(Bucket=bucket, Key=".new.varlen-tmp-notours/x", Body=b"mine")
    s3.client.put_object(Bucket=bucket, Key=".newer.varlen-tmp-0000000000c1/part-00000.parquet", Body=b"part")
    s3.client.put_object(Bucket=bucket, Key=".new.varlen-tmp-0000000000d1/part-00000.parquet", Body=b"old")
    assert runner.invoke(app, ["analyze", str(local / "src"), "-o", f"s3://{bucket}/new"]).exit_code == 0
    tmps = [k for k in s3.keys(bucket) if ".varlen-tmp-" in k]
    assert tmps == [".new.varlen-tmp-0000000000a1/mine.txt", ".new.varlen-tmp-0000000000a2/_varlen_tmp.json",
                    ".new.varlen-tmp-0000000000a2/part-00000.parquet", ".new.varlen-tmp-0000000000b1/_varlen_tmp.json",
                    ".new.varlen-tmp-0000000000d1/part-00000.parquet", ".new.varlen-tmp-notours/x",
                    ".newer.varlen-tmp-0000000000c1/part-00000.parquet"]
    later = time.time() + remote_output.STALE_TMP_S + 60
    removed = remote_output.clean_stale_temporaries(f"s3://{bucket}/new", now=later)
    assert removed == [f"s3://{bucket}/.new.varlen-tmp-0000000000{t}" for t in ("a1", "a2", "b1", "d1")]
    assert [k for k in s3.keys(bucket) if ".varlen-tmp-" in k] == [
        ".new.varlen-tmp-0000000000a1/mine.txt", ".new.varlen-tmp-notours/x",
        ".newer.varlen-tmp-0000000000c1/part-00000.parquet"]


# -- stores that misbehave: no hang, exit 3 on the input side, 4 on the output side -----------------------
READ_TIMEOUT_HINT = (r"\(the store did not answer within the read timeout; --storage-option read_timeout=SECONDS "
                     r"sets it\)")


@pytest.mark.parametrize("side", ["input", "output"])
def test_silent_store_fails_in_seconds(s3, local, tmp_path, monkeypatch, side):
    """An endpoint that accepts TCP and never answers: one line within seconds (a read timeout of 0.2 s,
    at most 4 attempts), exit 3 for a source, 4 for an output."""
    with SilentStore() as store:
        monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)
        storage.clear_cache()
        src, out = ("s3://data-31/d/a.parquet", str(tmp_path / "out")) if side == "input" else (
            str(local / "src"), "s3://data-31/m")
        t0 = time.monotonic()
        result = runner.invoke(app, ["analyze", src, "-o", out, "--storage-option", "read_timeout=0.2"])
        elapsed = time.monotonic() - t0
    where = src if side == "input" else out
    assert_user_error(result, 3 if side == "input" else 4, re.compile(
        rf'cannot reach {re.escape(where)}: Read timeout on endpoint URL: "http://127\.0\.0\.1:\d+/\S+" '
        + READ_TIMEOUT_HINT))
    assert elapsed < 15, elapsed
    assert not os.path.exists(tmp_path / "out")


def test_default_timeouts_reach_the_client(s3):
    """Every s3 request gets varlen's connect and read timeouts and at most 2 attempts (s3fs: 2 more);
    the options change them."""
    fs, _ = storage.filesystem("s3://any/x")
    config = fs.s3.meta.config
    assert (config.connect_timeout, config.read_timeout) == (5.0, 10.0) and fs.retries == 2
    assert config.retries == {"total_max_attempts": 2, "mode": "standard"}
    fs, _ = storage.filesystem("s3://any/x", ["connect_timeout=1", "read_timeout=2.5"])
    assert (fs.s3.meta.config.connect_timeout, fs.s3.meta.config.read_timeout) == (1.0, 2.5)
    timeout = storage.filesystem("https://host/x.parquet", ["read_timeout=3"])[0].client_kwargs["timeout"]
    assert (timeout.sock_connect, timeout.sock_read) == (5.0, 3.0)


@pytest.mark.parametrize("mode,command", [("keeps_nothing", "plan"), ("keeps_nothing", "analyze"),
                                          ("silent_on_put", "plan"), ("dies_on_put", "analyze")])
def test_uploads_to_a_misbehaving_store(local, monkeypatch, mode, command):
    """A store that answers an upload 200 and keeps nothing (read back: refused), one that never answers
    an upload (no wait for '100 Continue': a read timeout), one that dies on it: exit 4 within seconds,
    for a plan and a directory output."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    args, key = {"plan": (["plan", str(local / "m"), "-o", "s3://b31/p.parquet", *PLAN], r"p\.parquet"),
                 "analyze": (["analyze", str(local / "src"), "-o", "s3://b31/m"],
                             r"\.m\.varlen-tmp-[0-9a-f]{12}/_varlen_tmp\.json")}[command]
    with FakeS3(mode) as store:
        monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)
        t0 = time.monotonic()
        result = runner.invoke(app, [*args, "--storage-option", "read_timeout=0.2"])
        assert time.monotonic() - t0 < 15
    loc, url = rf"s3://b31/{key}", rf'endpoint URL: "http://127\.0\.0\.1:\d+/b31/{key}"'
    assert_user_error(result, 4, re.compile({
        "keeps_nothing": rf"the store did not keep {loc}: it accepted \d+ bytes, reading it back finds nothing there",
        "silent_on_put": rf"cannot reach {loc}: Read timeout on {url} {READ_TIMEOUT_HINT}",
        "dies_on_put": rf"cannot reach {loc}: Connection was closed before we received a valid response from {url}\.",
    }[mode]))


# -- SourceDataset reads through the same layer ------------------------------------------------------------
def test_source_dataset_when_the_store_dies(s3, tmp_path):
    """A store that dies while SourceDataset reads: one InputError line, not the client's exception."""
    from varlen_cli.loader import SourceDataset

    bucket = s3.bucket()
    import numpy as np
    import pyarrow as pa

    texts = np.random.default_rng(5).integers(0, 1 << 62, size=(4000, 4)).astype(str)
    table = pa.table({"text": [" ".join(row) for row in texts]})  # ~190 KB: more than the 64 KiB tail read
    write_parquet(table, tmp_path / "a.parquet", row_group_size=1000)
    s3.client.upload_file(str(tmp_path / "a.parquet"), bucket, "d/a.parquet")
    run(tmp_path / "m", f"s3://{bucket}/d/a.parquet")
    host, port = s3.endpoint.rsplit("/", 1)[-1].split(":")
    with Proxy((host, int(port))) as proxy:
        ds = SourceDataset(tmp_path / "m", storage_options={"endpoint_url": proxy.endpoint}, cache_bytes=0)
        assert ds[0]["text"] == table["text"][0].as_py()
        proxy.kill()
        with pytest.raises(InputError) as err:
            ds[1500]  # another row group: a new range request (no cache: cache_bytes=0)
    assert re.fullmatch(rf'cannot reach s3://{bucket}/d/a\.parquet: Could not connect to the endpoint URL: '
                        r'"http://127\.0\.0\.1:\d+/\S+"', str(err.value)), str(err.value)


def test_source_dataset_bad_storage_option(s3, tmp_path):
    from varlen_cli.loader import SourceDataset

    bucket = s3.bucket()
    write_parquet(text_table(10), tmp_path / "a.parquet")
    s3.client.upload_file(str(tmp_path / "a.parquet"), bucket, "d/a.parquet")
    run(tmp_path / "m", f"s3://{bucket}/d/a.parquet")
    with pytest.raises(UsageError, match=r"^--storage-option config_kwargs must be a JSON object such as "
                                         r"\{\"region_name\": \"eu-west-1\"\}, got 'notadict'$"):
        SourceDataset(tmp_path / "m", storage_options={"config_kwargs": "notadict"})
