"""Chunks: which samples a chunk holds, its random streams, and reading it from the input.

A chunk is defined by the input alone (its number of samples and ``--chunk-samples``), never by
the number of workers. See the package docstring for the design.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ... import format
from ...errors import InputError
from ...runtime import artifacts

DEFAULT_CHUNK_SAMPLES = 1 << 23
TARGET_COLUMN = format.TARGET_LENGTH_COLUMN  # metrics column of the tokens that carry loss (analyze --target-length)
GLOBAL_STREAM = (0, 1)  # appended to (seed, epoch): the stream of the cross-chunk order


@dataclass(frozen=True)
class ChunkSpec:
    """``count`` chunks of balanced size over ``n`` samples, each at most ``size``."""

    n: int
    size: int

    @property
    def count(self) -> int:
        return max(1, -(-self.n // self.size))

    def bounds(self, k: int) -> tuple[int, int]:
        """Chunk ``k`` is ``[lo, hi)`` of the canonical (random orders) or sorted (curriculum) sequence."""
        k_all = self.count
        return self.n * k // k_all, self.n * (k + 1) // k_all

    def edges(self) -> np.ndarray:
        k_all = self.count
        return (np.arange(k_all + 1, dtype=np.int64) * self.n) // k_all


def chunk_rng(seed: int, epoch: int, k: int) -> np.random.Generator:
    """Chunk ``k``'s stream in ``epoch``: ``(seed, epoch)`` for chunk 0 (what one process drew before
    chunks existed), ``(seed, epoch, k)`` for the others."""
    return np.random.default_rng([seed, epoch] if k == 0 else [seed, epoch, k])


def global_rng(seed: int, epoch: int) -> np.random.Generator:
    """The stream of an epoch's cross-chunk order (interleaving, step shuffle inside windows)."""
    return np.random.default_rng([seed, epoch, *GLOBAL_STREAM])


# -- reading ---------------------------------------------------------------------------------------
@dataclass
class ChunkData:
    """A chunk's samples: ids and lengths per local position, and the sequences epochs start from.

    A mixture's chunk (:mod:`.sources`) also names each position's ``source`` and which ``copy`` of its
    sample it is; a replan's first epoch may hold ``pieces``: the chunks left of samples split across
    the step, each with its ``start`` inside its sample and the sample's ``full`` length (a whole
    sample: start 0, full = length)."""

    index: int
    ids: np.ndarray  # int64 sample id per local position
    length: np.ndarray  # int64 per local position
    first_id: int | None  # ids == first_id + arange(n) (canonical chunks of a metrics directory), else None
    target: np.ndarray | None = None  # per local position, the tokens that carry loss (target_length)
    source: np.ndarray | None = None  # a mixture: each position's source (its index in the metadata's list)
    copy: np.ndarray | None = None  # a mixture: each position's copy of its sample (0 .. ceil(weight) - 1)
    last: np.ndarray | None = None  # a mixture: whether each position is its sample's last copy
    start: np.ndarray | None = None  # pieces: where each position starts in its sample
    full: np.ndarray | None = None  # pieces: each position's whole sample length
    in_order: bool = False  # the positions are in the epoch's canonical order already (a mixture's sequence)

    @property
    def n(self) -> int:
        return len(self.length)

    def take(self, idx: np.ndarray) -> ChunkData:
        """The positions ``idx`` (an index or a mask), in that order."""
        def part(a):
            return a[idx] if a is not None else None

        return ChunkData(self.index, self.ids[idx], self.length[idx], None, part(self.target), part(self.source),
                         part(self.copy), part(self.last), part(self.start), part(self.full), self.in_order)

    def whole_length(self, positions: np.ndarray) -> np.ndarray:
        """The whole length of the samples at ``positions`` (a piece's sample's, not the piece's)."""
        return (self.full if self.full is not None else self.length)[positions]

    def starts(self, positions: np.ndarray, within: np.ndarray) -> np.ndarray:
        """Where items starting at ``within`` of the positions ``positions`` start in their samples."""
        return within if self.start is None else within + self.start[positions]


class InputRows:
    """Row ranges of a metrics or sorted directory (the concatenation of its parts in name order),
    local or in object storage (:func:`varlen_cli.runtime.artifacts.open_part`)."""

    def __init__(self, path: str, manifest: dict):
        self.path = path
        self.manifest = manifest
        self.parts = [(artifacts.part_location(path, p), int(p["rows"])) for p in manifest.get("parts", [])]
        self.num_rows = sum(rows for _, rows in self.parts)
        # the columns a chunk reads: target_length too when the metrics have it (analyze --target-length)
        self.columns = ("sample_id", "length") + ((TARGET_COLUMN,) if TARGET_COLUMN in (manifest.get("columns") or {})
                                                  else ())

    @property
    def has_target(self) -> bool:
        return TARGET_COLUMN in self.columns

    def read(self, lo: int, hi: int, columns=None) -> dict[str, np.ndarray]:
        """Rows ``[lo, hi)`` as int64 numpy arrays (``difficulty``: float64), checked (no nulls, lengths >= 0)."""
        from ..arrow_io import to_numpy

        columns = self.columns if columns is None else columns
        out = {c: np.empty(hi - lo, np.float64 if c == "difficulty" else np.int64) for c in columns}
        at, offset = 0, 0
        for path, rows in self.parts:
            a, b = max(lo, offset), min(hi, offset + rows)
            if b > a:
                try:
                    pf = artifacts.open_part(path, memory_map=True)
                    missing = [c for c in columns if c not in pf.schema_arrow.names]
                    if missing:
                        raise InputError(f"{path} has no column {missing[0]!r}")
                    if pf.metadata.num_rows != rows:
                        raise InputError(f"{path} has {pf.metadata.num_rows:,} rows but {artifacts.MANIFEST_NAME} "
                                         f"lists {rows:,}")
                    rg_lo = 0
                    for g in range(pf.num_row_groups):
                        rg_rows = pf.metadata.row_group(g).num_rows
                        s, e = max(a - offset, rg_lo), min(b - offset, rg_lo + rg_rows)
                        if e > s:
                            t = pf.read_row_group(g, columns=list(columns)).slice(s - rg_lo, e - s)
                            for c in columns:
                                pos = at
                                for chunk in t.column(c).chunks:
                                    if chunk.null_count:
                                        raise InputError(f"{path} has missing values in column {c!r}")
                                    out[c][pos:pos + len(chunk)] = to_numpy(chunk)
                                    pos += len(chunk)
                            at += e - s
                            del t
                        rg_lo += rg_rows
                except InputError:
                    raise
                except Exception as exc:  # pyarrow raises several types for bad files
                    raise InputError(f"cannot read {path}: {exc}") from None
            offset += rows
        if "length" in out and len(out["length"]):
            low, high = int(out["length"].min()), int(out["length"].max())
            if low < 0:
                raise InputError(f"{self.path} has negative lengths")
            from ... import format

            if high > format.INT32_MAX:
                raise InputError(f"{self.path} has a sample of {high:,} tokens; plans hold lengths up to "
                                 f"{format.INT32_MAX:,} (int32)")
        return out


class Scatter:
    """Canonical chunks of an input whose rows are not in sample_id order (a sorted directory read for
    random or bucket-shuffle epochs): one pass, shared out by rank, writes each piece of rows
    (pieces = the chunk bounds over rows) grouped by the chunk of each sample's id; chunk ``k`` then
    reads its group of every piece (``K`` short reads) and puts the lengths in id order."""

    def __init__(self, rows: InputRows, spec: ChunkSpec, directory: str):
        self.rows, self.spec, self.directory = rows, spec, directory

    def _name(self, p: int) -> str:
        return os.path.join(self.directory, f"scatter-{p:06d}")

    def write(self, rank: int, world_size: int) -> None:
        edges = self.spec.edges()
        for p in range(rank, self.spec.count, world_size):
            lo, hi = self.spec.bounds(p)
            got = self.rows.read(lo, hi)
            ids, length = got["sample_id"], got["length"]
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.n):
                raise InputError(f"{self.rows.path} has sample ids outside 0..{self.spec.n - 1:,}")
            chunk = (np.searchsorted(edges, ids, side="right") - 1).astype(np.int32)
            order = np.argsort(chunk, kind="stable")
            starts = np.searchsorted(chunk[order], np.arange(self.spec.count + 1)).astype(np.int64)
            try:
                ids[order].tofile(self._name(p) + ".ids")
                length[order].tofile(self._name(p) + ".len")
                if self.rows.has_target:
                    got[TARGET_COLUMN][order].tofile(self._name(p) + ".tgt")
                np.save(self._name(p) + ".npy", starts)
            except OSError as exc:
                from ...errors import OutputError

                raise OutputError(f"cannot write the plan's temporary files in {self.directory}: "
                                  f"{exc.strerror or exc}") from None

    def read(self, k: int) -> ChunkData:
        lo, hi = self.spec.bounds(k)
        parts: dict = {".ids": [], ".len": [], ".tgt": []}
        suffixes = (".ids", ".len") + ((".tgt",) if self.rows.has_target else ())
        for p in range(self.spec.count):
            starts = np.load(self._name(p) + ".npy")
            a, b = int(starts[k]), int(starts[k + 1])
            for suffix in suffixes:
                with open(self._name(p) + suffix, "rb") as fh:
                    fh.seek(a * 8)
                    parts[suffix].append(np.fromfile(fh, np.int64, b - a))
        ids, length = np.concatenate(parts[".ids"]), np.concatenate(parts[".len"])
        if len(ids) != hi - lo or not _is_permutation(ids, lo, hi):
            _refuse_ids(ids, lo, hi, self.spec.n, self.rows.path)
        dense = np.empty(hi - lo, np.int64)
        dense[ids - lo] = length
        target = None
        if self.rows.has_target:
            target = np.empty(hi - lo, np.int64)
            target[ids - lo] = np.concatenate(parts[".tgt"])
        return ChunkData(k, np.arange(lo, hi, dtype=np.int64), dense, lo, target)


class ChunkSource:
    """The chunks of one input for one kind of order: canonical id ranges (random, bucket-shuffle) or
    ranges of the input's rows (curriculum; ``reverse`` reads them from the end). ``scatter``: the
    canonical chunks of an input not in sample_id order (:class:`Scatter`)."""

    def __init__(self, rows: InputRows, spec: ChunkSpec, curricular: bool, reverse: bool = False,
                 scatter: Scatter | None = None):
        self.rows, self.spec, self.curricular, self.reverse = rows, spec, curricular, reverse
        self.scatter = scatter

    def read(self, k: int) -> ChunkData:
        if self.scatter is not None and not self.curricular:
            return self.scatter.read(k)
        lo, hi = self.spec.bounds(k)
        if self.curricular:
            if self.reverse:  # chunk k of the reversed order: rows [n - hi, n - lo), read back to front
                lo, hi = self.spec.n - hi, self.spec.n - lo
            got = self.rows.read(lo, hi)
            if self.spec.count == 1:
                from ..reader import check_ids

                check_ids(got["sample_id"], self.rows.path)
            elif len(got["sample_id"]) and (int(got["sample_id"].min()) < 0
                                            or int(got["sample_id"].max()) >= self.spec.n):
                _refuse_ids(got["sample_id"], 0, self.spec.n, self.spec.n, self.rows.path)
            if self.reverse:
                got = {name: values[::-1].copy() for name, values in got.items()}
            return ChunkData(k, got["sample_id"], got["length"], None, got.get(TARGET_COLUMN))
        got = self.rows.read(lo, hi)
        ids = got["sample_id"]
        if self.spec.count == 1:  # one chunk: ids 0..N-1 in any order (the former takes them in increasing id order)
            from ..reader import check_ids

            check_ids(ids, self.rows.path)
            return ChunkData(k, ids, got["length"], lo if _is_range(ids, lo) else None, got.get(TARGET_COLUMN))
        if not _is_range(ids, lo):
            _refuse_ids(ids, lo, hi, self.spec.n, self.rows.path)
        return ChunkData(k, ids, got["length"], lo, got.get(TARGET_COLUMN))


def _is_range(ids: np.ndarray, lo: int) -> bool:
    """Whether ``ids`` is ``lo, lo + 1, ...`` (one pass)."""
    n = len(ids)
    return n == 0 or (int(ids[0]) == lo and int(ids[-1]) == lo + n - 1 and bool(np.all(ids[1:] > ids[:-1])))


def _is_permutation(ids: np.ndarray, lo: int, hi: int) -> bool:
    seen = np.zeros(hi - lo, bool)
    seen[ids - lo] = True
    return bool(seen.all())


def _refuse_ids(ids: np.ndarray, lo: int, hi: int, n: int, path: str) -> None:
    """The input's sample ids, which chunk ``[lo, hi)`` should hold each once, are not 0..N-1 each
    once: ``reader.check_ids``' message, from this chunk's ids."""
    bad = ids[(ids < 0) | (ids >= n)]
    if len(bad):
        raise InputError(f"{path} has sample_id {int(bad[0]):,}, outside 0..{n - 1:,}: sample ids must be the rows' "
                         "indices 0..N-1 (re-run `varlen analyze`)")
    mine = ids[(ids >= lo) & (ids < hi)]
    counts = np.bincount(mine - lo, minlength=hi - lo)
    twice = np.flatnonzero(counts > 1)
    never = np.flatnonzero(counts == 0)
    if len(twice):
        raise InputError(f"{path} has sample_id {lo + int(twice[0]):,} more than once"
                         + (f" (and {lo + int(never[0]):,} never)" if len(never) else "")
                         + ": sample ids must be the rows' indices 0..N-1, each once (re-run `varlen analyze`)")
    raise InputError(f"{path}: sample ids are not 0..{n - 1:,} in row order (rows {lo:,}..{hi - 1:,}); plans of more "
                     "than one chunk read random orders from a metrics directory in sample_id order (as `varlen "
                     "analyze` writes it) or from a sorted directory")
