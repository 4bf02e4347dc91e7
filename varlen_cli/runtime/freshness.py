"""Stale inputs: refuse metrics whose sources changed after ``varlen analyze`` read them.

``varlen analyze`` records, per source file, its size, modification time (``mtime_ns``) and, for
Parquet, a hash of the footer (``dataset.files`` in the manifest; a sorted directory copies the
block). :func:`check_inputs` is the one check ``sort``, ``plan`` and ``validate --metrics`` run
before trusting a metrics or sorted directory:

* every recorded source must still exist with the same size and ``mtime_ns`` (and footer hash);
* a sorted directory's metrics directory must not have been rebuilt since
  (:func:`varlen_cli.runtime.artifacts.check_fresh`).

``--allow-stale`` (``allow_stale=True``) skips both, for data moved or copied on purpose (a copy
gets a new mtime). Manifests written before varlen recorded ``mtime_ns`` are not checked.
"""

from __future__ import annotations

import os

from ..errors import InputError
from . import artifacts
from .files import open_regular

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
    for entry in dataset.get("files") or []:
        if not isinstance(entry, dict) or "mtime_ns" not in entry:
            continue  # recorded before varlen kept mtimes (or a hand-made manifest): cannot tell
        source = os.path.join(root, str(entry.get("path")))
        why = _difference(source, entry)
        if why is not None:
            return source, why
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
    rewritten even where size and mtime do not. One small read at the end of the file."""
    import hashlib

    try:
        with open_regular(path, "rb") as fh:
            fh.seek(max(0, size - 8))
            tail = fh.read(8)
            n = int.from_bytes(tail[:4], "little")
            if len(tail) < 8 or tail[4:] != b"PAR1" or n + 8 > size:
                return None
            fh.seek(size - 8 - n)
            return hashlib.sha256(fh.read(n)).hexdigest()[:16]
    except (OSError, InputError):
        return None
