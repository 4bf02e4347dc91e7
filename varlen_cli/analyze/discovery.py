"""Which paths of a source are data files: the discovery rules of ``varlen analyze``.

A SOURCE is a file, a directory or a glob. A file named explicitly is always taken (and refused
if it is a varlen artifact). A directory is walked and a glob expanded, taking only data files:

* names starting with ``.`` or ``_`` are skipped (``_SUCCESS``, ``_metadata``, ``.DS_Store``,
  ``.crc`` files, hidden directories, ``_temporary/`` and varlen's ``.NAME.varlen-tmp*``
  temporaries); in a glob, folders count only where its wildcards matched them;
* documentation and metadata are skipped by name: ``README*``, ``LICENSE*``/``LICENCE*``,
  ``COPYING*``, ``NOTICE*``, ``AUTHORS*``, ``CHANGELOG*``, ``CITATION*``, ``*.md``, ``*.rst``,
  the ``datasets`` library's ``dataset_info.json``, ``dataset_infos.json``, ``state.json``, and a
  model's ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
  ``config.json``, ``generation_config.json``, ``vocab.json``/``vocab.txt``, ``merges.txt``, and
  ``requirements.txt``;
* files of other formats are skipped (``.csv``, ``.py``, ...);
* varlen's own outputs are skipped: a directory holding a varlen ``_manifest.json`` (metrics or
  sorted) or ``_run.json`` (``varlen run``), and plan files (Parquet with ``varlen-plan`` metadata,
  dropped by :func:`varlen_cli.analyze.sources.discover` once the footer is open).

Symbolic links to directories are followed, by directory walks and ``**`` globs alike, so both
give the same files; a link that leads back into its own ancestry (a loop) is refused.

A directory whose data files have more than one format (say ``.jsonl`` and ``.txt``) is refused:
which files are the dataset is then ambiguous, and a glob (``'DIR/**/*.jsonl'``) says it.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable

from .. import format
from ..errors import InputError
from ..storage.files import open_regular

NON_DATA_NAME = re.compile(
    r"(readme|licen[cs]e|copying|notice|authors|changelog|changes|citation|contributing)([-_. ].*)?"
    r"|.*\.(md|rst|crc)|dataset_infos?\.json|state\.json|dataset_dict\.json|thumbs\.db|desktop\.ini"
    # a model's files kept beside its data
    r"|tokenizer(_config)?\.json|special_tokens_map\.json|(generation_)?config\.json|vocab\.(json|txt)|merges\.txt"
    r"|requirements\.txt",
    re.IGNORECASE,
)
ARTIFACT_FILES = {format.MANIFEST_NAME: format.METRICS_FORMAT, format.RUN_MANIFEST_NAME: format.RUN_FORMAT}
GLOB_CHARS = "*?["


def is_data_name(name: str) -> bool:
    """False for names discovery never takes as data (hidden, ``_``-prefixed, docs, metadata)."""
    return not name.startswith((".", "_")) and NON_DATA_NAME.fullmatch(name) is None


def artifact_kind(directory: str) -> str | None:
    """``"varlen-metrics"`` or ``"varlen-run"`` when ``directory`` is a varlen output, else None."""
    for name, fmt in ARTIFACT_FILES.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open_regular(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError, InputError):
            continue
        if isinstance(data, dict) and data.get("format") == fmt:
            return fmt
    return None


def refuse_artifact_dir(directory: str) -> None:
    kind = artifact_kind(directory)
    if kind is not None:
        what = "a varlen run directory" if kind == "varlen-run" else "a varlen metrics or sorted directory"
        raise InputError(f"{directory} is {what}, not a dataset; pass the data it was made from")


def walk_directory(top: str, is_candidate: Callable[[str], bool]) -> list[str]:
    """Data-file candidates under ``top``, following symlinked directories, skipping varlen outputs.

    ``is_candidate(name)`` says whether a file name has a data format. Raises on a symlink loop.
    """
    found: list[str] = []
    stack = [(top, (os.path.realpath(top),))]
    while stack:
        directory, ancestors = stack.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            raise InputError(f"cannot list directory {directory}: {exc.strerror}") from None
        for entry in entries:
            if not is_data_name(entry.name):
                continue
            if _is_dir(entry):
                real = os.path.realpath(entry.path)
                if real in ancestors:
                    raise InputError(f"symlink loop: {entry.path} leads back to {real}")
                if artifact_kind(entry.path) is None:
                    stack.append((entry.path, (*ancestors, real)))
            elif is_candidate(entry.name):
                # anything else with a data file's name is kept, as a glob keeps it: discover refuses a
                # FIFO, socket or device in one line (and reports a broken link)
                found.append(entry.path)
    return found


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows symlinks
    except OSError:
        return False


def expand_glob(pattern: str, is_candidate: Callable[[str], bool]) -> list[str]:
    """Data-file candidates matching ``pattern`` (``**`` recursive); directories it matches are walked."""
    base = _glob_base(pattern)
    if "**" in pattern:
        _check_no_loops(base)
    out: list[str] = []
    artifact_dirs: dict[str, bool] = {}
    for match in sorted(glob.glob(pattern, recursive=True)):
        if _in_skipped_folder(match, base):
            continue
        if os.path.isdir(match):
            if artifact_kind(match) is None:
                out.extend(walk_directory(match, is_candidate))
            continue
        parent, name = os.path.split(match)
        if parent not in artifact_dirs:
            artifact_dirs[parent] = artifact_kind(parent or ".") is not None
        if is_data_name(name) and is_candidate(name) and not artifact_dirs[parent]:
            out.append(match)
    return out


def _in_skipped_folder(match: str, base: str) -> bool:
    """True when a folder the wildcards matched (below ``base``) starts with ``_`` or ``.``, as a
    directory walk skips it (``_temporary/``); folders written out in the pattern are the user's choice."""
    rel = os.path.relpath(match, base or ".")
    folders = rel.split(os.sep)[:-1] if not os.path.isdir(match) else rel.split(os.sep)
    return any(f.startswith(("_", ".")) for f in folders if f not in (".", ".."))


def _glob_base(pattern: str) -> str:
    """The directory a pattern's wildcards start below (``data/x`` for ``data/x/**/*.txt``)."""
    parts = pattern.split(os.sep)
    fixed = []
    for part in parts:
        if any(ch in part for ch in GLOB_CHARS):
            break
        fixed.append(part)
    base = os.sep.join(fixed)
    return base if base or not pattern.startswith(os.sep) else os.sep


def _check_no_loops(base: str) -> None:
    """Walk the directories below ``base`` (as ``**`` does, hidden ones skipped): refuse a symlink loop."""
    base = base or "."
    if not os.path.isdir(base):
        return
    stack = [(base, (os.path.realpath(base),))]
    while stack:
        directory, ancestors = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue  # glob skips what it cannot list, too
        for entry in entries:
            if entry.name.startswith(".") or not _is_dir(entry):
                continue
            real = os.path.realpath(entry.path)
            if real in ancestors:
                raise InputError(f"symlink loop: {entry.path} leads back to {real}")
            stack.append((entry.path, (*ancestors, real)))


def check_single_format(directory: str, paths: list[str], format_of: Callable[[str], str | None]) -> None:
    """Refuse a directory whose data files have several formats (unless a glob picked them)."""
    first: dict[str, str] = {}
    for path in sorted(paths):
        first.setdefault(format_of(path) or "?", path)
    if len(first) > 1:
        examples = ", ".join(f"{fmt}: {os.path.relpath(p, directory)}" for fmt, p in sorted(first.items()))
        ext = os.path.splitext(first[sorted(first)[0]])[1]
        raise InputError(
            f"directory {directory} mixes data formats ({examples}); pass a glob such as "
            f"'{os.path.join(directory, '**', '*' + ext)}' to choose the files"
        )
