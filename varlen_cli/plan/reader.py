"""Reading the planner's input: a metrics or sorted directory's sample ids and lengths."""

from __future__ import annotations

import numpy as np

from .. import format
from ..errors import InputError, UsageError
from ..runtime import artifacts, freshness
from .config import PlanConfig


def read_input(path: str, allow_stale: bool = False) -> tuple[dict, np.ndarray, np.ndarray]:
    """The manifest, sample ids and lengths of a metrics or sorted directory (a local folder or an
    object-storage prefix: :func:`~varlen_cli.runtime.artifacts.open_part`), in its row order."""
    manifest = artifacts.read_manifest(path, what="metrics or sorted directory",
                                       hint="create one with `varlen analyze` (and `varlen sort` for curriculum order)")
    freshness.check_inputs(path, manifest, allow_stale, rerun="varlen sort")
    parts = manifest.get("parts", [])
    total = sum(int(part["rows"]) for part in parts)
    # streamed row group by row group into the final arrays: pyarrow's pool (which keeps what it
    # freed) then holds one row group, not the whole input
    sample_id, length = np.empty(total, np.int64), np.empty(total, np.int64)
    filled = 0
    for part in parts:
        p = artifacts.part_location(path, part)
        rows = int(part["rows"])
        try:  # ParquetFile, not read_table: that imports pyarrow.dataset and pandas (~0.5 s of start-up)
            pf = artifacts.open_part(p, memory_map=True)  # local: no copy of the file into read buffers
            missing = [c for c in ("sample_id", "length") if c not in pf.schema_arrow.names]
            if missing:
                raise InputError(f"{p} has no column {missing[0]!r}")
            if pf.metadata.num_rows != rows:
                raise InputError(f"{p} has {pf.metadata.num_rows:,} rows but {artifacts.MANIFEST_NAME} lists "
                                 f"{rows:,}")
            for rg in range(pf.num_row_groups):
                t = pf.read_row_group(rg, columns=["sample_id", "length"])
                _fill(sample_id, filled, t, "sample_id", p)
                _fill(length, filled, t, "length", p)
                filled += len(t)
                del t
        except InputError:
            raise
        except Exception as exc:  # pyarrow raises several types for bad files
            raise InputError(f"cannot read {p}: {exc}") from None
    _release_arrow_memory()
    if not len(sample_id):
        raise InputError(f"{path} holds no samples")
    if int(length.min()) < 0:
        raise InputError(f"{path} has negative lengths")
    if int(length.max()) > format.INT32_MAX:
        raise InputError(f"{path} has a sample of {int(length.max()):,} tokens; plans hold lengths up to "
                         f"{format.INT32_MAX:,} (int32)")
    check_ids(sample_id, path)
    return manifest, sample_id, length


TARGET_COLUMN = format.TARGET_LENGTH_COLUMN  # the tokens that carry loss (analyze --target-length)


def read_targets(c: PlanConfig, path: str, manifest: dict) -> np.ndarray | None:
    """The input's ``target_length`` column (row order, as :func:`read_input`), or None without one
    (``c``: the plan's config; ``--split-long`` cannot place a sample's loss tokens in its chunks)."""
    if TARGET_COLUMN not in (manifest.get("columns") or {}):
        return None
    if c.packing and c.split_long:
        raise UsageError(f"--split-long cannot tell which chunk of a split sample holds its {TARGET_COLUMN} loss "
                         f"tokens (analyze --target-length); pack without --split-long")
    parts = [artifacts.open_part(artifacts.part_location(path, part)).read(columns=[TARGET_COLUMN]).column(0)
             for part in manifest.get("parts", [])]
    return np.concatenate([p.to_numpy() for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)


def check_ids(sample_id: np.ndarray, path: str) -> None:
    """The ids must be ``0..N-1``, each once (the row index of the dataset the plan indexes): one pass
    for a metrics directory (increasing ids), a table of N flags for a sorted one."""
    n = len(sample_id)
    if n and bool(np.all(sample_id[1:] > sample_id[:-1])) and int(sample_id[0]) == 0 and int(sample_id[-1]) == n - 1:
        return
    lo, hi = int(sample_id.min()), int(sample_id.max())
    if lo < 0 or hi >= n:
        raise InputError(f"{path} has sample_id {lo if lo < 0 else hi:,}, outside 0..{n - 1:,}: sample ids must be the "
                         "rows' indices 0..N-1 (re-run `varlen analyze`)")
    seen = np.zeros(n, bool)
    seen[sample_id] = True
    if not seen.all():
        twice = int(np.argmax(np.bincount(sample_id, minlength=n) > 1))
        raise InputError(f"{path} has sample_id {twice:,} more than once (and {int(np.argmin(seen)):,} never): "
                         "sample ids must be the rows' indices 0..N-1, each once (re-run `varlen analyze`)")


def _fill(out: np.ndarray, at: int, table, name: str, path: str) -> None:
    """Copy a column into ``out[at:]`` chunk by chunk (as numpy views: ``to_numpy`` imports pandas, ~0.3 s)."""
    from .arrow_io import to_numpy

    for chunk in table.column(name).chunks:
        if chunk.null_count:
            raise InputError(f"{path} has missing values in column {name!r}")
        if len(chunk):
            out[at:at + len(chunk)] = to_numpy(chunk)
        at += len(chunk)


def _release_arrow_memory() -> None:
    import pyarrow as pa

    try:
        pa.default_memory_pool().release_unused()
    except AttributeError:  # pragma: no cover - older pyarrow
        pass


def canonical_order(sample_id: np.ndarray) -> np.ndarray:
    """Positions in increasing sample_id: random and bucket-shuffle plans then do not depend on
    whether the input was a metrics or a sorted directory."""
    n = len(sample_id)
    if n < 2 or bool(np.all(sample_id[1:] > sample_id[:-1])):
        return np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64)  # positions: 4 bytes a sample
    lo, hi = int(sample_id.min()), int(sample_id.max())
    if lo >= 0 and hi < 2 * n:
        inv = np.full(hi + 1, -1, np.int64)
        inv[sample_id] = np.arange(n, dtype=np.int64)
        out = inv[inv >= 0]
        if len(out) == n:
            return out
    return np.argsort(sample_id, kind="stable").astype(np.int64)
