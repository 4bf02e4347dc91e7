"""A real S3-protocol server for the object-storage tests: moto's standalone server on 127.0.0.1
and a free port, one per test process (xdist-safe), reached by the same client code users run
(s3fs through :mod:`varlen_cli.storage`, configured by the standard ``AWS_*`` environment)."""

from __future__ import annotations

import os
import uuid

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3:
    """The running server: its endpoint, a boto3 client, and helpers to fill buckets."""

    def __init__(self, endpoint: str):
        import boto3

        self.endpoint = endpoint
        self.client = boto3.client("s3", endpoint_url=endpoint, **_boto_keys())

    def bucket(self) -> str:
        """A new empty bucket (tests never share one)."""
        name = f"t-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=name)
        return name

    def upload_tree(self, local_dir: str, bucket: str, prefix: str = "") -> str:
        """Upload every file below ``local_dir`` to ``s3://bucket/prefix``; returns that URL."""
        for d, _, names in os.walk(local_dir):
            for n in names:
                path = os.path.join(d, n)
                key = "/".join(p for p in (prefix, os.path.relpath(path, local_dir).replace(os.sep, "/")) if p)
                self.client.upload_file(path, bucket, key)
        return f"s3://{bucket}/{prefix}".rstrip("/")

    def keys(self, bucket: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _boto_keys() -> dict:
    return {"aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": S3_ENV["AWS_DEFAULT_REGION"]}


@pytest.fixture(scope="session")
def s3_server():
    """The server, with ``AWS_ENDPOINT_URL`` and test credentials in this process's environment
    (inherited by ``--nproc`` workers) for the session; restored afterwards."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        yield S3(endpoint)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def s3(s3_server):
    from varlen_cli import storage

    storage.clear_cache()  # a filesystem built under another environment is not reused
    storage.configure(None)
    return s3_server


@pytest.fixture
def iam_auth(s3):
    """Make the server check signatures (unknown keys are refused), as a real S3 does."""
    import urllib.request

    def reset(count: str) -> None:
        req = urllib.request.Request(f"{s3.endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(req, timeout=10).read()

    reset("0")
    try:
        yield
    finally:
        reset("inf")


@pytest.fixture
def closed_port():
    """A port of 127.0.0.1 that refuses connections: bound (never listening) for the whole test, so no
    other process, such as a test server of the other xdist worker, can take it meanwhile."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
