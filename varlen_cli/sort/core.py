"""``varlen sort``: a balanced, deterministic distributed sample sort of a metrics directory.

Each worker reads a contiguous slice of the input rows (``artifacts.row_bounds``), builds the
packed composite key of its rows (``--by`` columns, then the tie-break: ``sample_id`` or a seeded
hash of it; see :mod:`varlen_cli.sort.keys`) and sorts them locally. The workers then agree on exact
splitters by a distributed selection over the composite key: the key is a total order, so the
splitters put global rows ``[N*r/P, N*(r+1)/P)`` on rank r, whatever the key distribution (all keys
equal included). Rows travel with the group's all-to-all (counts first, then each column), each rank
merges the sorted runs it received and writes ``part-RRRRR.parquet``; rank 0 writes the manifest and
renames the directory into place. The concatenated output is the same for any number of workers.

With ``--single-file`` the ranks stream their rows to rank 0 in rank order, one row group at a
time, and rank 0 appends them to one Parquet file: no worker ever holds more than its own share plus
one row group.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field, replace

import numpy as np

from .. import storage
from ..errors import InputError, OutputError, UsageError
from ..runtime import artifacts, freshness, safety
from ..runtime.choices import (
    ALLOW_STALE_HELP,
    DEVICE_HELP,
    NPROC_HELP,
    OVERWRITE_HELP,
    PANEL_RUN,
    PROGRESS_HELP,
    STORAGE_OPTION_HELP,
    Device,
    Engine,
    NanPolicy,
    Ties,
    check_choices,
    doc,
    values,
)
from ..runtime.dist import Dist, check_nproc, fault_point
from ..runtime.executor import execute
from ..runtime.progress import JobProgress
from . import keys as sk

PHASES = ("read", "keys", "local_sort", "splitters", "exchange", "merge", "write")
TIES = values(Ties)
NAN_POLICIES = values(NanPolicy)
ENGINES = values(Engine)


@dataclass(frozen=True)
class SortConfig:
    """Options of ``varlen sort`` (see ``varlen sort --help``).

    ``by`` is a tuple of column names (a comma-separated string is accepted too). ``engine``:
    ``numpy`` sorts on the CPU with numpy, ``torch`` with torch on ``device`` (``auto``: torch with
    ``--device cuda``, numpy otherwise); the result is the same.
    """

    metrics_dir: str = doc(help="Metrics directory from `varlen analyze` (or a sorted directory) to sort; local or an "
                                "s3://... prefix.")
    output: str = doc(help="Sorted directory to write (part-*.parquet + _manifest.json); or an s3://... prefix "
                           "(published manifest last).")
    by: tuple = doc(("difficulty",), "Key column(s), comma-separated, most significant first.")
    descending: bool = doc(False, "Largest keys first (ties still ascending by sample_id).")
    ties: Ties = doc("id", "Order of equal keys: id (ascending sample_id) or shuffle (seeded hash of sample_id).")
    seed: int = doc(0, "Seed of --ties shuffle.")
    nan: NanPolicy = doc("error", "NaN keys: error (refuse) or last (after all other keys).")
    single_file: bool = doc(False, "Write one part-00000.parquet, streamed in rank order, instead of one part per "
                                   "worker.", panel=PANEL_RUN)
    nproc: int = doc(1, NPROC_HELP, panel=PANEL_RUN)
    device: Device = doc("cpu", DEVICE_HELP, panel=PANEL_RUN)
    overwrite: bool = doc(False, OVERWRITE_HELP, panel=PANEL_RUN)
    progress: bool = doc(True, PROGRESS_HELP, panel=PANEL_RUN)
    row_group_size: int = doc(1 << 20, "Rows per Parquet row group of the sorted parts.")
    engine: Engine = doc("auto", "numpy sorts on the CPU with numpy, torch with torch on device (auto: torch with "
                                 "--device cuda, numpy otherwise); the result is the same.")
    allow_stale: bool = doc(False, ALLOW_STALE_HELP, panel=PANEL_RUN)
    storage_options: tuple = doc((), STORAGE_OPTION_HELP, panel=PANEL_RUN)


@dataclass
class SortResult:
    output: str
    num_rows: int
    world_size: int
    rows_per_worker: list
    balance: float
    order: dict
    num_parts: int
    seconds: float
    phases: dict
    peak_rss_bytes: list = field(default_factory=list)
    manifest: dict = field(repr=False, default_factory=dict)


def sort(config: SortConfig) -> SortResult | None:
    """Run ``varlen sort``; returns the result on rank 0 (None on other ranks)."""
    config = replace(config, by=parse_by(config.by))
    check(config)
    storage.configure(config.storage_options)  # the input may be in object storage (workers: the executor)
    check_input(config)
    return execute(run_in_group, config, functools.partial(_count_rows, config))


def _count_rows(config: SortConfig) -> tuple[int, str]:
    """The rows to sort: ``--nproc`` is capped by them (a worker with no row has no work)."""
    return max(1, int(_read_input(config.metrics_dir).get("num_rows", 0))), "row"


def parse_by(by) -> tuple:
    names = tuple(s.strip() for s in by.split(",")) if isinstance(by, str) else tuple(by)
    if not names or any(not n for n in names):
        raise UsageError(f"--by needs column names separated by commas, got {','.join(names)!r}")
    for n in names:
        if names.count(n) > 1:
            raise UsageError(f"--by names column '{n}' more than once")
    return names


def check_input(config: SortConfig) -> None:
    """Refuse a metrics directory that is not one, or lacks the ``--by`` columns."""
    manifest = _read_input(config.metrics_dir)
    freshness.check_inputs(config.metrics_dir, manifest, config.allow_stale, rerun="varlen sort")
    _check_columns(config, manifest)
    safety.check_no_overlap(config.output, [config.metrics_dir])  # same check as every stage (exit 4)


def check(config: SortConfig) -> None:
    """Refuse bad options before any worker starts (``config.by`` already parsed)."""
    check_choices(config)
    if not isinstance(config.seed, int) or config.seed < 0 or config.seed >= 1 << 64:
        raise UsageError(f"--seed must be an integer from 0 to 2**64-1, got {config.seed!r}")
    if config.row_group_size < 1:
        raise UsageError("row_group_size must be positive")
    check_nproc(config.nproc)
    storage.parse_options(config.storage_options)
    if config.engine == "numpy" and config.device == "cuda":
        raise UsageError("engine 'numpy' sorts on the CPU; use engine 'torch' (or 'auto') with --device cuda")


def _read_input(path: str) -> dict:
    manifest = artifacts.read_manifest(path, "metrics directory", "create one with `varlen analyze`")
    rows = sum(int(p["rows"]) for p in manifest.get("parts", []))
    if int(manifest.get("num_rows", rows)) != rows:
        raise InputError(f"{path} is inconsistent: {artifacts.MANIFEST_NAME} says {manifest['num_rows']} rows "
                         f"but its parts hold {rows}")
    return manifest


def _input_schema(path: str, manifest: dict):
    parts = manifest.get("parts", [])
    if not parts:
        return artifacts.metrics_schema()
    return artifacts.open_part(artifacts.part_location(path, parts[0])).schema_arrow.remove_metadata()


def _is_fixed_width(t) -> bool:
    import pyarrow as pa

    return (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
            or pa.types.is_temporal(t)) and not pa.types.is_date64(t)


def _check_columns(config: SortConfig, manifest: dict):
    """The input schema, after checking that the key columns exist and every column can be sorted."""
    import pyarrow as pa

    path = config.metrics_dir
    schema = _input_schema(path, manifest)
    names = schema.names
    for name in config.by:
        if name not in names:
            raise InputError(f"unknown key column '{name}'; {path} has columns {', '.join(names)}")
        t = schema.field(name).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
                or pa.types.is_timestamp(t) or pa.types.is_duration(t)):
            raise InputError(f"key column '{name}' has type {t}; sort keys must be numeric")
    spec = _spec(config)
    if spec.tie_column is not None:
        if "sample_id" not in names:
            raise InputError(f"{path} has no sample_id column (sort needs it to break ties)")
        if not pa.types.is_integer(schema.field("sample_id").type):
            raise InputError(f"column 'sample_id' in {path} has type {schema.field('sample_id').type}, not an integer")
    for f in schema:
        if not _is_fixed_width(f.type):
            raise InputError(f"column '{f.name}' in {path} has type {f.type}; sort carries only numeric columns")
    return schema


def _spec(config: SortConfig) -> sk.KeySpec:
    return sk.KeySpec(by=tuple(config.by), descending=config.descending, ties=config.ties, seed=config.seed,
                      nan=config.nan)


def _use_torch(config: SortConfig) -> bool:
    return config.engine == "torch" or (config.engine == "auto" and config.device == "cuda")


# -- the worker ------------------------------------------------------------------------------------
class _Clock:
    def __init__(self):
        self.times = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.times[phase] += now - self._last
        self._last = now


def run_in_group(config: SortConfig, d: Dist, out: artifacts.AtomicDir, t0: float) -> SortResult | None:
    """One rank's share of ``varlen sort``, writing into the shared temporary output ``out``."""
    path = config.metrics_dir
    manifest = _read_input(path)
    schema = _check_columns(config, manifest)
    spec = _spec(config)
    total = int(manifest.get("num_rows", 0))
    P = d.world_size
    clock = _Clock()

    with JobProgress(d, 3 * total, "sort", show=config.progress) as bar:
        lo, hi = artifacts.row_bounds(total, P, d.rank)
        fault_point("sort.read")
        cols = _read_columns(path, manifest, lo, hi, schema)
        bar.advance(hi - lo)
        clock.lap("read")
        if total:
            cols, words, _, shift = _sort_rows(config, spec, d, cols, total, clock, bar)
        else:
            words, shift = [np.zeros(0, np.int64)], 0
            bar.advance(0)

        # Boundaries: key values for the manifest, and a check that no two rows share a sample_id
        # (the composite key would not be a total order, nor the result independent of P).
        m = len(next(iter(cols.values()))) if cols else 0
        mine = _boundary(spec, cols, words, shift, m)
        everyone = d.all_gather_object(mine)
        _check_unique(everyone, path)
        rows = [b["rows"] for b in everyone]

        fault_point("sort.write")
        if config.single_file:
            _write_single(d, out, schema, cols, rows, config)
        else:
            table = _to_table(cols, schema)
            del cols
            artifacts.write_parquet(table, out.file(artifacts.part_name(d.rank)), config.row_group_size)
            del table
        bar.advance(m)
        clock.lap("write")
        stats = manifest.get("stats") or {}  # the rows are the same: the input's statistics hold
        phases = d.all_reduce(np.array([clock.times[p] for p in PHASES]), op="max")
        peaks = d.all_gather_object((_peak_rss(), _cpu_seconds()))  # also: every part is written
    if not d.is_main:
        return None
    return _finish(config, d, out, manifest, everyone, stats, dict(zip(PHASES, map(float, phases))), peaks, t0)


def _read_columns(path: str, manifest: dict, lo: int, hi: int, schema) -> dict:
    """Rows [lo, hi) of the input as one numpy array per column.

    Like ``artifacts.read_row_range``, but streams the overlapping row groups into preallocated
    arrays, so the peak is the rows plus one row group (not twice the rows).
    """
    import pyarrow as pa

    n = hi - lo
    names = schema.names
    cols = {f.name: np.empty(n, dtype=pa.array([], type=f.type).to_numpy(zero_copy_only=False).dtype)
            for f in schema}
    filled, offset = 0, 0
    for part in manifest.get("parts", []):
        rows = int(part["rows"])
        a, b = max(lo, offset), min(hi, offset + rows)
        offset += rows
        if b <= a:
            continue
        part_path = artifacts.part_location(path, part)
        try:
            pf = artifacts.open_part(part_path)
            rg_offset = 0
            for rg in range(pf.num_row_groups):
                rg_rows = pf.metadata.row_group(rg).num_rows
                x, y = max(a - (offset - rows), rg_offset), min(b - (offset - rows), rg_offset + rg_rows)
                rg_offset += rg_rows
                if y <= x:
                    continue
                table = pf.read_row_group(rg, columns=names, use_threads=True).slice(x - (rg_offset - rg_rows), y - x)
                for name in names:
                    column = table.column(name)
                    if column.null_count:
                        raise InputError(f"column '{name}' in {part_path} has {column.null_count:,} null values")
                    cols[name][filled:filled + (y - x)] = column.to_numpy()
                filled += y - x
                del table
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"cannot read {part_path}: {exc}") from None
    if filled != n:
        raise InputError(f"{path} is incomplete: its parts hold fewer rows than {artifacts.MANIFEST_NAME} says")
    return cols


def _key_columns(spec: sk.KeySpec, cols: dict) -> dict:
    """The columns the key reads, with datetime types seen as int64."""
    out = {}
    for name in set(spec.by) | ({"sample_id"} if "sample_id" in cols else set()):
        a = cols[name]
        out[name] = a.view(np.int64) if a.dtype.kind in "mM" else a
    return out


def _sort_rows(config, spec, d: Dist, cols: dict, total: int, clock: _Clock, bar):
    """Keys, local sort, splitters, exchange and merge: this rank's rows of the global order.

    Returns (columns, sorted key words, layout, index bits in the words).
    """
    P = d.world_size
    n = len(next(iter(cols.values())))
    keycols = _key_columns(spec, cols)
    stats = sk.merge_stats(d.all_gather_object(sk.local_stats(spec, keycols)))
    sk.check_nans(spec, stats, config.metrics_dir)
    lay = sk.layout(spec, stats)
    ib = sk.index_bits(-(-total // P))  # bits of a row index: no rank holds more than ceil(N/P) rows
    use_torch = _use_torch(config)
    # A one-word key with room for a row index sorts as plain integers (np.sort, not argsort).
    index_trick = not use_torch and lay.words == 1 and lay.bits + ib <= 64
    shift = ib if index_trick else 0
    words = sk.pack(spec, stats, lay, keycols, n, extra_bits=shift)
    clock.lap("keys")

    if use_torch:
        del keycols
        return _sort_rows_torch(config, d, cols, words, lay, total, clock, bar) + (lay, 0)

    mask = np.int64((1 << ib) - 1)
    order, words = _local_sort(lay, stats, keycols, words, n, mask if index_trick else None)
    del keycols
    # Columns the sorted words give back (keys, sample_id) are neither permuted nor exchanged.
    dtypes = {name: a.dtype for name, a in cols.items()}
    decoded = sk.decodable(spec, stats, lay, dtypes)
    for name in decoded:
        del cols[name]
    clock.lap("local_sort")

    if P == 1:
        for name in list(cols):
            cols[name] = cols[name][order]
        del order
        clock.lap("merge")
        bar.advance(n)
    else:
        targets = sk.split_targets(total, P)
        bounds = sk.word_bounds(lay, shift)
        positions = sk.split_positions([words], targets, bounds, reduce=lambda c: d.all_reduce(c))[0]
        sends = sk.send_counts(positions, n)
        clock.lap("splitters")

        fault_point("sort.exchange")
        ex = _Exchange(d, sends)
        recv = {}
        for name in list(cols):
            recv[name] = ex.run(cols.pop(name)[order])
        del order
        words = [ex.run(w) for w in words]
        m = ex.received
        clock.lap("exchange")
        bar.advance(n)

        # Merge the P sorted runs received.
        if index_trick:
            w = words[0]
            w &= ~mask
            w |= np.arange(m, dtype=np.int64)
            w.sort(kind="stable")  # timsort: merges the runs
            order = w & mask
        else:
            order = sk.lex_order(words, runs=True)
            words = [w[order] for w in words]
        cols = {name: recv.pop(name)[order] for name in list(recv)}
        del order
    for name, index in decoded.items():
        cols[name] = sk.decode(spec, stats, lay, words, name, index, dtypes[name], extra_bits=shift)
    clock.lap("merge")
    return cols, words, lay, shift


def _local_sort(lay: sk.KeyLayout, stats, keycols: dict, words: list, n: int, mask: np.int64 | None):
    """(order, words): this rank's row order by key and the key words in that order. ``mask`` (the
    row-index bits) when the one word has room for a row index: then it sorts as plain integers."""
    if mask is not None:
        w = words[0]
        w |= np.arange(n, dtype=np.int64)
        w.sort()
        return w & mask, words
    order = _id_order(lay, stats, keycols, words, n)
    if order is None:
        order = sk.lex_order(words)
        words = [w[order] for w in words]
    return order, words


def _id_order(lay: sk.KeyLayout, stats, keycols: dict, words: list, n: int):
    """Sort a one-word key whose low field is sample_id, when this rank's sample ids are the
    contiguous run first, first+1, ...: the sorted words then give back each row's index, so
    ``np.sort`` replaces an ``argsort`` (a metrics directory's slices are such runs)."""
    if lay.words != 1 or not lay.id_last or lay.fields[-1][1] >= 63 or n == 0:
        return None
    ids = keycols["sample_id"]
    first = int(ids[0])
    # n increasing integers from first to first + n - 1 are exactly first, first+1, ...
    if ids.dtype.kind != "i" or int(ids[-1]) - first != n - 1 or not bool((ids[1:] > ids[:-1]).all()):
        return None
    w = words[0]
    w.sort()
    order = w & np.int64((1 << lay.fields[-1][1]) - 1)  # sample_id - min(sample_id)
    order += np.int64(int(stats[-1].vmin) - first)
    return order


class _Exchange:
    """All-to-all of row arrays through the process group: counts first (once), then one call per array."""

    def __init__(self, d: Dist, sends: np.ndarray):
        self.d = d
        self.sends = [int(x) for x in sends]
        self.recvs = [int(x) for x in d.exchange_counts(np.asarray(sends, dtype=np.int64))]
        self.received = sum(self.recvs)

    def run_tensor(self, t):
        """Exchange a tensor whose first dimension is the rows (already on the device)."""
        if self.d.backend != "torch":  # a torch-free local group moves numpy arrays (CPU only)
            import torch

            return torch.from_numpy(self.run(t.cpu().numpy()))
        import torch.distributed as tdist

        out = t.new_empty((self.received,) + tuple(t.shape[1:]))
        tdist.all_to_all_single(out, t, output_split_sizes=self.recvs, input_split_sizes=self.sends)
        return out

    def run(self, a: np.ndarray) -> np.ndarray:
        """Exchange a numpy array of any fixed-width dtype along its first dimension."""
        return self.d.all_to_all_rows(a, self.sends, self.recvs)


# -- torch engine (GPU, or CPU for tests) ---------------------------------------------------------
def _torch_lex_order(torch, words: list):
    """Permutation sorting rows by (words[0], words[1], ...): stable sorts from the last word."""
    order = None
    for w in reversed(words):
        key = w if order is None else w[order]
        _, idx = torch.sort(key, stable=True)
        order = idx if order is None else order[idx]
    return order


def _sort_rows_torch(config, d: Dist, cols: dict, words: list, lay: sk.KeyLayout, total: int, clock: _Clock, bar):
    import torch

    P = d.world_size
    dev = torch.device("cuda") if config.device == "cuda" else torch.device("cpu")
    n = len(words[0])
    dtypes = {name: a.dtype for name, a in cols.items()}

    def to_dev(a):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).reshape(len(a), a.dtype.itemsize)).to(dev)

    tw = [torch.from_numpy(w).to(dev) for w in words]
    order = _torch_lex_order(torch, tw)
    tw = [w[order] for w in tw]
    tcols = {name: to_dev(cols.pop(name)).index_select(0, order) for name in list(cols)}
    del order
    clock.lap("local_sort")
    if P > 1:
        targets = sk.split_targets(total, P)
        bounds = sk.word_bounds(lay)
        host_words = [w.cpu().numpy() for w in tw]
        positions = sk.split_positions([host_words], targets, bounds, reduce=lambda c: d.all_reduce(c))[0]
        del host_words
        sends = sk.send_counts(positions, n)
        clock.lap("splitters")
        fault_point("sort.exchange")
        ex = _Exchange(d, sends)
        tcols = {name: ex.run_tensor(tcols.pop(name)) for name in list(tcols)}
        tw = [ex.run_tensor(w) for w in tw]
        clock.lap("exchange")
        bar.advance(n)
        order = _torch_lex_order(torch, tw)
        tw = [w[order] for w in tw]
        tcols = {name: t.index_select(0, order) for name, t in tcols.items()}
        del order
    else:
        bar.advance(n)
    out = {name: tcols.pop(name).cpu().numpy().view(dtypes[name]).reshape(-1) for name in list(tcols)}
    words = [w.cpu().numpy() for w in tw]
    clock.lap("merge")
    return out, words


# -- boundaries, uniqueness, output ---------------------------------------------------------------
def _plain(v):
    if isinstance(v, np.datetime64) or isinstance(v, np.timedelta64):
        return str(v)
    v = v.item() if hasattr(v, "item") else v
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def _boundary(spec: sk.KeySpec, cols: dict, words: list, shift: int, m: int) -> dict:
    """This rank's row count, first/last key values and words, and a duplicated sample id if any."""
    info = {"rows": m, "first_key": None, "last_key": None, "first_words": None, "last_words": None, "dup": None}
    if m == 0:
        return info
    key = [w >> np.int64(shift) if shift else w for w in words]  # drop the row-index bits
    info["first_key"] = [_plain(cols[c][0]) for c in spec.by]
    info["last_key"] = [_plain(cols[c][-1]) for c in spec.by]
    info["first_words"] = [int(w[0]) for w in key]
    info["last_words"] = [int(w[-1]) for w in key]
    if m > 1:
        same = key[0][1:] == key[0][:-1]
        for w in key[1:]:
            same &= w[1:] == w[:-1]
        hit = np.flatnonzero(same)
        if len(hit) and "sample_id" in cols:
            info["dup"] = int(cols["sample_id"][hit[0]])
    return info


def _peak_rss() -> int | None:
    """This process's peak resident memory so far, in bytes, from the OS (None where unknown)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Unix
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if os.uname().sysname == "Darwin" else 1024)


def _cpu_seconds() -> float:
    """CPU seconds (user + system) this process has used so far."""
    t = os.times()
    return float(t.user + t.system)


def _check_unique(everyone: list, path: str) -> None:
    dups = [b["dup"] for b in everyone if b["dup"] is not None]
    prev = None
    for b in everyone:
        if b["rows"] == 0:
            continue
        if prev is not None and prev["last_words"] == b["first_words"]:
            dups.append("(at a worker boundary)")
        prev = b
    if dups:
        raise InputError(f"sample_id {dups[0]} appears more than once in {path}; sample ids must be unique")


def _to_table(cols: dict, schema):
    import pyarrow as pa

    arrays = [pa.array(cols[f.name], type=f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _write_single(d: Dist, out: artifacts.AtomicDir, schema, cols: dict, rows: list, config: SortConfig) -> None:
    """Stream every rank's rows, in rank order, into one Parquet file written by rank 0.

    Ranks > 0 send their rows to rank 0 one row group at a time (point-to-point, one message per
    column); rank 0 appends each to its ``ParquetWriter``. Memory: a rank's own rows plus one row
    group; rank 0 encodes the whole file.
    """
    import pyarrow.parquet as pq

    G = config.row_group_size
    target = out.file(artifacts.part_name(0))
    if not d.distributed:
        artifacts.write_parquet(_to_table(cols, schema), target, G)
        return
    dtypes = {name: a.dtype for name, a in cols.items()}
    if d.rank != 0:
        n = rows[d.rank]
        for a in range(0, n, G):
            for f in schema:
                d.send_rows(cols[f.name][a:a + G], dst=0)
        return
    try:  # a full disk (ENOSPC, EFBIG) while streaming is the user's disk: OutputError, exit 4
        with pq.ParquetWriter(target, schema, compression="zstd", compression_level=1) as writer:
            if rows[0]:
                writer.write_table(_to_table(cols, schema), row_group_size=G)
            for src in range(1, d.world_size):
                for a in range(0, rows[src], G):
                    c = min(G, rows[src] - a)
                    chunk = {f.name: d.recv_rows(np.empty(c, dtype=dtypes[f.name]), src=src) for f in schema}
                    writer.write_table(_to_table(chunk, schema), row_group_size=G)
    except OSError as exc:
        raise OutputError(f"cannot write {target}: {exc}") from None


def _finish(config: SortConfig, d: Dist, out: artifacts.AtomicDir, manifest: dict, everyone: list, stats: dict,
            phases: dict, peaks: list, t0: float) -> SortResult:
    rows = [int(b["rows"]) for b in everyone]
    total = sum(rows)
    balance = max(rows) / (total / len(rows)) if total else 1.0
    if config.single_file:
        nonempty = [b for b in everyone if b["rows"]]
        parts = [{"file": artifacts.part_name(0), "rows": total,
                  "first_key": nonempty[0]["first_key"] if nonempty else None,
                  "last_key": nonempty[-1]["last_key"] if nonempty else None}]
    else:
        parts = [{"file": artifacts.part_name(r), "rows": b["rows"], "first_key": b["first_key"],
                  "last_key": b["last_key"]} for r, b in enumerate(everyone)]
    cfg = artifacts.config_dict(config)
    # Identity: what was computed, not how it ran or was laid out (the rows are the same).
    ident = {k: v for k, v in cfg.items() if k not in ("engine", "row_group_size", "single_file")}
    if config.ties == "id":
        ident["seed"] = 0  # the seed changes nothing without --ties shuffle
    order = {"by": list(config.by), "descending": config.descending, "ties": config.ties, "seed": config.seed,
             "nan": config.nan}
    input_id = manifest.get("artifact_id") or manifest.get("dataset", {}).get("digest", "")
    result_manifest = {
        "format": artifacts.METRICS_FORMAT,
        "format_version": artifacts.FORMAT_VERSION,
        "kind": "sorted",
        "stage": "sort",
        **artifacts.provenance(),
        "config": cfg,
        "world_size": d.world_size,
        "dataset": manifest.get("dataset"),
        "artifact_id": artifacts.artifact_id("sort", ident, input_id, [total]),
        "input": {"path": storage.absolute(config.metrics_dir), "artifact_id": manifest.get("artifact_id")},
        "order": order,
        "columns": manifest.get("columns") or {},
        "num_rows": total,
        "parts": parts,
        "stats": stats,
        "balance": balance,
        "rows_per_worker": rows,
        "seconds": phases,
        "peak_rss_bytes": [p for p, _ in peaks],
        "cpu_seconds": [round(c, 3) for _, c in peaks],
    }
    artifacts.atomic_write_json(out.file(artifacts.MANIFEST_NAME), result_manifest)
    out.commit()
    return SortResult(output=out.path, num_rows=total, world_size=d.world_size, rows_per_worker=rows,
                      balance=balance, order=order, num_parts=len(parts), seconds=time.perf_counter() - t0,
                      phases=phases, peak_rss_bytes=result_manifest["peak_rss_bytes"], manifest=result_manifest)
