"""Chunk results on disk, in the output's temporary directory (``.NAME.varlen-tmp-spill-*``).

Per (epoch, chunk) job:

* ``e{E}-c{K}.npz``: the unit table, the tail candidates and a small JSON header with each unit
  column's largest value (what phase 2 reads: about 30 bytes a unit; the header and candidates
  when the table is opened, the unit columns one at a time when they are copied into the epoch's);
* ``e{E}-c{K}.{item}.bin``: each item array raw, in unit order (what phase 3 reads by ranges with
  ``pread``). Sample ids are stored as uint32 offsets from the chunk's smallest id when they fit, the
  other items (lengths, starts, rows) as uint16 when the chunk's values fit (the header's
  ``item_dtypes``), else int32.

Per epoch and rank > 0 of a shared layout (phase 2 on every rank): ``e{E}-r{R}.order.npy``, the unit
of each of the rank's plan positions, which rank 0 copies into its epoch's order, and
``e{E}-r{R}.tally.pkl``, the sums ``finish`` needs from those rows (``finish.Tally``).

A killed run leaves the directory behind; it matches the output's temporary pattern, so the next
run on that output removes it (``runtime.safety.clean_leftovers``).
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass

import numpy as np

from ...errors import OutputError
from .form import ChunkUnits

ITEM_DTYPES = {"item_length": np.int32, "item_start": np.int32, "item_row": np.int32, "sample_length": np.int32,
               "sample_target": np.int32, "source": np.int32}  # what the readers hand out; stored as uint16 where
# a chunk's values fit


def stored_dtype(values) -> np.dtype:
    """How an item array is written: uint16 when every value fits (0..65,535: lengths under 64k tokens,
    half the bytes to write and read back), else int32."""
    values = np.asarray(values)
    if not len(values) or (int(values.min()) >= 0 and int(values.max()) <= np.iinfo(np.uint16).max):
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def job_name(epoch: int, chunk: int) -> str:
    return f"e{epoch:05d}-c{chunk:06d}"


def _part_path(directory: str, epoch: int, rank: int, ext: str) -> str:
    return os.path.join(directory, f"e{epoch:05d}-r{rank:05d}.{ext}")


def write_order_part(directory: str, epoch: int, rank: int, values: np.ndarray, tally) -> None:
    """A rank's part of an epoch's plan order, and the tally of its rows (raises OutputError on a full disk)."""
    try:
        for ext, write in (("order.npy", lambda fh: np.save(fh, values)),
                           ("tally.pkl", lambda fh: pickle.dump(tally, fh, protocol=pickle.HIGHEST_PROTOCOL))):
            path = _part_path(directory, epoch, rank, ext)
            with open(path + ".tmp", "wb") as fh:
                write(fh)
            os.replace(path + ".tmp", path)
    except OSError as exc:
        raise OutputError(f"cannot write the plan's temporary files in {directory}: {exc.strerror or exc}") from None


def read_order_part(directory: str, epoch: int, rank: int, out: np.ndarray):
    """Rank ``rank``'s part of an epoch's plan order, read into ``out`` (its positions), and its tally;
    the files are removed."""
    path = _part_path(directory, epoch, rank, "order.npy")
    part = np.load(path)
    if len(part) != len(out):  # pragma: no cover - every rank computes the same parts
        raise OutputError(f"{path} holds {len(part):,} plan rows, not {len(out):,}")
    out[:] = part
    os.remove(path)
    path = _part_path(directory, epoch, rank, "tally.pkl")
    with open(path, "rb") as fh:
        tally = pickle.load(fh)  # our own spill directory, written by this job's workers
    os.remove(path)
    return tally


def _write_raw(path: str, values: np.ndarray) -> None:
    with open(path, "wb") as fh:
        np.ascontiguousarray(values).tofile(fh)


def _largest(values) -> float | int:
    """A unit column's largest value (0 when empty): phase 2 stores the column in the smallest dtype
    that holds it."""
    values = np.asarray(values)
    if not len(values):
        return 0
    top = values.max()
    return float(top) if values.dtype.kind == "f" else int(top)


def write(directory: str, cu: ChunkUnits) -> None:
    """Write one chunk's units and items (raises OutputError on a full disk)."""
    name = os.path.join(directory, job_name(cu.epoch, cu.chunk))
    ids = np.asarray(cu.items["ids"])
    if cu.id_base is not None:  # positions of a chunk whose ids are a range: the ids are base + position
        base, small = int(cu.id_base), not len(ids) or int(ids.max()) < 1 << 32
        ids_out = ids.astype(np.uint32) if small else ids.astype(np.int64) + base
    else:
        ids = ids.astype(np.int64, copy=False)
        base = int(ids.min()) if len(ids) else 0
        small = not len(ids) or int(ids.max()) - base < 1 << 32
        ids_out = (ids - base).astype(np.uint32) if small else ids
    header = {"epoch": cu.epoch, "chunk": cu.chunk, "level": cu.level, "count": cu.count, "items": int(len(ids)),
              "ids_base": base if small else 0, "ids_dtype": "uint32" if small else "int64", "num_long": cu.num_long,
              "longest": cu.longest, "shortest": cu.shortest,
              "longest_target": cu.longest_target, "packing": cu.packing, "item_arrays": sorted(cu.items),
              "complete": bool(cu.candidates.get("complete", True)),
              "ranked": cu.ranked, "fixed_batch": cu.fixed_batch, "source_tokens": cu.source_tokens,
              "max": {k: _largest(v) for k, v in cu.units.items()}}
    stored = {item: stored_dtype(values) for item, values in cu.items.items() if item != "ids"}
    header["item_dtypes"] = {item: dtype.name for item, dtype in stored.items()}
    arrays = {f"unit_{k}": v for k, v in cu.units.items()}
    arrays.update({f"cand_{k}": np.asarray(v) for k, v in cu.candidates.items() if k != "complete"})
    arrays.update(offsets=cu.offsets, long_ids=cu.long_ids, tail_ids=cu.tail_ids,
                  header=np.frombuffer(json.dumps(header).encode(), np.uint8))
    if cu.long_sources is not None:  # a mixture: the sources of the listed ids
        arrays["long_sources"] = cu.long_sources
    if cu.tail_sources is not None:
        arrays["tail_sources"] = cu.tail_sources
    try:
        for item, values in cu.items.items():  # one converted array at a time
            _write_raw(f"{name}.{item}.bin", ids_out if item == "ids" else np.asarray(values, stored[item]))
        with open(name + ".npz.tmp", "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(name + ".npz.tmp", name + ".npz")  # the table last: a job is done when it exists
    except OSError as exc:
        raise OutputError(f"cannot write the plan's temporary files in {directory}: {exc.strerror or exc}") from None


@dataclass
class ChunkTable:
    """What phase 2 reads of a chunk: its header, candidates and dropped ids, held; its unit columns
    and offsets, read from the file on each access (``units[name]``, ``offsets``), so a caller holds
    one chunk's column at a time."""

    path: str
    header: dict
    candidates: dict
    long_ids: np.ndarray
    tail_ids: np.ndarray
    long_sources: np.ndarray | None = None  # a mixture: the source of each listed long id
    tail_sources: np.ndarray | None = None  # a mixture: the source of each tail id

    @property
    def count(self) -> int:
        return int(self.header["count"])

    @property
    def units(self) -> _Columns:
        return _Columns(self.path, "unit_")

    @property
    def offsets(self) -> np.ndarray:
        return _Columns(self.path, "")["offsets"]


class _Columns:
    """The arrays ``PREFIX + name`` of a chunk's table, each read when asked for."""

    def __init__(self, path: str, prefix: str):
        self.path, self.prefix = path, prefix

    def __getitem__(self, name: str) -> np.ndarray:
        with np.load(self.path) as z:
            return z[self.prefix + name]


def read_table(directory: str, epoch: int, chunk: int) -> ChunkTable:
    path = os.path.join(directory, job_name(epoch, chunk) + ".npz")
    with np.load(path) as z:
        header = json.loads(bytes(z["header"]).decode())
        cands = {k[5:]: z[k] for k in z.files if k.startswith("cand_")}
        cands["complete"] = header["complete"]
        return ChunkTable(path, header, cands, z["long_ids"], z["tail_ids"],
                          z["long_sources"] if "long_sources" in z.files else None,
                          z["tail_sources"] if "tail_sources" in z.files else None)


class ItemReader:
    """Item ranges of one chunk's files, read with ``pread`` (no file held in memory)."""

    def __init__(self, directory: str, table: ChunkTable):
        self.name = os.path.join(directory, job_name(table.header["epoch"], table.header["chunk"]))
        self.base = int(table.header["ids_base"])
        stored = table.header.get("item_dtypes", {})
        self.dtypes = {item: np.dtype(table.header["ids_dtype"] if item == "ids" else stored.get(item, "int32"))
                       for item in table.header["item_arrays"]}
        self._fds: dict = {}

    def dtype_of(self, item: str) -> np.dtype:
        """The dtype :meth:`read` returns ``item`` in (sample ids: int64; the others int32, however stored)."""
        return np.dtype(np.int64) if item == "ids" else np.dtype(ITEM_DTYPES[item])

    def read(self, item: str, lo: int, hi: int) -> np.ndarray:
        """Items ``[lo, hi)`` of ``item`` (sample ids as int64)."""
        out = np.empty(hi - lo, self.dtype_of(item))
        self.read_into(item, lo, hi, out)
        return out

    def read_into(self, item: str, lo: int, hi: int, out: np.ndarray) -> None:
        """Items ``[lo, hi)`` of ``item`` into ``out`` (``hi - lo`` values of :meth:`dtype_of`)."""
        dtype = self.dtypes[item]
        fd = self._fds.get(item)
        if fd is None:
            fd = self._fds[item] = os.open(f"{self.name}.{item}.bin", os.O_RDONLY)
        raw = out if out.dtype == dtype else np.empty(hi - lo, dtype)
        view, at, want = memoryview(raw.view(np.uint8)), 0, (hi - lo) * dtype.itemsize
        while at < want:
            got = os.preadv(fd, [view[at:]], lo * dtype.itemsize + at)
            if got <= 0:
                raise OutputError(f"{self.name}.{item}.bin is shorter than its table says (a temporary file was "
                                  "changed while the plan was written)")
            at += got
        if raw is out:
            return
        if item == "ids":  # stored as uint32 offsets from the chunk's smallest id
            np.add(raw, self.base, out=out, dtype=np.int64)
        else:
            out[:] = raw

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __getstate__(self) -> dict:
        """Pickled without its open files (a worker that unpickles it opens its own)."""
        return {**self.__dict__, "_fds": {}}
