"""Field types of a metrics or sorted directory's ``_manifest.json``, checked before anything uses them.

A manifest edited by hand or by another tool (``"num_rows": "x"``, a part without ``rows``) must
give one clear line, not an internal error deep inside sort or plan. Only the fields stages read
are checked; unknown fields are left alone.
"""

from __future__ import annotations

from ..errors import InputError


def check_manifest_fields(path: str, manifest: dict, name: str = "_manifest.json") -> None:
    """Raise :class:`InputError` naming the first field of ``manifest`` whose type is wrong."""

    def bad(field: str, want: str, got) -> InputError:
        shown = repr(got) if len(repr(got)) <= 40 else repr(got)[:37] + "..."
        return InputError(f"{path} has a malformed {name}: '{field}' must be {want}, got {shown}")

    if not _is_count(manifest.get("format_version", 0)):
        raise bad("format_version", "a non-negative integer", manifest.get("format_version"))
    if "num_rows" in manifest and not _is_count(manifest["num_rows"]):
        raise bad("num_rows", "a non-negative integer", manifest["num_rows"])
    parts = manifest.get("parts", [])
    if not isinstance(parts, list):
        raise bad("parts", "a list", parts)
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            raise bad(f"parts[{i}]", "an object", part)
        file = part.get("file")
        if not isinstance(file, str) or not file or "/" in file or "\\" in file or file.startswith("."):
            raise bad(f"parts[{i}].file", "a file name inside the directory", file)
        if not _is_count(part.get("rows")):
            raise bad(f"parts[{i}].rows", "a non-negative integer", part.get("rows"))
    for key in ("dataset", "input", "order", "columns", "stats"):
        if manifest.get(key) is not None and not isinstance(manifest[key], dict):
            raise bad(key, "an object", manifest[key])
    for key in ("artifact_id", "kind"):
        if manifest.get(key) is not None and not isinstance(manifest[key], str):
            raise bad(key, "a string", manifest[key])
    _check_dataset(manifest.get("dataset") or {}, bad)


def _check_dataset(dataset: dict, bad) -> None:
    for key in ("digest", "root"):
        if dataset.get(key) is not None and not isinstance(dataset[key], str):
            raise bad(f"dataset.{key}", "a string", dataset[key])
    files = dataset.get("files", [])
    if not isinstance(files, list):
        raise bad("dataset.files", "a list", files)
    for i, entry in enumerate(files):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise bad(f"dataset.files[{i}]", "an object with a 'path'", entry)
        for key in ("size", "rows", "mtime_ns"):
            if key in entry and not _is_count(entry[key]):
                raise bad(f"dataset.files[{i}].{key}", "a non-negative integer", entry[key])


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
