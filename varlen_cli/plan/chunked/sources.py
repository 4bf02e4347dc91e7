"""What a chunked plan plans from: its chunk sources.

A source is a sequence of rows, one per sample entry of an epoch, cut into chunks by position
(:class:`~.chunks.ChunkSpec`), and read a chunk at a time as :class:`~.chunks.ChunkData`:

* :class:`DirectoryInput`: a metrics or sorted directory (random orders read canonical chunks:
  sample-id ranges, through a scatter for a sorted directory; curriculum orders ranges of its rows);
* :class:`MixtureInput`: a mixture's *virtual rows* (``varlen plan --mix``): every source's samples,
  each as many times as its weight gives it (:func:`varlen_cli.checks.mixture_copies`), in one
  sequence that every order reads by ranges. Without a curriculum the sequence is source after
  source, each its rows ``floor(w)`` times (``tiles``) then the rows of its seeded extra subset (row
  order); with ``--order curriculum``/``reverse`` it is sorted by (difficulty, source, sample id) over
  the union, the copies of a sample together. Both are built in bounded memory (:meth:`prepare`,
  shared out by rank): each source's ids checked and its extra rows listed (a bitmap of its ids and
  the extra rows, in the spill directory); for a curriculum, *runs* (pieces of at most a chunk of
  each source's rows, sorted) written there too, and a range of the sorted sequence is the merge of
  each run's part of it, found by a binary search over the runs (:meth:`MixtureInput._split`).

A replan's first epoch holds what the parent's epoch in progress had left (:class:`Left`): the
samples left whole (a bitmap; for a mixture, the copies of each sample left), and the *pieces* left
of samples split across the step (``--split-long``), placed right after their sample's place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ... import format
from ...errors import InputError, OutputError
from ...runtime import artifacts
from ..writer import input_location, location_record
from .chunks import TARGET_COLUMN, ChunkData, ChunkSource, ChunkSpec, InputRows, Scatter

DIFFICULTY = "difficulty"
RUN_DTYPES = {"d": np.uint64, "v": np.int64, "length": np.int64, "cum": np.int64, "target": np.int64}


def _save(path: str, values: np.ndarray) -> None:
    """``values`` as a raw file (read back by :func:`_mapped` and :func:`_part`)."""
    try:
        np.ascontiguousarray(values).tofile(path)
    except OSError as exc:
        raise OutputError(f"cannot write the plan's temporary files in {os.path.dirname(path)}: "
                          f"{exc.strerror or exc}") from None


def _mapped(path: str, dtype) -> np.ndarray:
    """A raw file as a read-only memory map (the pages touched only)."""
    if not os.path.getsize(path):
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class _Sorted:
    """A sorted column of a run in a raw file, searched without holding or mapping it: every
    :data:`STRIDE`-th value is held (written beside it), and a search reads the one block between two
    of those."""

    STRIDE = 4096

    def __init__(self, path: str, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self.n = os.path.getsize(path) // self.dtype.itemsize
        self.index = np.fromfile(path + ".idx", dtype=self.dtype)

    @classmethod
    def write(cls, path: str, values: np.ndarray) -> None:
        _save(path, values)
        _save(path + ".idx", values[::cls.STRIDE])

    def at(self, i: int):
        return _part(self.path, self.dtype, i, i + 1)[0]

    def search(self, x, side: str, lo: int = 0, hi: int | None = None) -> int:
        """``lo + np.searchsorted(values[lo:hi], x, side)`` (``values[lo:hi]`` sorted)."""
        hi = self.n if hi is None else hi
        if hi <= lo:
            return lo
        s = self.STRIDE
        first, last = -(-lo // s), (hi - 1) // s + 1  # the held values inside [lo, hi)
        k = int(np.searchsorted(self.index[first:last], x, side))
        a = lo if k == 0 else (first + k - 1) * s  # the answer lies in (a, b]
        b = hi if first + k >= last else (first + k) * s
        return a + int(np.searchsorted(_part(self.path, self.dtype, a, b), x, side))


def _part(path: str, dtype, lo: int, hi: int) -> np.ndarray:
    """Values ``[lo, hi)`` of a raw file, read (not mapped: what is read is not held)."""
    dtype = np.dtype(dtype)
    return np.fromfile(path, dtype=dtype, count=max(hi - lo, 0), offset=lo * dtype.itemsize)


def open_manifest(path: str, allow_stale: bool) -> dict:
    """The manifest of a metrics or sorted directory, its sources checked for freshness."""
    from ...runtime import freshness

    manifest = artifacts.read_manifest(path, what="metrics or sorted directory",
                                       hint="create one with `varlen analyze` (and `varlen sort` for curriculum order)")
    freshness.check_inputs(path, manifest, allow_stale, rerun="varlen sort")
    return manifest


# -- one metrics or sorted directory -------------------------------------------------------------------
class DirectoryInput:
    """The rows of one metrics or sorted directory (see the module docstring)."""

    mixture = None
    num_sources = 1

    def __init__(self, path: str, manifest: dict):
        self.rows = InputRows(path, manifest)
        self.manifest = manifest
        self.kind = manifest.get("kind", "metrics")
        self.scatter: Scatter | None = None

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    @property
    def has_target(self) -> bool:
        return self.rows.has_target

    @property
    def paths(self) -> list[str]:
        return [self.rows.path]

    def describe(self, n: int) -> str:
        return f"{n:,} samples"

    def prepare(self, spec: ChunkSpec, directory: str, d, canonical: bool) -> None:
        """A sorted directory read in canonical chunks (``canonical``: some epoch's order is not a
        curriculum): its rows scattered by the chunk of their id, shared out by rank."""
        if spec.count > 1 and self.kind != "metrics" and canonical:
            self.scatter = Scatter(self.rows, spec, directory)
            self.scatter.write(d.rank, d.world_size)

    def reader(self, spec: ChunkSpec, mode_curricular: bool, reverse: bool):
        return ChunkSource(self.rows, spec, curricular=mode_curricular, reverse=reverse, scatter=self.scatter)

    def census(self, spec: ChunkSpec, k: int, target: bool = False) -> ChunkData:
        """The lengths (and ``target``: the target lengths) of rows ``bounds(k)``: a share of the census,
        every row once over all ``k``."""
        lo, hi = spec.bounds(k)
        got = self.rows.read(lo, hi, columns=("length",) + ((TARGET_COLUMN,) if target else ()))
        return ChunkData(k, np.zeros(0, np.int64), got["length"], None, got.get(TARGET_COLUMN))

    def missing_target(self) -> str | None:
        """The input without a ``target_length`` column (two budgets need one), or None."""
        return None if self.has_target else self.rows.path

    def record(self, c) -> dict:
        """The metadata's ``input``."""
        manifest = self.manifest
        return {**input_location(c), "kind": manifest.get("kind"),
                "artifact_id": manifest.get("artifact_id"), "num_rows": int(self.num_rows),
                "dataset_digest": (manifest.get("dataset") or {}).get("digest")}


# -- a mixture -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MixSource:
    """One source of a mixture: ``name=DIR:weight``."""

    name: str
    path: str
    weight: float


def _ordinal(difficulty: np.ndarray) -> np.ndarray:
    """Order-preserving uint64 keys of float64 difficulties, as ``np.lexsort`` orders them (-0.0 = 0.0;
    every NaN equal, after every number)."""
    d = np.asarray(difficulty, np.float64) + 0.0
    bits = d.view(np.uint64)
    out = np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))
    out[np.isnan(d)] = np.uint64(np.iinfo(np.uint64).max)
    return out


class _IdCheck:
    """A source's sample ids, fed window by window: they must be ``0..N-1``, each once (the messages of
    ``reader.check_ids``); one bitmap of N bits once they leave id order."""

    def __init__(self, n: int, path: str):
        self.n, self.path, self.at, self.seen, self.twice = n, path, 0, None, None

    def update(self, ids: np.ndarray) -> None:
        from ...checks import Bitmap

        lo = self.at
        self.at += len(ids)
        in_order = not len(ids) or (int(ids[0]) == lo and int(ids[-1]) == lo + len(ids) - 1
                                    and bool(np.all(ids[1:] > ids[:-1])))
        if in_order and self.seen is None:
            return
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise InputError(f"{self.path} has sample_id {bad:,}, outside 0..{self.n - 1:,}: sample ids must be the "
                             "rows' indices 0..N-1 (re-run `varlen analyze`)")
        if self.seen is None:
            self.seen = Bitmap(self.n)
            self.seen.set(np.arange(lo, dtype=np.int64))  # the rows before were in id order
        again = self.seen.test_and_set(ids)
        dup = np.flatnonzero(again | _repeats(ids))
        if len(dup) and self.twice is None:
            self.twice = int(ids[dup[0]])

    def done(self) -> None:
        if self.twice is not None:
            from ...checks import Bitmap

            never = self.seen.clear_keys(Bitmap(self.n), 1)
            raise InputError(f"{self.path} has sample_id {self.twice:,} more than once"
                             + (f" (and {int(never[0]):,} never)" if len(never) else "")
                             + ": sample ids must be the rows' indices 0..N-1, each once (re-run `varlen analyze`)")


def _repeats(ids: np.ndarray) -> np.ndarray:
    """Mask of the ids that repeat an earlier one of the same array."""
    order = np.argsort(ids, kind="stable")
    rep = np.zeros(len(ids), bool)
    rep[order[1:]] = ids[order[1:]] == ids[order[:-1]]
    return rep


class MixtureInput:
    """A mixture's virtual rows (see the module docstring). ``sources``: the mixture's; ``recorded``: a
    parent plan's entries of them (each source must still be the one it planned); ``curricular``: the
    plan's order is curriculum or reverse (the sequence is sorted over the union)."""

    kind = "mixture"

    def __init__(self, sources: list, seed: int, curricular: bool, allow_stale: bool, recorded: list | None = None):
        self.sources, self.seed, self.curricular = list(sources), int(seed), curricular
        self.manifests, self.rows = [], []
        for k, s in enumerate(self.sources):
            manifest = open_manifest(s.path, allow_stale)
            rows = InputRows(s.path, manifest)
            if recorded is not None:
                check_same_source(s, recorded[k], manifest, rows.num_rows)
            if rows.num_rows == 0:
                raise InputError(f"{s.path} holds no samples")
            self.manifests.append(manifest)
            self.rows.append(rows)
        self.sizes = np.array([r.num_rows for r in self.rows], np.int64)
        self.whole = np.array([int(np.floor(s.weight)) for s in self.sources], np.int64)
        self.extra_n = np.array([int(round((s.weight - w) * n)) for s, w, n in zip(self.sources, self.whole,
                                                                                  self.sizes)], np.int64)
        self.offset = np.concatenate([[0], np.cumsum(self.sizes)])  # a sample's key: offset[source] + id
        # the tile order: per source, floor(w) tiles of its rows then its extra rows
        per_source = self.whole * self.sizes + self.extra_n
        self.source_start = np.concatenate([[0], np.cumsum(per_source)])
        self.num_rows = int(self.source_start[-1])
        self.has_target = any(r.has_target for r in self.rows)
        self.directory: str | None = None
        self.piece_size = 1
        self.runs: list = []
        self._splits: dict = {}

    @property
    def num_sources(self) -> int:
        return len(self.sources)

    @property
    def paths(self) -> list[str]:
        return [s.path for s in self.sources]

    @property
    def mixture(self) -> list[dict]:
        """The metadata's ``mixture.sources`` entries (before their tokens per epoch)."""
        return [{"name": s.name, "path": s.path, "weight": s.weight, "num_rows": int(n),
                 "artifact_id": m.get("artifact_id"), "dataset_digest": (m.get("dataset") or {}).get("digest"),
                 "samples_per_epoch": int(self.source_start[k + 1] - self.source_start[k])}
                for k, (s, n, m) in enumerate(zip(self.sources, self.sizes, self.manifests))]

    def describe(self, n: int) -> str:
        return f"{n:,} samples of the mixture"

    def record(self, c) -> dict:
        return {"path": None, "kind": "mixture", "artifact_id": None, "num_rows": None, "dataset_digest": None}

    def sources_record(self, c) -> list[dict]:
        """``mixture.sources`` as the plan ``c.output`` records them (paths relative to it too)."""
        return [{"name": e["name"], **location_record(e["path"], c.output),
                 **{k: v for k, v in e.items() if k not in ("name", "path")}} for e in self.mixture]

    # -- phase 0 -----------------------------------------------------------------------------------
    def _name(self, what: str) -> str:
        return os.path.join(self.directory, f"mix-{what}.bin")

    def prepare(self, spec: ChunkSpec, directory: str, d, canonical: bool) -> None:
        """Each source's ids checked and its extra rows listed (source ``k`` by rank ``k mod W``); for a
        curriculum, the runs (every rank its share); the caller's barrier follows each step."""
        self.directory, self.piece_size = directory, int(spec.size)
        for k in range(d.rank, self.num_sources, d.world_size):
            self._prepare_source(k, spec.size)
        if self.curricular:
            d.barrier()
            pieces = self._pieces(spec.size)
            for p in range(d.rank, len(pieces), d.world_size):
                self._write_run(p, *pieces[p])

    def _prepare_source(self, k: int, window: int) -> None:
        """Source ``k``: its ids checked, the bitmap of its extra ids and its extra rows (ascending)."""
        from ...checks import Bitmap, mixture_extra

        rows, n, s = self.rows[k], int(self.sizes[k]), self.sources[k]
        extra = mixture_extra(n, s.weight, self.seed, k)
        bits = Bitmap(n)
        bits.set(extra.astype(np.int64))
        check, found, in_order = _IdCheck(n, rows.path), [], True
        for lo in range(0, n, window):
            ids = rows.read(lo, min(n, lo + window), columns=("sample_id",))["sample_id"]
            check.update(ids)
            in_order = in_order and check.seen is None
            found.append(lo + np.flatnonzero(bits.test(ids)))
        check.done()
        _save(self._name(f"s{k}-extra"), bits.bits)
        _save(self._name(f"s{k}-rows"), extra.astype(np.int64) if in_order else np.concatenate(found))

    def _extra_bits(self, k: int):
        from ...checks import Bitmap

        bits = Bitmap(0)
        bits.n, bits.bits = int(self.sizes[k]), _mapped(self._name(f"s{k}-extra"), np.uint8)
        return bits

    # -- reading ranges of the sequence ------------------------------------------------------------
    def reader(self, spec: ChunkSpec, mode_curricular: bool, reverse: bool):
        return _MixtureChunks(self, spec, reverse)

    def census(self, spec: ChunkSpec, k: int, target: bool = False) -> ChunkData:
        lo, hi = spec.bounds(k)
        return self.read(lo, hi)

    def missing_target(self) -> str | None:
        """A source without a ``target_length`` column (two budgets need one in every source), or None."""
        return next((f"source {s.name!r} ({s.path})" for s, r in zip(self.sources, self.rows) if not r.has_target),
                    None)

    def read(self, lo: int, hi: int) -> ChunkData:
        """Virtual rows ``[lo, hi)`` of the sequence."""
        parts = self._read_sorted(lo, hi) if self.curricular else self._read_tiles(lo, hi)
        if not parts:
            z = np.zeros(0, np.int64)
            return ChunkData(0, z, z, None, z if self.has_target else None, z.astype(np.int32), z, z.astype(bool),
                             in_order=True)
        cat = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        return ChunkData(0, cat["sample_id"], cat["length"], None, cat.get(TARGET_COLUMN),
                         cat["source"].astype(np.int32), cat["copy"], cat["last"], in_order=True)

    def _columns(self, k: int) -> tuple:
        return ("sample_id", "length") + ((TARGET_COLUMN,) if self.rows[k].has_target else ())

    def _with_target(self, k: int, got: dict) -> dict:
        if self.has_target and TARGET_COLUMN not in got:  # a source without target_length: every row's loss tokens
            got[TARGET_COLUMN] = format.loss_targets(got["length"]).astype(np.int64)
        return got

    def _read_tiles(self, lo: int, hi: int) -> list[dict]:
        """``[lo, hi)`` of the tile order: per source, its tiles then its extra rows."""
        parts = []
        for k in range(self.num_sources):
            a, b = max(lo, int(self.source_start[k])), min(hi, int(self.source_start[k + 1]))
            if b <= a:
                continue
            n, first = int(self.sizes[k]), int(self.source_start[k])
            tiles_end = first + int(self.whole[k]) * n
            at = a
            while at < min(b, tiles_end):  # tile c: rows [row, ...) of copy c
                c, row = divmod(at - first, n)
                end = min(b, tiles_end, first + (c + 1) * n)
                got = self._with_target(k, self.rows[k].read(row, row + end - at, columns=self._columns(k)))
                last = np.zeros(end - at, bool) if c + 1 < self.whole[k] else \
                    ~self._extra_bits(k).test(got["sample_id"])  # the last tile: the last copy unless extra
                parts.append({**got, "source": np.full(end - at, k, np.int64), "copy": np.full(end - at, c, np.int64),
                              "last": last})
                at = end
            if at < b:
                parts.append(self._read_extra(k, at - tiles_end, b - tiles_end))
        return parts

    def _read_extra(self, k: int, a: int, b: int) -> dict:
        """Extra rows ``[a, b)`` of source ``k`` (its row order), read a window of rows at a time."""
        rows = _part(self._name(f"s{k}-rows"), np.int64, a, b)
        out: dict = {}
        window, i = self.piece_size, 0
        while i < len(rows):
            lo = int(rows[i])
            j = int(np.searchsorted(rows, lo + window, side="left"))
            got = self.rows[k].read(lo, int(rows[j - 1]) + 1, columns=self._columns(k))
            for name, values in self._with_target(k, got).items():
                out.setdefault(name, []).append(values[rows[i:j] - lo])
            i = j
        got = {name: np.concatenate(v) for name, v in out.items()} if out else \
            {name: np.zeros(0, np.int64) for name in self._columns(k) + ((TARGET_COLUMN,) if self.has_target else ())}
        return {**got, "source": np.full(b - a, k, np.int64), "copy": np.full(b - a, int(self.whole[k]), np.int64),
                "last": np.ones(b - a, bool)}

    # -- the sorted sequence (curriculum): runs ------------------------------------------------------
    def _pieces(self, size: int) -> list[tuple[int, int, int]]:
        out = []
        for k in range(self.num_sources):
            spec = ChunkSpec(int(self.sizes[k]), size)
            out += [(k, *spec.bounds(j)) for j in range(spec.count)]
        return out

    def _write_run(self, p: int, k: int, lo: int, hi: int) -> None:
        """Run ``p``: source ``k``'s rows ``[lo, hi)`` that have copies, sorted by (difficulty, id)."""
        got = self._with_target(k, self.rows[k].read(lo, hi, columns=self._columns(k) + (DIFFICULTY,)))
        ids = got["sample_id"]
        copies = self.whole[k] + self._extra_bits(k).test(ids).astype(np.int64)
        keep = np.flatnonzero(copies > 0)
        d, v = _ordinal(got[DIFFICULTY][keep]), ids[keep] + int(self.offset[k])
        order = np.lexsort((v, d))
        cum = np.concatenate([[0], np.cumsum(copies[keep][order])]).astype(np.int64)
        cols = {"d": d[order], "v": v[order], "length": got["length"][keep][order], "cum": cum}
        if self.has_target:
            cols["target"] = got[TARGET_COLUMN][keep][order]
        for name, values in cols.items():
            (_Sorted.write if name in ("d", "v", "cum") else _save)(self._name(f"r{p}-{name}"), values)

    def _load_runs(self) -> list[dict]:
        """Each run's keys and copies (:class:`_Sorted`), for the binary searches of :meth:`_split`."""
        if not self.runs:
            self.runs = [{name: _Sorted(self._name(f"r{p}-{name}"), RUN_DTYPES[name]) for name in ("d", "v", "cum")}
                         for p in range(len(self._pieces(self.piece_size)))]
        return self.runs

    def _weight(self, runs: list, at: list) -> int:
        return sum(int(r["cum"].at(i)) for r, i in zip(runs, at))

    def _split(self, b: int) -> tuple[list, int, int]:
        """Where virtual position ``b`` falls: per run, its elements before the element holding ``b``;
        that element's run (-1 if none) and how many of its copies lie before ``b``."""
        if b in self._splits:
            return self._splits[b]
        runs = self._load_runs()
        if b <= 0:
            out = ([0] * len(runs), -1, 0)
        elif b >= self.num_rows:
            out = ([r["d"].n for r in runs], -1, 0)
        else:
            lo, hi = 0, (1 << 64) - 1  # the smallest difficulty key whose weight up to it exceeds b
            while lo < hi:
                mid = (lo + hi) // 2
                if self._weight(runs, [r["d"].search(np.uint64(mid), "right") for r in runs]) > b:
                    hi = mid
                else:
                    lo = mid + 1
            key = np.uint64(lo)
            first = [r["d"].search(key, "left") for r in runs]
            last = [r["d"].search(key, "right") for r in runs]

            def before(v: int) -> list:  # per run, the elements before (key, v)
                return [r["v"].search(v, "left", a, z) for r, a, z in zip(runs, first, last)]

            lo, hi = 0, int(self.offset[-1])  # the smallest id key whose weight up to it exceeds b
            while lo < hi:
                mid = (lo + hi) // 2
                if self._weight(runs, before(mid + 1)) > b:
                    hi = mid
                else:
                    lo = mid + 1
            at = before(lo)
            held = next(i for i, (r, a) in enumerate(zip(runs, at)) if a < r["v"].n and int(r["v"].at(a)) == lo
                        and int(r["d"].at(a)) == int(key))
            out = (at, held, b - self._weight(runs, at))
        self._splits[b] = out
        return out

    def _read_sorted(self, lo: int, hi: int) -> list[dict]:
        """``[lo, hi)`` of the sorted sequence: each run's part, merged, the copies expanded."""
        if hi <= lo:
            return []
        (a, run_a, skip), (b, run_b, take) = self._split(lo), self._split(hi)
        names = ("d", "v", "length") + (("target",) if self.has_target else ())
        got: dict = {name: [] for name in names + ("copies", "first", "total")}
        for i in range(len(a)):
            end = b[i] + (1 if i == run_b and take else 0)
            if end <= a[i]:
                continue
            copies = np.diff(_part(self._name(f"r{i}-cum"), np.int64, a[i], end + 1))
            got["total"].append(copies.copy())
            first = np.zeros(len(copies), np.int64)
            if i == run_b and take:
                copies[-1] = take
            if i == run_a:
                copies[0] -= skip
                first[0] = skip
            for name in names:
                got[name].append(_part(self._name(f"r{i}-{name}"), RUN_DTYPES[name], a[i], end))
            got["copies"].append(copies)
            got["first"].append(first)
        cat = {name: np.concatenate(v) for name, v in got.items()}
        order = np.lexsort((cat["v"], cat["d"]))
        copies = cat["copies"][order]
        each = np.repeat(order, copies)
        starts = np.cumsum(copies) - copies
        copy = np.arange(len(each)) - np.repeat(starts, copies) + np.repeat(cat["first"][order], copies)
        source = np.searchsorted(self.offset, cat["v"][each], side="right") - 1
        out = {"sample_id": cat["v"][each] - self.offset[source], "length": cat["length"][each].astype(np.int64),
               "source": source, "copy": copy, "last": copy == cat["total"][each] - 1}
        if self.has_target:
            out[TARGET_COLUMN] = cat["target"][each].astype(np.int64)
        return [out]


class _MixtureChunks:
    """Chunk ``k`` of a mixture's sequence (``reverse``: the reversed sequence's, read back to front)."""

    def __init__(self, mix: MixtureInput, spec: ChunkSpec, reverse: bool):
        self.mix, self.spec, self.reverse = mix, spec, reverse

    def read(self, k: int) -> ChunkData:
        lo, hi = self.spec.bounds(k)
        if self.reverse:
            lo, hi = self.spec.n - hi, self.spec.n - lo
        data = self.mix.read(lo, hi)
        if self.reverse:
            data = data.take(np.arange(data.n - 1, -1, -1))
            data.in_order = True
        data.index = k
        return data


def check_same_source(s: MixSource, recorded: dict, manifest: dict, num_rows: int) -> None:
    """Refuse a mixture source other than the one a parent plan was planned from (its recorded entry)."""
    if int(recorded.get("num_rows", -1)) != num_rows or (recorded.get("artifact_id") and
                                                          recorded["artifact_id"] != manifest.get("artifact_id")):
        raise InputError(f"source {s.name!r} ({s.path}) changed since the plan was made: it has {num_rows:,} samples "
                         f"(artifact {manifest.get('artifact_id')}), the plan was made for "
                         f"{int(recorded.get('num_rows', -1)):,} (artifact {recorded.get('artifact_id')})")


# -- a replan's first epoch ------------------------------------------------------------------------------
@dataclass
class Left:
    """The parent's epoch ``epoch`` at the resume step: what the replan's first epoch holds
    (:func:`varlen_cli.plan.parent.left_samples` reads it). ``consumed``: the samples (first chunks) of
    the steps before; ``whole``: one bit per sample id left whole (one input), or ``copies``: per
    sample key ``offsets[source] + id``, the copies left whole (a mixture); ``pieces``: the chunks left
    of split samples (``ids``, ``start``, ``length``, a mixture's ``source``), which keep their cuts;
    ``dropped``: what the parent's ``--tail drop`` left out of the epoch (``ids``, a mixture's
    ``sources``), listed as dropped from the first epoch too."""

    epoch: int
    consumed: int
    whole: object | None = None  # checks.Bitmap
    copies: np.ndarray | None = None
    offsets: np.ndarray | None = None
    pieces: dict | None = field(default=None, repr=False)
    dropped: dict | None = field(default=None, repr=False)

    def chunk(self, data: ChunkData, too_long: np.ndarray) -> ChunkData:
        """The positions of chunk ``data`` the first epoch holds: those left whole, and the samples
        that fit no microbatch, ``too_long`` (in no plan: counted and dropped as in every epoch), with the
        pieces of the samples whose (last) copy the chunk holds right after its place."""
        if not data.n:
            return data
        ids = data.ids.astype(np.int64)
        key = ids if self.copies is None else self.offsets[data.source.astype(np.int64)] + ids
        pieces, more = self._pieces(data, key)  # more: per position, its sample's pieces that are whole
        if self.copies is not None:
            left = data.copy < self.copies[key] + more
        else:
            left = self.whole.test(ids) | (more > 0)
        left |= too_long
        if pieces is None:
            return data if left.all() else data.take(left)
        return self._with_pieces(data, key, np.flatnonzero(left), pieces)

    def _pieces(self, data: ChunkData, key: np.ndarray) -> tuple[dict | None, np.ndarray]:
        """The pieces whose sample the chunk holds, each with the position of that sample's (last) copy,
        less those that are the whole sample (a first chunk as long as its sample: ``--seq-len``); and
        per position, how many of its sample's pieces are whole (they count as copies left whole)."""
        p = self.pieces
        none = np.zeros(data.n, np.int64)
        if p is None or not len(p.get("ids", ())):
            return None, none
        piece_key = p["ids"] if self.copies is None else self.offsets[p["source"]] + p["ids"]
        places = np.flatnonzero(data.last) if data.last is not None else np.arange(data.n)
        order = np.argsort(key[places], kind="stable")
        sorted_keys = key[places][order]
        at = np.minimum(np.searchsorted(sorted_keys, piece_key), max(len(sorted_keys) - 1, 0))
        found = sorted_keys[at] == piece_key if len(sorted_keys) else np.zeros(len(piece_key), bool)
        place = np.where(found, places[order[at]] if len(sorted_keys) else 0, -1)
        whole = found & (p["start"] == 0) & (p["length"] == data.length[np.maximum(place, 0)])
        if whole.any():
            wk, count = np.unique(piece_key[whole], return_counts=True)
            at_w = np.minimum(np.searchsorted(wk, key), len(wk) - 1)
            none = np.where(wk[at_w] == key, count[at_w], 0)
        mine = np.flatnonzero(found & ~whole)
        return {"place": place[mine], "start": p["start"][mine], "length": p["length"][mine]}, none

    @staticmethod
    def _with_pieces(data: ChunkData, key: np.ndarray, kept: np.ndarray, pieces: dict) -> ChunkData:
        pos = np.concatenate([kept, pieces["place"]])
        order = np.lexsort((np.concatenate([np.zeros(len(kept), np.int64), pieces["start"] + 1]), pos))
        out = data.take(pos[order])
        piece = order >= len(kept)
        which = order[piece] - len(kept)
        out.full = data.length[pos[order]]
        out.start = np.zeros(out.n, np.int64)
        out.start[piece] = pieces["start"][which]
        out.length = out.length.copy()
        out.length[piece] = pieces["length"][which]
        return out
