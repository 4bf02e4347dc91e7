"""Stale inputs: refuse metrics whose sources changed after ``varlen analyze`` read them.

``varlen analyze`` records one fingerprint per source file (``dataset.files`` in the manifest; a
sorted directory copies the block), the same for every kind of source, made by :func:`record`:

============================ ===========================================================================
what                         recorded
============================ ===========================================================================
every file                   ``size``; local: ``mtime_ns`` and ``sample``, a hash of sampled blocks
                             (16 blocks of 4 KiB spread from its first byte to its last: the whole file
                             when it is at most 64 KiB); object storage: ``etag`` and ``version``
Parquet (local)              also ``footer`` (a hash of the footer: schema, row groups, statistics), and
                             the sample also covers the first 4 KiB of up to 32 column chunks (the
                             dictionary or first data page: the values the lengths come from)
Megatron ``.idx``, MDS       also ``companions``: the same record for each file the samples are read
``index.json``               from (the ``.bin``; every shard), paths relative to the dataset's root
============================ ===========================================================================

:func:`check_inputs` is the one check ``sort``, ``plan`` and ``validate --metrics`` run before
trusting a metrics or sorted directory (``SourceDataset`` calls :func:`stale_source`):

* every recorded file and companion must still exist with the same size and ``mtime_ns`` (object
  storage: ETag and version id, never a time), then the same footer and sample hashes (read only
  when the cheap fields match);
* a sorted directory's metrics directory must not have been rebuilt since
  (:func:`varlen_cli.runtime.artifacts.check_fresh`).

What is not detected: a local file rewritten with the same size and ``mtime_ns`` (put back with
``touch -r`` or ``os.utime``) whose changes all lie outside the sampled blocks (and, for Parquet,
leave the footer alone: only possible without statistics, at the same compressed sizes); an object
rewritten where the store keeps no ETag or version (a plain ``https://`` server: the size alone).

``--allow-stale`` (``allow_stale=True``) skips both, for data moved or copied on purpose (a copy
gets a new mtime). Manifests written before varlen recorded ``mtime_ns`` are not checked, and
fields a manifest lacks (``sample``, ``companions`` before this version) are not compared.
"""

from __future__ import annotations

import os

from .. import storage
from ..errors import InputError
from ..storage.files import open_regular
from . import artifacts

ALLOW_STALE_HINT = "pass --allow-stale if the data was moved or copied on purpose"


def check_inputs(path: str, manifest: dict, allow_stale: bool = False, rerun: str = "varlen sort") -> None:
    """Refuse the metrics or sorted directory ``path`` (its ``manifest``) when it is stale.

    ``rerun`` is the command that rebuilds ``path`` from a rebuilt metrics directory.
    """
    if allow_stale:
        return
    changed = stale_source(manifest)
    if changed is not None:
        source, why = changed
        raise InputError(f"{path} is stale: source {source} {why} since `varlen analyze` read it; "
                         f"re-run `varlen analyze`, or {ALLOW_STALE_HINT}")
    artifacts.check_fresh(path, manifest, rerun=rerun)


def stale_source(manifest: dict) -> tuple[str, str] | None:
    """The first source file or companion (path, what changed) that differs from its record, or None."""
    dataset = manifest.get("dataset")
    if not isinstance(dataset, dict):
        return None
    root = dataset.get("root") or ""
    for entry in dataset.get("files") or []:
        if not isinstance(entry, dict):
            continue
        kind = str(entry.get("format"))
        for record_, what in [(entry, kind), *((c, "data") for c in entry.get("companions") or [])]:
            if not isinstance(record_, dict):
                continue
            source = storage.under(str(record_.get("path")), root)
            # an object of a store without ETag or version (https://) is recorded by its size alone
            remote = storage.is_remote(source)
            if not ({"mtime_ns", "etag", "version"} & record_.keys() or remote and "size" in record_):
                continue  # recorded before varlen kept mtimes (or a hand-made manifest): cannot tell
            why = (_remote_difference(source, record_) if remote
                   else _difference(source, record_, what))
            if why is not None:
                return source, why
    return None


def quick_difference(source: str, entry: dict) -> str | None:
    """What changed in the local file ``source`` since analyze recorded ``entry``, by its size and
    ``mtime_ns`` alone (one ``stat``: cheap enough to ask before every read); None if neither did."""
    try:
        st = os.stat(source)
    except OSError:
        return "is missing"
    if st.st_size != entry.get("size"):
        return f"changed size ({entry.get('size')} -> {st.st_size} bytes)"
    if st.st_mtime_ns != entry.get("mtime_ns"):
        return "was modified"
    return None


def record(info: storage.FileInfo, kind: str) -> dict:
    """What ``varlen analyze`` records for one file ``info`` (its :func:`varlen_cli.storage.stat` when
    discovered) of a source of ``kind`` (``parquet``, or any other: ``data``): see the module doc. A
    local file must still be as discovered (else it changed while analyze read it)."""
    out = {"size": int(info.size), **storage.fingerprint_fields(info)}
    if storage.is_remote(info.path):
        return out
    why = quick_difference(info.path, out)
    if why is not None:
        raise InputError(f"source {info.path} {why} while `varlen analyze` read it; run analyze again")
    out.update(content_fields(info.path, int(info.size), kind))
    return out


def _remote_difference(source: str, entry: dict) -> str | None:
    """What changed in an object since analyze: size, ETag or version id (never the time)."""
    try:
        info = storage.stat(source)
    except InputError as exc:
        if "does not exist" in exc.message:
            return "is missing"
        raise InputError(f"cannot check whether source {source} changed: {exc.message}; {ALLOW_STALE_HINT}") from None
    if info.size != entry.get("size"):
        return f"changed size ({entry.get('size')} -> {info.size} bytes)"
    for key, now in (("etag", info.etag), ("version", info.version)):
        if entry.get(key) is not None and now is not None and now != entry[key]:
            return f"was modified ({key} {entry[key]} -> {now})"
    return None


def _difference(source: str, entry: dict, kind: str) -> str | None:
    quick = quick_difference(source, entry)
    if quick is not None:
        return quick
    if entry.get("footer") is None and entry.get("sample") is None:
        return None
    try:
        now = content_fields(source, int(entry["size"]), kind)
    except (OSError, InputError):
        return "is no longer readable"
    if entry.get("footer") is not None and now.get("footer") != entry["footer"]:
        return "was rewritten (its Parquet footer differs)"
    if entry.get("sample") is not None and now["sample"] != entry["sample"]:
        return "was rewritten (its sampled content differs)"
    return None


SAMPLE_BLOCK = 4 << 10
SPREAD_BLOCKS = 16
PARQUET_CHUNKS = 32


def content_fields(path: str, size: int, kind: str) -> dict:
    """``sample`` (and, for Parquet, ``footer``) of a local file: see the module doc. One footer read
    and at most 48 reads of 4 KiB."""
    offsets = _spread(size)
    out = {}
    if kind == "parquet":
        footer, metadata = storage.parquet_footer(path, size)
        out["footer"] = footer_hash(footer)
        offsets += _chunk_heads(metadata)
    out["sample"] = _sample_hash(path, size, offsets)
    return out


def _spread(size: int) -> list[int]:
    """Starts of :data:`SPREAD_BLOCKS` blocks from the first byte to the last (every block of a small file)."""
    if size <= SPREAD_BLOCKS * SAMPLE_BLOCK:
        return list(range(0, size, SAMPLE_BLOCK))
    return [(size - SAMPLE_BLOCK) * i // (SPREAD_BLOCKS - 1) for i in range(SPREAD_BLOCKS)]


def _chunk_heads(metadata) -> list[int]:
    """The first byte of up to :data:`PARQUET_CHUNKS` column chunks, evenly chosen over row groups and columns."""
    total = metadata.num_row_groups * metadata.num_columns
    picks = sorted({total * i // PARQUET_CHUNKS for i in range(PARQUET_CHUNKS)}) if total > PARQUET_CHUNKS \
        else range(total)
    heads = []
    for k in picks:
        column = metadata.row_group(k // metadata.num_columns).column(k % metadata.num_columns)
        first = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
        heads.append(int(first or 0))
    return heads


def _sample_hash(path: str, size: int, offsets: list[int]) -> str:
    """16 hex digits of the SHA-256 of the blocks of :data:`SAMPLE_BLOCK` bytes at ``offsets``."""
    import hashlib

    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open_regular(path, "rb", what="source") as fh:
        for start in sorted({min(max(0, o), size) for o in offsets}):
            fh.seek(start)
            digest.update(start.to_bytes(8, "little") + fh.read(min(SAMPLE_BLOCK, size - start)))
    return digest.hexdigest()[:16]


def footer_hash(footer: bytes) -> str:
    """What the manifest records as a Parquet file's ``footer``: 16 hex digits of its SHA-256."""
    import hashlib

    return hashlib.sha256(footer).hexdigest()[:16]
