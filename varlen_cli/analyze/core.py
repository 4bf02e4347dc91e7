"""``varlen analyze``: each sample's length and difficulty, computed across workers.

Each worker takes a contiguous, balanced range of work units (row groups, batches, byte chunks),
computes lengths and difficulty with Arrow compute and numpy, learns its first sample_id from the
all-gathered row counts, and writes ``part-RRRRR.parquet``. Rank 0 writes the manifest once all
parts exist, then renames the directory into place. The concatenated parts are identical for any
number of workers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError, OutputError, UsageError
from ..runtime import artifacts
from ..runtime.choices import NPROC_HELP, Device, check_choices, doc
from ..runtime.dist import Dist, fault_point
from ..runtime.executor import execute
from ..runtime.progress import JobProgress
from .difficulty import call_function, load_function, parse_difficulty, rarity
from .lengths import (
    LengthSpec,
    auto_length,
    check_frames_per_second,
    compute_lengths,
    load_tokenizer,
    numeric_values,
    parse_length,
    token_lengths,
)
from .sources import DEFAULT_CHUNK_BYTES, Reader, SourceFile, Unit, assign, discover, fingerprint, make_units
from .stats import FloatSummary, LengthStats, distribution, float_summary

RARITY_CACHE_BYTES = 512 << 20  # token ids a worker keeps between the two vocab-rarity passes


@dataclass(frozen=True)
class AnalyzeConfig:
    """Options of ``varlen analyze`` (see ``varlen analyze --help``)."""

    sources: tuple = doc(help="Parquet/Arrow/JSONL/text files, directories, globs, or a Hugging Face save_to_disk "
                              "directory; rows are numbered over the files in sorted path order.")
    output: str = doc(help="Metrics directory to write (part-*.parquet + _manifest.json), atomically.")
    length: str = doc("auto", "KIND:COLUMN with KIND list, tokens, chars, bytes, words or value; 'auto' picks a list "
                              "column input_ids/tokens/token_ids, then text (tokens with --tokenizer, else chars), "
                              "then num_tokens/length/duration.")
    tokenizer: str | None = doc(None, "tokenizer.json for --length tokens:COLUMN (truncation and padding are switched "
                                      "off).")
    special_tokens: bool = doc(True, "Count the tokenizer's special tokens (BOS/EOS, CLS/SEP).")
    frames_per_second: float | None = doc(None, "With --length value:COLUMN in seconds: frames = ceil(seconds x F).")
    difficulty: str = doc("length", "Curriculum key: length, value:COLUMN, vocab-rarity, or MODULE:FUNCTION "
                                    "(RecordBatch -> one value per row).")
    nproc: int = doc(1, NPROC_HELP)
    overwrite: bool = doc(False, "Replace an existing output (written atomically either way).")
    device: Device = doc("cpu", "cpu (--nproc: local group; torchrun: gloo) or cuda (nccl).")
    chunk_bytes: int = doc(DEFAULT_CHUNK_BYTES, "Bytes of input a worker reads per chunk.")
    progress: bool = doc(True, "Show a progress bar on rank 0 (only on a terminal).")


@dataclass
class AnalyzeResult:
    output: str
    num_samples: int
    num_files: int
    num_parts: int
    length: str
    difficulty: str
    stats: dict
    difficulty_stats: dict
    seconds: float
    manifest: dict = field(repr=False, default_factory=dict)


def analyze(config: AnalyzeConfig) -> AnalyzeResult | None:
    """Run ``varlen analyze``; returns the result on rank 0 (None on other ranks)."""
    check(config)
    return execute(run_in_group, config)


def check(config: AnalyzeConfig) -> None:
    """Refuse bad options before any worker starts."""
    check_choices(config)
    if not config.sources:
        raise UsageError("give at least one SOURCE")
    if config.length != "auto":
        parse_length(config.length)
    parse_difficulty(config.difficulty)
    check_frames_per_second(config.frames_per_second)
    if config.chunk_bytes < 1:
        raise UsageError("chunk_bytes must be positive")


class _Work:
    """What one worker needs to turn a unit into lengths and difficulty values."""

    def __init__(self, config: AnalyzeConfig, files: list[SourceFile]):
        self.config = config
        self.files = files
        self.difficulty = parse_difficulty(config.difficulty)
        self.tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        self.length = parse_length(config.length) if config.length != "auto" else self._auto_length()
        if self.length.kind == "tokens" and self.tokenizer is None:
            raise UsageError(f"--length {self.length} needs --tokenizer FILE")
        if self.difficulty.kind == "vocab-rarity" and self.length.kind not in ("tokens", "list"):
            raise UsageError(
                "--difficulty vocab-rarity needs token ids: use --length tokens:COLUMN --tokenizer FILE "
                "or --length list:COLUMN on a column of token ids"
            )
        self.function = load_function(self.difficulty) if self.difficulty.kind == "function" else None
        columns = [self.length.column]
        if self.difficulty.kind == "value" and self.difficulty.column not in columns:
            columns.append(self.difficulty.column)
        self.columns = columns
        self.reader = Reader()

    def _auto_length(self) -> LengthSpec:
        from .sources import TEXT_COLUMN

        # The first file that has columns tells (empty JSONL files have none).
        for f in self.files:
            if f.format == "text":
                return auto_length([TEXT_COLUMN], {}, self.tokenizer is not None)
            schema = _schema_of(f)
            if schema.names:
                return auto_length(schema.names, {n: schema.field(n).type for n in schema.names},
                                   self.tokenizer is not None)
        raise InputError("the sources hold no samples (empty dataset)")

    def where(self, unit: Unit) -> str:
        return self.files[unit.file].path

    def read(self, unit: Unit, all_columns: bool = False):
        f = self.files[unit.file]
        return self.reader.read(f, unit, None if all_columns else self.columns)

    def lengths_and_ids(self, unit: Unit, want_ids: bool):
        """Lengths of the unit's rows (and flat token ids when ``want_ids``), plus the table read."""
        table = self.read(unit, all_columns=self.function is not None)
        column = table.column(self.length.column)
        where = self.where(unit)
        if want_ids and self.length.kind == "tokens":
            if len(column) and column.null_count:
                raise InputError(f"column '{self.length.column}' has {column.null_count} null values in {where}")
            lengths, ids = token_lengths(self.tokenizer, column.combine_chunks() if len(column) else column,
                                         self.config.special_tokens, with_ids=True)
            return lengths, ids, table
        lengths = compute_lengths(column, self.length, where, self.tokenizer, self.config.special_tokens,
                                  self.config.frames_per_second)
        ids = None
        if want_ids:
            import pyarrow.compute as pc

            flat = pc.list_flatten(column) if len(column) else None
            if flat is not None and not _is_int(flat.type):
                raise InputError(f"--difficulty vocab-rarity needs integer token ids, but '{self.length.column}' holds "
                                 f"{flat.type}")
            ids = flat.to_numpy(zero_copy_only=False) if flat is not None else np.zeros(0, np.int64)
            if ids.dtype.kind != "i":
                ids = ids.astype(np.int64)
            if len(ids) and ids.min() < 0:
                raise InputError(f"column '{self.length.column}' has negative token ids in {where}")
        return lengths, ids, table

    def difficulty_values(self, unit: Unit, lengths: np.ndarray, table) -> np.ndarray:
        kind = self.difficulty.kind
        if kind == "length":
            return lengths.astype(np.float64)
        if kind == "value":
            if len(table) == 0:
                return np.zeros(0)
            return numeric_values(table.column(self.difficulty.column), self.difficulty.column, self.where(unit),
                                  "difficulty column")
        if kind == "function":
            import pyarrow as pa

            batch = table.combine_chunks().to_batches()
            batch = batch[0] if batch else pa.RecordBatch.from_pylist([], schema=table.schema)
            return call_function(self.function, self.difficulty, batch, self.where(unit))
        raise AssertionError(kind)


def _schema_of(f: SourceFile):
    from .sources import open_arrow, parquet_file

    if f.format == "parquet":
        return parquet_file(f.path).schema_arrow
    if f.format == "arrow":
        return open_arrow(f.path)[0].schema
    # JSONL: the first rows tell the columns.
    import pyarrow as pa


    try:
        with open(f.path, "rb") if not f.compression else pa.input_stream(f.path, compression=f.compression) as fh:
            head = fh.read(1 << 20)
    except OSError as exc:
        raise InputError(f"cannot read {f.path}: {exc}") from None
    cut = head.rfind(b"\n")
    sample = head[: cut + 1] if cut >= 0 else head
    import pyarrow.json as pj

    try:
        return pj.read_json(pa.BufferReader(sample)).schema if sample.strip() else pa.schema([])
    except pa.ArrowInvalid as exc:
        raise InputError(f"invalid JSONL in {f.path}: {exc}") from None


def _is_int(t) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(t)


def run_in_group(config: AnalyzeConfig, d: Dist, out: artifacts.AtomicDir, t0: float) -> AnalyzeResult | None:
    """One rank's share of ``varlen analyze``, writing into the shared temporary output ``out``."""
    files = discover(config.sources)
    units = make_units(files, config.chunk_bytes)
    lo, hi = assign(units, d.world_size, d.rank)
    mine = units[lo:hi]
    work = _Work(config, files)
    rarity_mode = work.difficulty.kind == "vocab-rarity"
    if not rarity_mode and all(u.rows >= 0 for u in units):  # rows known up front: stream the part
        return _run_streaming(config, d, out, t0, files, units, lo, hi, work)
    total_weight = sum(u.weight for u in units) * (2 if rarity_mode else 1)

    lengths_parts, diff_parts, unit_rows = [], [], []
    ids_cache: list = []  # vocab-rarity: each unit's token ids, kept while they fit RARITY_CACHE_BYTES
    cached_bytes = 0
    max_id, counts = -1, None
    with JobProgress(d, total_weight, "analyze", show=config.progress) as bar:
        for unit in mine:
            lengths, ids, table = work.lengths_and_ids(unit, want_ids=rarity_mode)
            lengths_parts.append(lengths)
            unit_rows.append(len(lengths))
            if rarity_mode:
                if len(ids):
                    max_id = max(max_id, int(ids.max()))
                    counts = _add_counts(counts, ids)
                if ids_cache is not None and cached_bytes + ids.nbytes <= RARITY_CACHE_BYTES:
                    ids_cache.append(ids)
                    cached_bytes += ids.nbytes
                else:
                    ids_cache = None  # too big: the second pass reads (and tokenizes) again
            else:
                diff_parts.append(work.difficulty_values(unit, lengths, table))
            del table
            bar.advance(unit.weight)
            fault_point("analyze.unit")
        bar.wait_for_peers(sum(u.weight for u in units))
        if rarity_mode:
            vocab = int(d.all_reduce(np.array([max_id + 1], dtype=np.int64), op="max")[0])
            if work.tokenizer is not None:
                vocab = max(vocab, work.tokenizer.get_vocab_size(with_added_tokens=True))
            local = np.zeros(vocab, dtype=np.int64)
            if counts is not None:
                local[: len(counts)] = counts
            global_counts = d.all_reduce(local)
            for k, (unit, lengths) in enumerate(zip(mine, lengths_parts)):
                ids = ids_cache[k] if ids_cache is not None else work.lengths_and_ids(unit, want_ids=True)[1]
                diff_parts.append(rarity(lengths, ids, global_counts))
                bar.advance(unit.weight)
            ids_cache = None
            bar.wait_for_peers(total_weight)

    lengths = np.concatenate(lengths_parts) if lengths_parts else np.zeros(0, np.int64)
    difficulty = np.concatenate(diff_parts) if diff_parts else np.zeros(0, np.float64)
    rows = d.all_gather_int(len(lengths))
    total_rows = int(rows.sum())
    if total_rows == 0:
        raise InputError("the sources hold no samples (empty dataset)")
    first_id = int(rows[: d.rank].sum())

    _write_part(out.file(artifacts.part_name(d.rank)), first_id, lengths, difficulty)

    # Rows per file, for the dataset fingerprint: each rank knows its units' rows.
    per_file = np.zeros(len(files), dtype=np.int64)
    np.add.at(per_file, np.array([u.file for u in mine], dtype=np.int64), np.array(unit_rows, dtype=np.int64))
    per_file = d.all_reduce(per_file)
    length_stats = distribution(lengths, d)
    diff_stats = float_summary(diff_parts, total_rows, d)
    d.barrier()  # every part is written
    if not d.is_main:
        return None
    manifest = _manifest(config, str(work.length), d.world_size, fingerprint(files, per_file.tolist()), rows,
                         {"length": length_stats, "difficulty": diff_stats})
    artifacts.atomic_write_json(out.file(artifacts.MANIFEST_NAME), manifest)
    out.commit()
    return AnalyzeResult(
        output=out.path, num_samples=total_rows, num_files=len(files), num_parts=len(manifest["parts"]),
        length=str(work.length), difficulty=str(work.difficulty), stats=length_stats, difficulty_stats=diff_stats,
        seconds=time.perf_counter() - t0, manifest=manifest,
    )


def _run_streaming(config: AnalyzeConfig, d: Dist, out: artifacts.AtomicDir, t0: float, files, units, lo: int,
                   hi: int, work: _Work) -> AnalyzeResult | None:
    """``run_in_group`` for sources whose row counts are known before reading (Parquet, Arrow): each
    rank knows its first sample_id up front and writes its part row group by row group, so a worker
    holds one unit and one row group of output, whatever the number of rows (1B rows on 2 workers)."""
    rows_all = np.fromiter((u.rows for u in units), dtype=np.int64, count=len(units))
    total_rows = int(rows_all.sum())
    if total_rows == 0:
        raise InputError("the sources hold no samples (empty dataset)")
    first_id = int(rows_all[:lo].sum())
    length_stats, diff_stats = LengthStats(), FloatSummary(total_rows)
    writer = _PartWriter(out.file(artifacts.part_name(d.rank)), first_id)
    with JobProgress(d, int(sum(u.weight for u in units)), "analyze", show=config.progress) as bar, writer:
        for unit in units[lo:hi]:
            lengths, _, table = work.lengths_and_ids(unit, want_ids=False)
            if len(lengths) != unit.rows:
                raise InputError(f"{work.where(unit)} changed while it was read: {len(lengths):,} rows where its "
                                 f"metadata says {unit.rows:,}")
            difficulty = work.difficulty_values(unit, lengths, table)
            del table
            length_stats.add(lengths)
            diff_stats.add(difficulty)
            writer.add(lengths, difficulty)
            bar.advance(unit.weight)
            fault_point("analyze.unit")
        bar.wait_for_peers(sum(u.weight for u in units))
    rows = d.all_gather_int(writer.rows)
    per_file = np.bincount(np.array([u.file for u in units], dtype=np.int64), weights=rows_all,
                           minlength=len(files)).astype(np.int64)
    length_stats = length_stats.finish(d)
    diff_stats = diff_stats.finish(d)
    d.barrier()  # every part is written
    if not d.is_main:
        return None
    manifest = _manifest(config, str(work.length), d.world_size, fingerprint(files, per_file.tolist()), rows,
                         {"length": length_stats, "difficulty": diff_stats})
    artifacts.atomic_write_json(out.file(artifacts.MANIFEST_NAME), manifest)
    out.commit()
    return AnalyzeResult(
        output=out.path, num_samples=total_rows, num_files=len(files), num_parts=len(manifest["parts"]),
        length=str(work.length), difficulty=str(work.difficulty), stats=length_stats, difficulty_stats=diff_stats,
        seconds=time.perf_counter() - t0, manifest=manifest,
    )


class _PartWriter:
    """A part file written row group by row group (:data:`PART_ROW_GROUP` rows each), as
    :func:`_write_part` writes it whole."""

    def __init__(self, path: str, first_id: int):
        self.path, self.next_id, self.rows = path, first_id, 0
        self.lengths: list = []
        self.difficulty: list = []
        self.buffered = 0
        self._writer = None

    def __enter__(self) -> _PartWriter:
        return self

    def add(self, lengths: np.ndarray, difficulty: np.ndarray) -> None:
        self.lengths.append(np.asarray(lengths, np.int64))
        self.difficulty.append(np.asarray(difficulty, np.float64))
        self.buffered += len(lengths)
        while self.buffered >= PART_ROW_GROUP:
            self._flush(PART_ROW_GROUP)

    def _flush(self, n: int) -> None:
        import pyarrow.parquet as pq

        lengths, difficulty = np.concatenate(self.lengths), np.concatenate(self.difficulty)
        table = _part_table(self.next_id, lengths[:n], difficulty[:n])
        self.lengths, self.difficulty = [lengths[n:]], [difficulty[n:]]
        self.buffered -= n
        self.next_id += n
        self.rows += n
        try:
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.path, table.schema, **PART_OPTIONS)
            self._writer.write_table(table, row_group_size=PART_ROW_GROUP)
        except OSError as exc:
            raise OutputError(f"cannot write {self.path}: {exc}") from None

    def __exit__(self, exc_type, *rest) -> None:
        try:
            if exc_type is None and (self.buffered or self._writer is None):
                self._flush(self.buffered)
        finally:
            if self._writer is not None:
                self._writer.close()


def _manifest(config: AnalyzeConfig, length: str, world_size: int, fp: dict, rows: np.ndarray, stats: dict) -> dict:
    """The metrics directory's ``_manifest.json`` (``rows``: rows per part, in rank order)."""
    cfg = artifacts.config_dict(config)
    cfg["length"] = length
    return {
        "format": artifacts.METRICS_FORMAT,
        "format_version": artifacts.FORMAT_VERSION,
        "kind": "metrics",
        "stage": "analyze",
        **artifacts.provenance(),
        "config": cfg,
        "world_size": world_size,
        "dataset": fp,
        "artifact_id": artifacts.artifact_id("analyze", cfg, fp["digest"], rows.tolist()),
        "order": {"by": ["sample_id"], "descending": False},
        "columns": {"sample_id": "int64", "length": "int64", "difficulty": "float64"},
        "num_rows": int(rows.sum()),
        "parts": [{"file": artifacts.part_name(r), "rows": int(n)} for r, n in enumerate(rows)],
        "stats": stats,
    }


PART_ROW_GROUP = 1 << 20
# sample_id is a run of consecutive integers: delta encoding stores it in almost nothing and writes
# fast; dictionaries only where values repeat (lengths, difficulty)
PART_OPTIONS = {"compression": "zstd", "compression_level": 1, "use_dictionary": ["length", "difficulty"],
                "column_encoding": {"sample_id": "DELTA_BINARY_PACKED"}}


def _part_table(first_id: int, lengths: np.ndarray, difficulty: np.ndarray):
    import pyarrow as pa

    return pa.table({
        "sample_id": pa.array(np.arange(first_id, first_id + len(lengths), dtype=np.int64)),
        "length": pa.array(lengths.astype(np.int64, copy=False)),
        "difficulty": pa.array(difficulty.astype(np.float64, copy=False)),
    })


def _write_part(path: str, first_id: int, lengths: np.ndarray, difficulty: np.ndarray) -> None:
    """One part file, written whole (sources whose row counts are known only once read)."""
    import pyarrow.parquet as pq

    try:
        pq.write_table(_part_table(first_id, lengths, difficulty), path, row_group_size=PART_ROW_GROUP,
                       **PART_OPTIONS)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc}") from None


def _add_counts(counts: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    new = np.bincount(ids)
    if counts is None:
        return new
    if len(new) > len(counts):
        new[: len(counts)] += counts
        return new
    counts[: len(new)] += new
    return counts

