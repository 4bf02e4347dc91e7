"""Counting the requests varlen sends to an S3-protocol server: every call of s3fs's one entry point
(``S3FileSystem._call_s3``, which every read, listing and HEAD goes through) is recorded with its
operation, key and byte range, then made as usual. For tests and ``benchmarks/bench_sources.py``:
which objects a command reads, and whether it reads them by range."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    op: str  # get_object, head_object, list_objects_v2, ...
    key: str | None
    range: tuple[int, int] | None  # [start, stop) of a ranged get_object

    @property
    def size(self) -> int | None:
        return None if self.range is None else self.range[1] - self.range[0]


def _range(header: str | None) -> tuple[int, int] | None:
    if not header:
        return None
    start, _, end = header.removeprefix("bytes=").partition("-")
    return int(start), int(end) + 1


@contextmanager
def s3_requests() -> Iterator[list[Request]]:
    """Record, in this process, every request s3fs sends while the block runs."""
    import s3fs

    log: list[Request] = []
    real = s3fs.S3FileSystem._call_s3

    async def recording(self, method, *args, **kwargs):
        log.append(Request(method, kwargs.get("Key"), _range(kwargs.get("Range"))))
        return await real(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = recording
    try:
        yield log
    finally:
        s3fs.S3FileSystem._call_s3 = real


def gets(log: list[Request], suffix: str = "") -> list[Request]:
    """The object reads (get_object) of keys ending with ``suffix``."""
    return [r for r in log if r.op == "get_object" and (r.key or "").endswith(suffix)]
