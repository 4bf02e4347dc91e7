"""Stale inputs: refuse metrics whose sources changed after ``varlen analyze`` read them.

``varlen analyze`` records, per source file, its size, modification time (``mtime_ns``) and, for
Parquet, a hash of the footer (``dataset.files`` in the manifest; a sorted directory copies the
block). :func:`check_inputs` is the one check ``sort``, ``plan`` and ``validate --metrics`` run
before trusting a metrics or sorted directory:

* every recorded source must still exist with the same size and ``mtime_ns`` (and footer hash), and
  so must its ``companions``, the files its samples are read from (a Lance version's data files, a
  LitData index's chunks);
* a sorted directory's metrics directory must not have been rebuilt since
  (:func:`varlen_cli.runtime.artifacts.check_fresh`).

A source in object storage (``s3://``...) is compared on its size and the ETag and version id
recorded by ``analyze`` (:func:`varlen_cli.storage.fingerprint_fields`), never on a modification time.

``--allow-stale`` (``allow_stale=True``) skips both, for data moved or copied on purpose (a copy
gets a new mtime). Manifests written before varlen recorded ``mtime_ns`` are not checked.
"""

from __future__ import annotations

import os

from .. import storage
from ..errors import InputError
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
    """The first source file (path, what changed) that differs from its record, or None."""
    dataset = manifest.get("dataset")
    if not isinstance(dataset, dict):
        return None
    root = dataset.get("root") or ""
    for file_entry in dataset.get("files") or []:
        companions = file_entry.get("companions") if isinstance(file_entry, dict) else None
        # a source file, then the files its samples are read from (Lance fragments, LitData chunks)
        for entry in [file_entry, *(companions if isinstance(companions, list) else [])]:
            if not isinstance(entry, dict) or not ({"mtime_ns", "etag", "version"} & entry.keys()):
                continue  # recorded before varlen kept mtimes (or a hand-made manifest): cannot tell
            source = storage.under(str(entry.get("path")), root)
            why = _remote_difference(source, entry) if storage.is_remote(source) else _difference(source, entry)
            if why is not None:
                return source, why
    return None


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


def _difference(source: str, entry: dict) -> str | None:
    try:
        st = os.stat(source)
    except OSError:
        return "is missing"
    if st.st_size != entry.get("size"):
        return f"changed size ({entry.get('size')} -> {st.st_size} bytes)"
    if st.st_mtime_ns != entry.get("mtime_ns"):
        return "was modified"
    if entry.get("footer") is not None:
        if footer_digest(source, st.st_size) != entry["footer"]:
            return "was rewritten (its Parquet footer differs)"
    return None


def footer_digest(path: str, size: int) -> str | None:
    """A hash of the Parquet footer (schema, row groups, statistics): changes when the content is
    rewritten even where size and mtime do not. One small read at the end of the file (one range
    request for an object in storage: :func:`varlen_cli.storage.parquet_footer`)."""
    try:
        return footer_hash(storage.parquet_footer(path, size)[0])
    except (OSError, InputError):
        return None


def footer_hash(footer: bytes) -> str:
    """What the manifest records as a Parquet file's ``footer``: 16 hex digits of its SHA-256."""
    import hashlib

    return hashlib.sha256(footer).hexdigest()[:16]
