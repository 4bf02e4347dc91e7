"""``varlen_cli.storage``: the one API for local paths and object storage (against the moto server)."""

from __future__ import annotations

import pytest

from varlen_cli import storage
from varlen_cli.errors import InputError, UsageError


def test_parse_options():
    assert storage.parse_options(["anon=true", "endpoint_url=http://x:1/", 'client_kwargs={"region_name": "eu"}',
                                  "n=3", "s=a=b"]) == {
        "anon": True, "endpoint_url": "http://x:1/", "client_kwargs": {"region_name": "eu"}, "n": 3, "s": "a=b"}
    assert storage.parse_options(None) == {} and storage.parse_options({"a": 1}) == {"a": 1}
    with pytest.raises(UsageError, match="--storage-option expects key=value, got 'novalue'"):
        storage.parse_options(["novalue"])
    assert storage.redacted(["key=SECRET", "anon=true"]) == ["key=***", "anon=***"]


def test_url_paths():
    assert storage.is_remote("s3://b/k") and not storage.is_remote("/a/b") and not storage.is_remote("file:///a")
    assert storage.local_path("file:///a/b") == "/a/b" and not storage.is_remote("C:\\data\\x")
    assert storage.join("s3://b/data/", "x", "y.parquet") == "s3://b/data/x/y.parquet"
    assert storage.parent("s3://b/data/x.parquet") == "s3://b/data" and storage.name("s3://b/d/x.pq") == "x.pq"
    assert storage.relpath("s3://b/data/sub/x", "s3://b/data") == "sub/x"
    assert storage.common_root(["s3://b/data/a/x", "s3://b/data/b/y"]) == "s3://b/data"
    assert storage.common_root(["s3://b/data/x", "gs://b/data/y"]) == ""
    assert storage.under("a/x.parquet", "s3://b/data") == "s3://b/data/a/x.parquet"
    assert storage.under("x.parquet", "/local") == "/local/x.parquet"


@pytest.mark.parametrize("message, said", [
    ('Read timeout on endpoint URL: "http://127.0.0.1:34011/b/k"', "cannot reach"),  # a port holding 401
    ("Cannot connect to host 127.0.0.1:40312 ssl:default [Connection refused]", "cannot reach"),  # and 403
    ("Could not connect to the endpoint URL: http://127.0.0.1:14040/b/k", "cannot reach"),  # and 404
    ("An error occurred (403) when calling the PutObject operation: Forbidden", "was denied"),
    ("An error occurred (401) when calling the HeadObject operation: Unauthorized", "was denied"),
    ("Client error 403 for url", "was denied"),
    ("An error occurred (404) when calling the HeadObject operation: Not Found", "does not exist"),
])
def test_an_http_status_is_a_word_of_the_message_not_digits_of_a_port(message, said):
    """A store's error is named by its status (401/403: denied, 404: missing) only where the message
    says the status; the random port of a URL (127.0.0.1:34011) made a read timeout 'access denied'."""
    assert said in storage.describe_error("s3://b/k", OSError(message))


def test_local_and_remote_alike(tmp_path, s3):
    bucket = s3.bucket()
    data = bytes(range(256)) * 10
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "x.bin").write_bytes(data)
    (tmp_path / "d" / "y.bin").write_bytes(b"y")
    url = s3.upload_tree(str(tmp_path / "d"), bucket, "d")
    for root in (str(tmp_path / "d"), url):
        x = storage.join(root, "sub", "x.bin")
        assert storage.read_range(x, 10, 20) == data[10:20]
        assert storage.read_bytes(x) == data and storage.stat(x).size == len(data)
        with storage.open_input(x) as fh:
            fh.seek(100)
            assert fh.read(5) == data[100:105]
        assert [storage.relpath(p, root) for p in storage.find(root)] == ["sub/x.bin", "y.bin"]
        assert [storage.relpath(p, root) for p in storage.glob(storage.join(root, "**", "*.bin"))] == [
            "sub/x.bin", "y.bin"]
        assert storage.isdir(root) and storage.isfile(x) and not storage.exists(storage.join(root, "nope"))
    info = storage.stat(f"{url}/y.bin")
    assert info.etag and storage.fingerprint_fields(info) == {"etag": info.etag}
    assert set(storage.fingerprint_fields(storage.stat(str(tmp_path / "d" / "y.bin")))) == {"mtime_ns"}


def test_missing_objects_are_one_line(s3):
    bucket = s3.bucket()
    with pytest.raises(InputError, match=rf"^s3://{bucket}/nope does not exist \(no such object\)$"):
        storage.stat(f"s3://{bucket}/nope")
    with pytest.raises(InputError, match=r"^s3://no-such-bucket-y/k does not exist \(no such bucket\)$"):
        storage.read_range("s3://no-such-bucket-y/k", 0, 3)


def test_writes(s3):
    bucket = s3.bucket()
    storage.write_bytes(f"s3://{bucket}/o/a", b"abc")
    storage.write_bytes(f"s3://{bucket}/o/b/c", b"d")
    assert s3.keys(bucket) == ["o/a", "o/b/c"]
    storage.remove(f"s3://{bucket}/o/", recursive=True)
    assert s3.keys(bucket) == []
