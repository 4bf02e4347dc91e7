"""Lance datasets (``pylance``): a ``DIR.lance`` folder of fragments, one version per manifest.

A SOURCE is the dataset folder (its latest version is read) or one version's manifest file
(``DIR/_versions/N.manifest``); the file discovered is always that manifest, so the metrics name the
exact version read, and ``SourceDataset`` reads that version again: a Lance version never changes
once written (a later write makes a new version; the metrics keep theirs).

``sample_id`` is Lance's own row order (``dataset.take([i])``): fragments in the manifest's order,
rows in fragment order, deleted rows skipped. Work units are row ranges of one fragment, read with
``fragment.to_table(columns, offset, limit)`` (nested struct and list columns as they are stored).

Reading needs ``pylance`` (``pip install 'varlen-cli[lance]'``); without it a Lance SOURCE is
refused in one line. Before anything is read, each data file must have the size the manifest
records (a truncated or replaced fragment file is refused), and every unit must return the rows
the manifest counts. The data files are the version's companions: the fingerprint records them.
Local datasets only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ... import storage
from ...errors import InputError, UsageError, first_line
from . import ranges

VERSIONS = "_versions"
SUFFIX = ".manifest"
V2_BASE = (1 << 64) - 1  # Lance's v2 manifest names: u64::MAX - version


def is_manifest(path: str) -> bool:
    """Whether ``path`` names a Lance version manifest (``DIR/_versions/N.manifest``)."""
    name = storage.name(path)
    return name.endswith(SUFFIX) and name[: -len(SUFFIX)].isdigit() and storage.name(storage.parent(path)) == VERSIONS


def latest_manifest(directory: str) -> str | None:
    """The manifest of a Lance dataset folder's latest version, or None for a folder that is not one."""
    versions = os.path.join(directory, VERSIONS)
    if not os.path.isdir(versions):
        return None
    found = [n for n in os.listdir(versions) if is_manifest(os.path.join(versions, n))]
    if not found:
        return None
    return os.path.join(versions, max(found, key=lambda n: version_of(n)))


def version_of(manifest: str) -> int:
    number = int(storage.name(manifest)[: -len(SUFFIX)])
    return V2_BASE - number if number > (1 << 63) else number


def _lance():
    try:
        import lance
    except ImportError:
        raise UsageError("reading a Lance dataset needs the 'pylance' package: pip install 'varlen-cli[lance]'") \
            from None
    return lance


@dataclass
class Version:
    """One version of a Lance dataset, opened and checked."""

    manifest: str
    dataset: object
    fragments: list
    rows: list  # rows of each fragment (deleted rows not counted)
    data: list  # storage.FileInfo of each data file


def open_version(manifest: str) -> Version:
    if storage.is_remote(manifest):
        raise InputError(f"{manifest}: varlen reads local Lance datasets only")
    folder = os.path.dirname(os.path.dirname(manifest))
    lance = _lance()
    try:
        dataset = lance.dataset(folder, version=version_of(manifest))
        fragments = dataset.get_fragments()
        rows = [f.count_rows() for f in fragments]
    except Exception as exc:  # lance's errors (OSError, ValueError, its own)
        raise InputError(f"cannot read the Lance dataset {folder} (version {version_of(manifest)}): "
                         f"{first_line(exc)}") from None
    return Version(manifest, dataset, fragments, rows, _data_files(folder, fragments))


def _data_files(folder: str, fragments: list) -> list:
    """Each fragment's data files, at the sizes the manifest records (refused otherwise)."""
    out = []
    for fragment in fragments:
        for data in fragment.data_files():
            path = os.path.join(folder, "data", data.path)
            try:
                st = os.stat(path)
            except OSError:
                raise InputError(f"Lance data file {path} (fragment {fragment.fragment_id}) is missing") from None
            want = getattr(data, "file_size_bytes", None)
            if want is not None and st.st_size != want:
                raise InputError(f"Lance data file {path} has {st.st_size} bytes where the manifest records {want} "
                                 "(truncated or replaced)")
            out.append(storage.FileInfo(path, st.st_size, mtime_ns=st.st_mtime_ns))
    return out


def units(version: Version, chunk_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """(part, start, stop, rows, weight): row ranges of about ``chunk_bytes`` per fragment."""
    step = ranges.unit_rows(sum(version.rows) or 1, sum(d.size for d in version.data) or 1, chunk_bytes)
    return [unit for k, n in enumerate(version.rows) for unit in ranges.row_ranges(k, n, step)]


def read(version: Version, part: int, start: int, stop: int, columns):
    """Rows ``[start, stop)`` of fragment ``part`` as an Arrow table of ``columns`` (None: all)."""
    names = version.dataset.schema.names
    for c in columns or ():
        if c not in names:
            raise InputError(f"column '{c}' not found in {version.manifest} (columns: {', '.join(names)})")
    try:
        table = version.fragments[part].to_table(columns=list(columns) if columns is not None else None,
                                                 offset=start, limit=stop - start)
    except Exception as exc:
        raise InputError(f"cannot read the Lance dataset of {version.manifest}: {first_line(exc)}") from None
    if table.num_rows != stop - start:
        raise InputError(f"Lance fragment {part} of {version.manifest} returned {table.num_rows} rows where its "
                         f"manifest counts {stop - start} (damaged or changed)")
    return table
