"""An in-memory ``datasets.Dataset`` as a source: :func:`varlen_cli.analyze.analyze_dataset`.

What TRL and ``transformers.Trainer`` users hold is a ``datasets.Dataset`` (built in memory, mapped,
filtered, shuffled), not a directory. ``analyze_dataset(dataset, output, ...)`` measures it where it
is: ``sample_id`` ``i`` is ``dataset[i]`` (an indices mapping from ``select``/``shuffle``/``filter``
included), rows are read as Arrow (``dataset.with_format("arrow")[a:b]``: vectorised, no copy of a
memory-mapped table), in units of about ``chunk_bytes``, by any number of workers (each gets the
dataset pickled, as ``datasets`` pickles it: memory-mapped tables by path, in-memory ones by value).

The metrics record the dataset's own fingerprint (``dataset._fingerprint``, which ``datasets``
changes with every transform) and its row count. An in-memory object cannot be checked for changes
later: ``SourceDataset(metrics, dataset=ds)`` refuses a dataset whose fingerprint or length differ.
Nothing is written but the metrics directory.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError, UsageError

FORMAT = "dataset"
PREFIX = "datasets.Dataset:"
_OPEN: dict[str, DatasetSource] = {}  # path -> the dataset it names, in this process


class DatasetSource:
    """A ``datasets.Dataset`` given to :func:`varlen_cli.analyze.analyze_dataset` (a SOURCE that is no path;
    the manifest's config records its :meth:`__str__`)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        if not (hasattr(self.dataset, "with_format") and hasattr(self.dataset, "_fingerprint")):
            raise UsageError(f"analyze_dataset takes a datasets.Dataset, not a {type(self.dataset).__name__} "
                             "(a DatasetDict: pass one split, dataset['train'])")

    @property
    def fingerprint(self) -> str:
        return str(self.dataset._fingerprint)

    @property
    def path(self) -> str:
        """What the metrics and messages call it (``datasets.Dataset:FINGERPRINT``)."""
        return PREFIX + self.fingerprint

    @property
    def rows(self) -> int:
        return len(self.dataset)

    @property
    def nbytes(self) -> int:
        return int(self.dataset.data.nbytes)

    def __str__(self) -> str:  # in the manifest's config
        return f"{self.path} ({self.rows} rows)"


def is_source(item) -> bool:
    return isinstance(item, DatasetSource)


def register(source: DatasetSource) -> DatasetSource:
    """Make ``source`` readable by its path in this process (analyze's workers, a SourceDataset)."""
    _OPEN[source.path] = source
    return source


def lookup(path: str) -> DatasetSource:
    found = _OPEN.get(path)
    if found is None:
        raise UsageError(f"the metrics were measured on an in-memory datasets.Dataset ({path}): pass it, "
                         "SourceDataset(metrics, dataset=ds)")
    return found


def read(path: str, start: int, stop: int, columns):
    """Rows ``[start, stop)`` of the dataset (its indices mapping applied) as an Arrow table of ``columns``."""
    dataset = lookup(path).dataset
    if columns is not None:
        missing = [c for c in columns if c not in dataset.column_names]
        if missing:
            raise InputError(f"column '{missing[0]}' not found in {path} (columns: {', '.join(dataset.column_names)})")
        dataset = dataset.select_columns(list(columns))
    return dataset.with_format("arrow")[start:stop]


def schema(path: str):
    return lookup(path).dataset.data.schema


def check_same(source: DatasetSource, entry: dict, where: str) -> None:
    """Refuse a dataset that is not the one the metrics ``where`` measured (``entry``: its fingerprint record)."""
    if source.fingerprint != entry.get("fingerprint") or source.rows != int(entry.get("rows", -1)):
        raise InputError(f"{where} measured the datasets.Dataset {entry.get('path')} ({entry.get('rows')} rows), not "
                         f"{source.path} ({source.rows} rows): pass the dataset analyze_dataset was given")
