"""``varlen analyze``: each sample's length and difficulty, computed across workers.

Each worker takes a contiguous, balanced range of work units (row groups, batches, byte chunks),
computes lengths and difficulty with Arrow compute and numpy, learns its first sample_id from the
all-gathered row counts, and writes ``part-RRRRR.parquet``. Rank 0 writes the manifest once all
parts exist, then renames the directory into place. The concatenated parts are identical for any
number of workers.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .. import storage
from ..errors import InputError, OutputError, UsageError
from ..runtime import artifacts
from ..runtime.choices import (
    DEVICE_HELP,
    NPROC_HELP,
    OVERWRITE_HELP,
    PANEL_RUN,
    PROGRESS_HELP,
    STORAGE_OPTION_HELP,
    Device,
    check_choices,
    doc,
)
from ..runtime.dist import Dist, fault_point
from ..runtime.executor import execute
from ..runtime.progress import JobProgress
from . import formats, hf_tokenizer, memory, paths
from .chat import chat_lengths, check_special_tokens, is_chat_target
from .chat import check_tokenizer as check_chat_tokenizer
from .difficulty import call_function, load_function, parse_difficulty, rarity
from .lengths import (
    LengthSpec,
    auto_length,
    check_frames_per_second,
    compute_lengths,
    load_tokenizer,
    numeric_values,
    parse_length,
    parse_target,
    token_lengths,
)
from .sources import (
    DEFAULT_CHUNK_BYTES,
    TEXT_COLUMN,
    Reader,
    SourceFile,
    Unit,
    assign,
    discover,
    fingerprint,
    make_units,
)
from .stats import FloatSummary, LengthStats, distribution, float_summary

LENGTH_HELP = ("KIND:PATH with KIND list, tokens, chars, bytes, words, value or chat; " + paths.SYNTAX + " "
               "(supervisions[0].text); 'auto' picks a list column input_ids/tokens/token_ids, then text (tokens with "
               "--tokenizer, else chars), then num_tokens/length/duration.")
TOKENIZER_HELP = ("A tokenizer.json file, or a directory transformers.AutoTokenizer loads (sentencepiece and tiktoken "
                  "models too), for --length tokens:COLUMN and chat:COLUMN (truncation and padding are switched off).")
TARGET_LENGTH_HELP = ("A second count per sample, stored as target_length: KIND:PATH as --length (any format: the "
                      "tokens of a transcript, a list's length, a value), the decoder length of a seq2seq sample; or "
                      "'assistant' with --length chat:COLUMN (the chat template's {% generation %} mask). Plans count "
                      "target_length as the sample's loss tokens.")
RARITY_CACHE_BYTES = 512 << 20  # token ids a worker keeps between the two vocab-rarity passes


# the --help panels of the length options beyond --length and --tokenizer (two: --target-frames-per-second
# beside --no-special-tokens would leave their help too narrow for the words of an 80-column terminal)
LENGTH, FRAMES = "Tokens, targets and chats", "Seconds to frames (audio)"


@dataclass(frozen=True)
class AnalyzeConfig:
    """Options of ``varlen analyze`` (see ``varlen analyze --help``)."""

    sources: tuple = doc(help="Parquet/Arrow/JSONL/text files, directories, globs, or a Hugging Face save_to_disk "
                              "directory, local or in object storage (s3://, gs://, hf://, https:// URLs, prefixes "
                              "and globs), a Megatron PREFIX.idx, an MDS index.json directory or WebDataset .tar "
                              "shards; rows are numbered over the files in sorted path order.")
    output: str = doc(help="Metrics directory to write (part-*.parquet + _manifest.json), atomically; or an "
                           "s3://... prefix (published manifest last).")
    length: str = doc("auto", LENGTH_HELP)
    tokenizer: str | None = doc(None, TOKENIZER_HELP)
    special_tokens: bool = doc(True, "Count the tokenizer's special tokens (BOS/EOS, CLS/SEP).", panel=LENGTH)
    target_length: str | None = doc(None, TARGET_LENGTH_HELP, panel=LENGTH)
    frames_per_second: float | None = doc(None, "With --length value:PATH in seconds: frames = ceil(seconds x F).",
                                          panel=FRAMES)
    target_frames_per_second: float | None = doc(None, "With --target-length value:PATH in seconds: frames = "
                                                       "ceil(seconds x F).", panel=FRAMES)
    difficulty: str = doc("length", "Curriculum key: length, value:PATH, vocab-rarity, or MODULE:FUNCTION "
                                    "(RecordBatch -> one value per row).")
    storage_options: tuple = doc((), STORAGE_OPTION_HELP, panel=PANEL_RUN)
    nproc: int = doc(1, NPROC_HELP, panel=PANEL_RUN)
    device: Device = doc("cpu", DEVICE_HELP, panel=PANEL_RUN)
    overwrite: bool = doc(False, OVERWRITE_HELP, panel=PANEL_RUN)
    chunk_bytes: int = doc(DEFAULT_CHUNK_BYTES, "Bytes of input a worker reads per chunk.")
    progress: bool = doc(True, PROGRESS_HELP, panel=PANEL_RUN)


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
    return execute(run_in_group, config, functools.partial(count_units, config))


def count_units(config: AnalyzeConfig) -> tuple[int, str]:
    """The work units of the sources (what ``--nproc`` is capped by)."""
    storage.configure(config.storage_options)
    return len(make_units(discover(config.sources), config.chunk_bytes)), "work unit"


def analyze_dataset(dataset, output: str, **options) -> AnalyzeResult | None:
    """``varlen analyze`` of an in-memory ``datasets.Dataset``: sample_id ``i`` is ``dataset[i]``; writes
    the metrics directory ``output``. ``options``: :class:`AnalyzeConfig`'s fields (``length``,
    ``target_length``, ``tokenizer``, ``nproc``...). See :mod:`.memory`."""
    return analyze(AnalyzeConfig(sources=(memory.DatasetSource(dataset),), output=str(output), **options))


def check(config: AnalyzeConfig) -> None:
    """Refuse bad options before any worker starts."""
    check_choices(config)
    check_sources(config.sources)
    if config.length != "auto":
        parse_length(config.length)
    check_target(config)
    check_special_tokens(config.length, config.special_tokens)
    difficulty = parse_difficulty(config.difficulty)
    if difficulty.kind == "value":
        paths.parse(difficulty.column, f"--difficulty {config.difficulty}")
    check_frames_per_second(config.frames_per_second)
    check_frames_per_second(config.target_frames_per_second, "--target-frames-per-second")
    if config.chunk_bytes < 1:
        raise UsageError("chunk_bytes must be positive")
    storage.parse_options(config.storage_options)


def check_target(config: AnalyzeConfig) -> None:
    """``--target-length``: ``assistant`` with chat lengths, or ``KIND:PATH`` (seconds converted only by
    ``--target-frames-per-second``)."""
    target = config.target_length
    if target is not None and is_chat_target(target):
        if not config.length.startswith("chat:"):
            raise UsageError("--target-length assistant needs --length chat:COLUMN (the loss mask comes from the chat "
                             "template)")
    elif target is not None:
        parse_target(target)
    if config.target_frames_per_second is not None and (target is None or not target.startswith("value:")):
        raise UsageError("--target-frames-per-second needs --target-length value:PATH (seconds to turn into frames)")


def check_sources(sources) -> None:
    """Sources are paths or URLs: refuse anything else (an in-memory ``datasets.Dataset``, a table) in one line."""
    items = list(sources) if isinstance(sources, (list, tuple)) else [sources]
    if not items:
        raise UsageError("give at least one SOURCE")
    if len(items) == 1 and memory.is_source(items[0]):  # analyze_dataset's
        return
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            kind = f"{type(item).__module__.partition('.')[0]}.{type(item).__name__}"
            raise UsageError(f"analyze reads sources from files, local or remote (paths or URLs), not an in-memory "
                             f"{kind}: a datasets.Dataset is measured by varlen_cli.analyze.analyze_dataset(dataset, "
                             f"output, ...)")


class _Work:
    """What one worker needs to turn a unit into lengths and difficulty values."""

    def __init__(self, config: AnalyzeConfig, files: list[SourceFile]):
        self.config = config
        self.files = files
        self.difficulty = parse_difficulty(config.difficulty)
        self.length = parse_length(config.length) if config.length != "auto" else None
        self.hf, self.tokenizer = _load_tokenizers(config, self.length)
        if self.length is None:
            self.length = self._auto_length()
        if self.length.kind == "tokens" and self.tokenizer is None:
            raise UsageError(f"--length {self.length} needs --tokenizer FILE")
        if config.frames_per_second is not None and self.length.kind != "value":  # auto may pick text
            raise UsageError(f"--frames-per-second needs --length value:PATH (seconds to turn into frames); the length "
                             f"is {self.length}")
        self.chat_target = is_chat_target(config.target_length)
        self.target = parse_target(config.target_length) if config.target_length and not self.chat_target else None
        if self.target is not None and self.target.kind == "tokens" and self.tokenizer is None:
            raise UsageError(f"--target-length {self.target} needs --tokenizer FILE")
        # every source with documents (Megatron indexes): the global document number of each sample
        self.doc_offsets = formats.document_offsets([f.path for f in files], [f.format for f in files],
                                                    [f.size for f in files])
        if self.difficulty.kind == "vocab-rarity" and self.length.kind not in ("tokens", "list"):
            raise UsageError(
                "--difficulty vocab-rarity needs token ids: use --length tokens:COLUMN --tokenizer FILE "
                "or --length list:COLUMN on a column of token ids"
            )
        self.function = load_function(self.difficulty) if self.difficulty.kind == "function" else None
        self.length_at = self._split(self.length.column)  # (the column read, the steps inside it)
        self.target_at = self._split(self.target.column) if self.target is not None else None
        self.difficulty_at = self._split(self.difficulty.column) if self.difficulty.kind == "value" else None
        columns = [at[0] for at in (self.length_at, self.target_at, self.difficulty_at) if at is not None]
        if self.doc_offsets is not None:
            columns.append("document")
        self.columns = list(dict.fromkeys(columns))
        self.reader = Reader()

    def _split(self, text: str) -> tuple[str, tuple]:
        return split_path(text, self.files)


    def values(self, table, at: tuple[str, tuple], text: str, where: str):
        """The values of PATH ``text`` (split as ``at``) in a table read with :attr:`columns`."""
        column = table.column(at[0])
        return paths.extract(column, at[1], text, where) if at[1] and len(column) else column

    def target_lengths(self, table, where: str) -> np.ndarray | None:
        """``--target-length KIND:PATH`` of the table's rows (None without one)."""
        if self.target is None:
            return None
        return compute_lengths(self.values(table, self.target_at, self.target.column, where), self.target, where,
                               self.tokenizer, self.config.special_tokens, self.config.target_frames_per_second,
                               target=True)

    def _auto_length(self) -> LengthSpec:
        names, types = first_columns(self.files)
        if not names:
            raise InputError("the sources hold no samples (empty dataset)")
        return auto_length(names, types, self.tokenizer is not None)

    def where(self, unit: Unit) -> str:
        return self.files[unit.file].path

    def read(self, unit: Unit, all_columns: bool = False):
        f = self.files[unit.file]
        return self.reader.read(f, unit, None if all_columns else self.columns)

    def extra_names(self) -> list[str]:
        return (["target_length"] if self.config.target_length is not None else []) + (
            ["document"] if self.doc_offsets is not None else [])

    def extra_columns(self, unit: Unit, table, target: np.ndarray | None) -> dict:
        """The metrics columns beyond length and difficulty: ``target_length``, ``document``."""
        out = {}
        if target is not None:
            out["target_length"] = target
        if self.doc_offsets is not None:
            docs = table.column("document").to_numpy(zero_copy_only=False) if len(table) else np.zeros(0, np.int64)
            first = int(self.doc_offsets[unit.file])  # documents of the files before this one
            out["document"] = docs.astype(np.int64, copy=False) + first if first else docs
        return out

    def lengths_and_ids(self, unit: Unit, want_ids: bool):
        """Lengths of the unit's rows (and flat token ids when ``want_ids``), the table read, and the
        unit's extra metrics columns."""
        table = self.read(unit, all_columns=self.function is not None)
        where = self.where(unit)
        column = self.values(table, self.length_at, self.length.column, where)
        target = self.target_lengths(table, where)
        if self.length.kind == "chat":
            lengths, chat_target = chat_lengths(self.hf, column, self.length.column, where, self.chat_target)
            return lengths, None, table, self.extra_columns(unit, table, target if target is not None else chat_target)
        if want_ids and self.length.kind == "tokens":
            if len(column) and column.null_count:
                raise InputError(f"column '{self.length.column}' has {column.null_count} null values in {where}")
            lengths, ids = token_lengths(self.tokenizer, column.combine_chunks() if len(column) else column,
                                         self.config.special_tokens, with_ids=True)
            return lengths, ids, table, self.extra_columns(unit, table, target)
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
        return lengths, ids, table, self.extra_columns(unit, table, target)

    def difficulty_values(self, unit: Unit, lengths: np.ndarray, table) -> np.ndarray:
        kind = self.difficulty.kind
        if kind == "length":
            return lengths.astype(np.float64)
        if kind == "value":
            if len(table) == 0:
                return np.zeros(0)
            where = self.where(unit)
            return numeric_values(self.values(table, self.difficulty_at, self.difficulty.column, where),
                                  self.difficulty.column, where, "difficulty column")
        if kind == "function":
            import pyarrow as pa

            batch = table.combine_chunks().to_batches()
            batch = batch[0] if batch else pa.RecordBatch.from_pylist([], schema=table.schema)
            return call_function(self.function, self.difficulty, batch, self.where(unit))
        raise AssertionError(kind)


def split_path(text: str, files: list[SourceFile]) -> tuple[str, tuple]:
    """(the column to read, the steps inside it) of a PATH over these sources (:func:`.paths.split`:
    their column names are read only for a dotted path, which may name a column with dots; WebDataset
    resolves ``EXT.FIELD`` itself)."""
    path = paths.parse(text)
    first = files[0].format if files else None
    if first == "webdataset" or not path.nested or isinstance(path.steps[1], int):
        return paths.split(path, (), joined=first == "webdataset")
    return paths.split(path, column_names(files))


def column_names(files: list[SourceFile]) -> list[str]:
    """The columns of the first file that has any (what a dotted PATH is split against: :func:`.paths.split`)."""
    return first_columns(files)[0]


def first_columns(files: list[SourceFile]) -> tuple[list[str], dict]:
    """(names, {name: Arrow type}) of the columns of the first file that has any (empty JSONL files
    have none; a text file's one column, without a type); ``([], {})`` when none has."""
    for f in files:
        if f.format == "text":
            return [TEXT_COLUMN], {}
        schema = schema_of(f)
        if schema.names:
            return schema.names, {n: schema.field(n).type for n in schema.names}
    return [], {}


def schema_of(f: SourceFile):
    """The Arrow schema of a source file (JSONL: of its first rows)."""
    from .sources import footer_key, open_arrow, parquet_file

    if f.format == "parquet":
        return parquet_file(f.path, f.size, footer_key(f)).schema_arrow
    if f.format == "arrow":
        return open_arrow(f.path)[0].schema
    if f.format in formats.NAMES:
        return formats.schema(f.path, f.format, f.size)
    if f.format == memory.FORMAT:
        return memory.schema(f.path)
    # JSONL: the first rows tell the columns.
    import pyarrow as pa

    from .. import storage
    from .sources import read_decompressed

    head = read_decompressed(f, 1 << 20) if f.compression else storage.read_range(f.path, 0, min(f.size, 1 << 20))
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
    storage.configure(config.storage_options)
    files = discover(config.sources)
    units = make_units(files, config.chunk_bytes)
    lo, hi = assign(units, d.world_size, d.rank)
    mine = units[lo:hi]
    work = _Work(config, files)
    rarity_mode = work.difficulty.kind == "vocab-rarity"
    if not rarity_mode and all(u.rows >= 0 for u in units):  # rows known up front: stream the part
        return _run_streaming(config, d, out, t0, files, units, lo, hi, work)
    lengths_parts, diff_parts, unit_rows, extra_parts = _read_units(config, d, work, units, mine)

    lengths = np.concatenate(lengths_parts) if lengths_parts else np.zeros(0, np.int64)
    difficulty = np.concatenate(diff_parts) if diff_parts else np.zeros(0, np.float64)
    rows = d.all_gather_int(len(lengths))
    total_rows = int(rows.sum())
    if total_rows == 0:
        raise InputError("the sources hold no samples (empty dataset)")
    first_id = int(rows[: d.rank].sum())

    extras = {name: np.concatenate([e[name] for e in extra_parts]) if extra_parts else np.zeros(0, np.int64)
              for name in work.extra_names()}
    _write_part(out.file(artifacts.part_name(d.rank)), first_id, lengths, difficulty, extras)

    # Rows per file, for the dataset fingerprint: each rank knows its units' rows.
    per_file = np.zeros(len(files), dtype=np.int64)
    np.add.at(per_file, np.array([u.file for u in mine], dtype=np.int64), np.array(unit_rows, dtype=np.int64))
    per_file = d.all_reduce(per_file)
    all_unit_rows = np.zeros(len(units), dtype=np.int64)
    all_unit_rows[lo:hi] = unit_rows
    all_unit_rows = d.all_reduce(all_unit_rows)
    length_stats = distribution(lengths, d)
    diff_stats = float_summary(diff_parts, total_rows, d)
    stats = {"length": length_stats, "difficulty": diff_stats}
    if "target_length" in extras:  # a collective: every rank
        stats["target_length"] = distribution(extras["target_length"], d)
    d.barrier()  # every part is written
    if not d.is_main:
        return None
    fp = _with_chunks(fingerprint(files, per_file.tolist()), files, units, all_unit_rows)
    manifest = _manifest(config, str(work.length), d.world_size, fp, rows, stats, list(extras))
    artifacts.atomic_write_json(out.file(artifacts.MANIFEST_NAME), manifest)
    out.commit()
    return AnalyzeResult(
        output=out.path, num_samples=total_rows, num_files=len(files), num_parts=len(manifest["parts"]),
        length=str(work.length), difficulty=str(work.difficulty), stats=length_stats, difficulty_stats=diff_stats,
        seconds=time.perf_counter() - t0, manifest=manifest,
    )


def _read_units(config: AnalyzeConfig, d: Dist, work: _Work, units: list, mine: list) -> tuple[list, list, list, list]:
    """This rank's units read (``mine``, of every rank's ``units``), with progress: per unit its lengths,
    difficulty, row count and extra columns. ``vocab-rarity`` needs the token counts of every rank
    first: the ids are counted in a first pass (kept while they fit RARITY_CACHE_BYTES, else read
    again) and scored in a second one."""
    rarity_mode = work.difficulty.kind == "vocab-rarity"
    total_weight = sum(u.weight for u in units) * (2 if rarity_mode else 1)
    lengths_parts, diff_parts, unit_rows, extra_parts = [], [], [], []
    ids_cache: list = []  # vocab-rarity: each unit's token ids, kept while they fit RARITY_CACHE_BYTES
    cached_bytes = 0
    max_id, counts = -1, None
    with JobProgress(d, total_weight, "analyze", show=config.progress) as bar:
        for unit in mine:
            lengths, ids, table, extras = work.lengths_and_ids(unit, want_ids=rarity_mode)
            lengths_parts.append(lengths)
            extra_parts.append(extras)
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
    return lengths_parts, diff_parts, unit_rows, extra_parts


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
    extra_stats = {name: LengthStats() for name in work.extra_names() if name == "target_length"}
    writer = _PartWriter(out.file(artifacts.part_name(d.rank)), first_id, work.extra_names())
    with JobProgress(d, int(sum(u.weight for u in units)), "analyze", show=config.progress) as bar, writer:
        for unit in units[lo:hi]:
            lengths, _, table, extras = work.lengths_and_ids(unit, want_ids=False)
            if len(lengths) != unit.rows:
                raise InputError(f"{work.where(unit)} changed while it was read: {len(lengths):,} rows where its "
                                 f"metadata says {unit.rows:,}")
            difficulty = work.difficulty_values(unit, lengths, table)
            del table
            length_stats.add(lengths)
            diff_stats.add(difficulty)
            for name, acc in extra_stats.items():
                acc.add(extras[name])
            writer.add(lengths, difficulty, extras)
            bar.advance(unit.weight)
            fault_point("analyze.unit")
        bar.wait_for_peers(sum(u.weight for u in units))
    rows = d.all_gather_int(writer.rows)
    per_file = np.bincount(np.array([u.file for u in units], dtype=np.int64), weights=rows_all,
                           minlength=len(files)).astype(np.int64)
    stats = {"length": length_stats.finish(d), "difficulty": diff_stats.finish(d)}
    for name, acc in extra_stats.items():  # collectives: every rank
        stats[name] = acc.finish(d)
    d.barrier()  # every part is written
    if not d.is_main:
        return None
    fp = _with_chunks(fingerprint(files, per_file.tolist()), files, units, rows_all)
    manifest = _manifest(config, str(work.length), d.world_size, fp, rows, stats, list(work.extra_names()))
    artifacts.atomic_write_json(out.file(artifacts.MANIFEST_NAME), manifest)
    out.commit()
    return AnalyzeResult(
        output=out.path, num_samples=total_rows, num_files=len(files), num_parts=len(manifest["parts"]),
        length=str(work.length), difficulty=str(work.difficulty), stats=stats["length"],
        difficulty_stats=stats["difficulty"], seconds=time.perf_counter() - t0, manifest=manifest,
    )


class _PartWriter:
    """A part file written row group by row group (:data:`PART_ROW_GROUP` rows each), as
    :func:`_write_part` writes it whole."""

    def __init__(self, path: str, first_id: int, extra_names: list[str]):
        self.path, self.next_id, self.rows = path, first_id, 0
        self.lengths: list = [np.zeros(0, np.int64)]  # a worker with no unit writes an empty part
        self.difficulty: list = [np.zeros(0, np.float64)]
        self.extras: dict = {name: [np.zeros(0, np.int64)] for name in extra_names}
        self.buffered = 0
        self._writer = None

    def __enter__(self) -> _PartWriter:
        return self

    def add(self, lengths: np.ndarray, difficulty: np.ndarray, extras: dict) -> None:
        self.lengths.append(np.asarray(lengths, np.int64))
        self.difficulty.append(np.asarray(difficulty, np.float64))
        for name, values in extras.items():
            self.extras.setdefault(name, []).append(np.asarray(values, np.int64))
        self.buffered += len(lengths)
        while self.buffered >= PART_ROW_GROUP:
            self._flush(PART_ROW_GROUP)

    def _flush(self, n: int) -> None:
        import pyarrow.parquet as pq

        lengths, difficulty = np.concatenate(self.lengths), np.concatenate(self.difficulty)
        extras = {name: np.concatenate(v) for name, v in self.extras.items()}
        table = _part_table(self.next_id, lengths[:n], difficulty[:n], {name: v[:n] for name, v in extras.items()})
        self.lengths, self.difficulty = [lengths[n:]], [difficulty[n:]]
        self.extras = {name: [v[n:]] for name, v in extras.items()}
        self.buffered -= n
        self.next_id += n
        self.rows += n
        try:
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.path, table.schema, **part_options(table.column_names))
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


def _with_chunks(fp: dict, files: list[SourceFile], units: list[Unit], unit_rows: np.ndarray) -> dict:
    """Record the byte-range units whose rows were not known up front (uncompressed JSONL and text,
    any format cut into byte ranges) with their rows (``chunks``: ``[[start, stop, rows], ...]`` per
    file), so that a reader (``SourceDataset``) can find a row's chunk."""
    for entry in fp["files"]:
        entry.pop("chunks", None)
    for unit, n in zip(units, unit_rows.tolist()):
        f = files[unit.file]
        if unit.rows < 0 and unit.part == -1 and f.compression is None:
            fp["files"][unit.file].setdefault("chunks", []).append([unit.start, unit.stop, int(n)])
    return fp


def _manifest(config: AnalyzeConfig, length: str, world_size: int, fp: dict, rows: np.ndarray, stats: dict,
              extra_columns: list) -> dict:
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
        "columns": {"sample_id": "int64", "length": "int64", "difficulty": "float64",
                    **{name: "int64" for name in extra_columns}},
        "num_rows": int(rows.sum()),
        "parts": [{"file": artifacts.part_name(r), "rows": int(n)} for r, n in enumerate(rows)],
        "stats": stats,
    }


PART_ROW_GROUP = 1 << 20
DELTA_COLUMNS = {"sample_id": "DELTA_BINARY_PACKED", "document": "DELTA_BINARY_PACKED"}


def part_options(column_names) -> dict:
    """Parquet writer options of a part. ``sample_id`` is a run of consecutive integers and
    ``document`` a non-decreasing one: delta encoding stores them in almost nothing and writes fast
    (3x faster than plain + zstd for ``document``), with nothing left for zstd to compress;
    dictionaries only where values repeat (lengths, difficulty). Speed: benchmarks/README.md
    (Megatron ``.idx``)."""
    zstd = [name for name in column_names if name not in DELTA_COLUMNS]
    return {"use_dictionary": ["length", "difficulty"],
            "column_encoding": {k: v for k, v in DELTA_COLUMNS.items() if k in column_names},
            "compression": {name: "zstd" if name in zstd else "none" for name in column_names},
            "compression_level": dict.fromkeys(zstd, 1)}


def _part_table(first_id: int, lengths: np.ndarray, difficulty: np.ndarray, extras: dict):
    """Rows of a part: ``extras``: further int64 columns (``target_length``, ``document``)."""
    import pyarrow as pa

    return pa.table({
        "sample_id": pa.array(np.arange(first_id, first_id + len(lengths), dtype=np.int64)),
        "length": pa.array(lengths.astype(np.int64, copy=False)),
        "difficulty": pa.array(difficulty.astype(np.float64, copy=False)),
        **{name: pa.array(values.astype(np.int64, copy=False)) for name, values in extras.items()},
    })


def _write_part(path: str, first_id: int, lengths: np.ndarray, difficulty: np.ndarray, extras: dict) -> None:
    """One part file, written whole (sources whose row counts are known only once read)."""
    import pyarrow.parquet as pq

    table = _part_table(first_id, lengths, difficulty, extras)
    try:
        pq.write_table(table, path, row_group_size=PART_ROW_GROUP, **part_options(table.column_names))
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc}") from None


def _load_tokenizers(config: AnalyzeConfig, length: LengthSpec | None):
    """(AutoTokenizer or None, what counts tokens or None) for ``--tokenizer``; chat needs the former."""
    if not config.tokenizer:
        if length is not None and length.kind == "chat":
            raise UsageError(f"--length {length} needs --tokenizer DIR (a tokenizer directory with a chat template)")
        return None, None
    if not hf_tokenizer.is_directory(config.tokenizer):
        if length is not None and length.kind == "chat":
            raise UsageError(f"--length {length} needs a tokenizer directory (tokenizer_config.json holds the chat "
                             f"template), not the file {config.tokenizer}")
        return None, load_tokenizer(config.tokenizer)
    hf = hf_tokenizer.load_auto(config.tokenizer)
    if length is not None and length.kind == "chat":
        check_chat_tokenizer(hf, config.tokenizer, is_chat_target(config.target_length))
    return hf, hf_tokenizer.counter(hf)


def _add_counts(counts: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    new = np.bincount(ids)
    if counts is None:
        return new
    if len(new) > len(counts):
        new[: len(counts)] += counts
        return new
    counts[: len(new)] += new
    return counts

