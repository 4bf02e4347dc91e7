"""Discovery for object-storage sources (``s3://bucket/prefix/``, globs, single objects).

The same rules as :mod:`.discovery` applies to local folders, on key paths: below a prefix (or the
fixed part of a glob) names starting with ``.`` or ``_``, documentation and metadata are skipped
in every path component, other formats are skipped, varlen outputs (a folder holding a varlen
``_manifest.json`` or ``_run.json``) are skipped, a Hugging Face ``save_to_disk`` folder is read
from its ``state.json``, and a prefix whose data files have several formats is refused. There are
no symbolic links in object storage.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from .. import storage
from ..errors import InputError
from . import discovery


def artifact_kind(folder: str) -> str | None:
    """``"varlen-metrics"``/``"varlen-run"`` when the remote ``folder`` is a varlen output, else None."""
    for name, fmt in discovery.ARTIFACT_FILES.items():
        loc = storage.join(folder, name)
        if not storage.isfile(loc):
            continue
        try:
            data = json.loads(storage.read_bytes(loc))
        except (InputError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == fmt:
            return fmt
    return None


def _refuse_artifact(folder: str) -> None:
    kind = artifact_kind(folder)
    if kind is not None:
        what = "a varlen run directory" if kind == "varlen-run" else "a varlen metrics or sorted directory"
        raise InputError(f"{folder} is {what}, not a dataset; pass the data it was made from")


def _hf_state_files(folder: str) -> list[str] | None:
    if storage.isfile(storage.join(folder, "dataset_dict.json")):
        raise InputError(f"{folder} is a Hugging Face DatasetDict; pass one split's folder")
    state = storage.join(folder, "state.json")
    if not storage.isfile(state):
        return None
    try:
        files = json.loads(storage.read_bytes(state))["_data_files"]
        return [storage.join(folder, f["filename"]) for f in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"cannot read the Hugging Face dataset state {state}: {exc}") from None


def _select(base: str, found: list[str], is_candidate: Callable[[str], bool]) -> list[str]:
    """The data files among ``found`` (all below ``base``): every component below ``base`` must be
    a data name, and no folder on the way may be a varlen output."""
    out, artifact_folders = [], set()
    for loc in found:
        parts = storage.relpath(loc, base).split("/")
        if parts[-1] in discovery.ARTIFACT_FILES:
            artifact_folders.add("/".join(parts[:-1]))
        if all(discovery.is_data_name(p) for p in parts) and is_candidate(parts[-1]):
            out.append((loc, parts))
    varlen_made = {f for f in artifact_folders if artifact_kind(storage.join(base, f) if f else base)}
    return [loc for loc, parts in out
            if not any("/".join(parts[:k]) in varlen_made for k in range(len(parts)))]


def _glob_base(pattern: str) -> str:
    head = pattern.split("://", 1)[0] + "://"
    fixed = []
    for part in pattern[len(head):].split("/"):
        if any(ch in part for ch in discovery.GLOB_CHARS):
            break
        fixed.append(part)
    return head + "/".join(fixed)


def expand(source: str, is_candidate: Callable[[str], bool],
           format_of: Callable[[str], str | None], is_glob: bool | None = None) -> list[tuple[str, bool]]:
    """The data-file candidates of one remote SOURCE, each with whether it was named explicitly
    (``is_glob``: whether its wildcards are a glob's; by default, whether it has any)."""
    if is_glob is None:
        is_glob = any(ch in source.split("://", 1)[1] for ch in discovery.GLOB_CHARS)
    if is_glob:
        base = _glob_base(source)
        matches = [m for m in storage.glob(source) if m != base]
        files = []
        for m in matches:
            if storage.isdir(m):
                files += storage.find(m)
            else:
                files.append(m)
        out = _select(base, sorted(set(files)), is_candidate)
        if not out:
            raise InputError(f"no data files (Parquet, Arrow, JSONL, text) match {source}")
        return [(p, False) for p in out]
    try:
        info = storage.stat(source)
    except InputError as exc:
        if "does not exist" not in exc.message:
            raise
        raise InputError(f"source {exc.message}") from None
    if not info.is_dir and not source.endswith("/"):
        parent = storage.parent(source)
        if artifact_kind(parent) is not None:
            raise InputError(f"{source} is part of a varlen output ({parent}), not a dataset")
        return [(source, True)]
    folder = source.rstrip("/")
    _refuse_artifact(folder)
    hf = _hf_state_files(folder)
    if hf is not None:
        return [(p, True) for p in hf]
    out = _select(folder, storage.find(folder), is_candidate)
    if not out:
        raise InputError(f"no data files (Parquet, Arrow, JSONL, text) found in {source}")
    discovery.check_single_format(folder, out, format_of)
    return [(p, False) for p in out]
