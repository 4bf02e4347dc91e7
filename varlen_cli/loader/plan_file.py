"""Reading a plan file: metadata, per-rank microbatches, O(1) seeks, validation.

A plan (``varlen plan``, format in ``docs/formats.md``) is one Parquet file with one row per
microbatch in ``(step, rank, micro)`` order, ``dp * grad_accum`` rows per step. The reader never
loads the whole file: it keeps one decoded row group at a time and finds the row group of a step
from the row groups' ``step`` statistics, so seeking to any step reads one row group.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import format
from ..errors import PlanError  # a ValueError; exit code 6 on the command line
from .microbatch import Microbatch
from .position import check_batch

PLAN_FORMAT = format.PLAN_FORMAT
FORMAT_VERSION = format.PLAN_FORMAT_VERSION

#: Columns every plan has (defined in :mod:`varlen_cli.format`, described in docs/formats.md).
REQUIRED_COLUMNS = tuple(name for name, _ in format.PLAN_COLUMNS)
#: Extra columns of packed plans, passed through to :class:`Microbatch`.
PACKED_COLUMNS = format.PACKED_COLUMN_NAMES


class _Group:
    """One decoded row group: scalar columns as numpy arrays, list columns as offsets + values."""

    def __init__(self, table: pa.Table, first_row: int):
        self.first_row = first_row
        self.num_rows = table.num_rows
        self.scalars = {name: table.column(name).to_numpy() for name in format.PLAN_SCALAR_COLUMNS}
        for name, _ in format.PLAN_OPTIONAL_COLUMNS + format.TARGET_PLAN_COLUMNS:
            if name in table.column_names:
                self.scalars[name] = table.column(name).to_numpy()
        self.lists = {}
        for name in ("sample_ids", "source") + PACKED_COLUMNS:
            if name in table.column_names:
                self.lists[name] = _offsets_values(table.column(name))
        ids = self.lists["sample_ids"][1]
        if len(ids) and int(ids.min()) < 0:  # plans whose footer has no statistics
            raise PlanError(f"the plan holds sample id {int(ids.min())}: sample ids index the dataset from 0 (the file "
                            f"was edited or damaged; make it again with `varlen plan`)")

    def microbatch(self, row: int, figures=None) -> Microbatch:
        i = row - self.first_row
        s = self.scalars
        lists = {}
        for name, (offsets, values) in self.lists.items():
            lists[name] = values[offsets[i]:offsets[i + 1]]
        return Microbatch(
            epoch=int(s["epoch"][i]), step=int(s["step"][i]), rank=int(s["rank"][i]), micro=int(s["micro"][i]),
            sample_ids=lists["sample_ids"], num_samples=int(s["num_samples"][i]), seqlen=int(s["seqlen"][i]),
            batch_size=int(s["batch_size"][i]), tokens=int(s["tokens"][i]), lr_scale=float(s["lr_scale"][i]),
            shape_id=int(s["shape_id"][i]), step_samples=int(s["step_samples"][i]),
            step_tokens=int(s["step_tokens"][i]), sample_lengths=lists.get("sample_lengths"),
            sample_rows=lists.get("sample_rows"), sample_starts=lists.get("sample_starts"), source=lists.get("source"),
            step_loss_tokens=int(s["step_loss_tokens"][i]) if "step_loss_tokens" in s else None, figures=figures,
            target_seqlen=int(s["target_seqlen"][i]) if "target_seqlen" in s else None,
            target_tokens=int(s["target_tokens"][i]) if "target_tokens" in s else None,
        )


def _offsets_values(column) -> tuple[np.ndarray, np.ndarray]:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(array, pa.ChunkedArray):  # an empty chunked array combines to a chunked array
        array = pa.array([], type=array.type)
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = pc.list_flatten(array).to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values


class Plan:
    """A plan file opened for reading. Use :meth:`Plan.open`."""

    def __init__(self, path: str, parquet: pq.ParquetFile, meta: dict):
        self.path = path
        self._pf = parquet
        self.meta = meta
        self.row_groups_read = 0  # how many row groups this reader decoded (seeks read one)
        self._group: _Group | None = None
        self._lr_scales: np.ndarray | None = None
        self._fingerprint: str | None = None
        self._figures = None  # the steps' figures for the trackers (StepFigureTable), read when first asked
        self.dp = int(meta.get("dp", 0))
        self.grad_accum = int(meta.get("grad_accum", 0))
        self.num_steps = int(meta.get("num_steps", 0))
        self.steps_per_epoch = tuple(int(s) for s in meta.get("steps_per_epoch", ()))
        self._epoch_starts = np.concatenate([[0], np.cumsum(self.steps_per_epoch, dtype=np.int64)])
        self._check_layout()
        self._index_row_groups()
        self._check_values()

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path, *, num_samples: int | None = None, world_size: int | None = None) -> Plan:
        """Open a plan file; with ``num_samples`` / ``world_size`` also :meth:`validate` against them."""
        path = os.fspath(path)
        try:
            parquet, meta = format.open_plan_file(path)
        except format.FormatError as exc:
            raise PlanError(str(exc)) from None
        plan = cls(path, parquet, meta)
        if num_samples is not None or world_size is not None:
            plan.validate(num_samples=num_samples, world_size=world_size)
        return plan

    def _check_layout(self) -> None:
        problems = format.plan_schema_problems(self._pf.schema_arrow, self.meta)
        if problems:
            raise PlanError(f"{self.path} {problems[0]}")
        if self.dp < 1 or self.grad_accum < 1:
            raise PlanError(f"{self.path} has dp={self.dp}, grad_accum={self.grad_accum}; both must be >= 1")
        if sum(self.steps_per_epoch) != self.num_steps:
            raise PlanError(f"{self.path} is inconsistent: steps_per_epoch sums to {sum(self.steps_per_epoch)} "
                            f"but num_steps is {self.num_steps}")
        rows = self._pf.metadata.num_rows
        if rows != self.num_steps * self.dp * self.grad_accum:
            raise PlanError(f"{self.path} is inconsistent: {rows} rows, expected num_steps x dp x grad_accum = "
                            f"{self.num_steps} x {self.dp} x {self.grad_accum}")

    def _check_values(self) -> None:
        """Sample ids >= 0 (from the statistics; decoded row groups check again) and every ``lr_scale``
        finite and >= 0 (the one float column, read once and kept for :meth:`lr_scales`)."""
        ids = self._sample_id_range()
        if ids is not None and ids[0] < 0:
            raise PlanError(f"{self.path} holds sample id {ids[0]}: sample ids index the dataset from 0 (the file was "
                            f"edited or damaged; make it again with `varlen plan`)")
        column = self._pf.read(columns=["lr_scale"]).column("lr_scale").to_numpy()
        bad = np.flatnonzero(~np.isfinite(column) | (column < 0))
        if len(bad):
            row = int(bad[0])
            raise PlanError(f"{self.path} holds lr_scale {float(column[row])} at step "
                            f"{row // (self.dp * self.grad_accum)}: an LR scale must be a finite number >= 0 (the file "
                            f"was edited or damaged; make it again with `varlen plan`)")
        self._lr_scales = np.ascontiguousarray(column[:: self.dp * self.grad_accum], dtype=np.float64)

    def _index_row_groups(self) -> None:
        """First row and step range of every row group, from the footer's statistics."""
        md = self._pf.metadata
        step_col = self._pf.schema_arrow.get_field_index("step")
        n = md.num_row_groups
        first_rows = np.zeros(n + 1, dtype=np.int64)
        min_steps = np.zeros(n, dtype=np.int64)
        stats_ok = True
        for g in range(n):  # one entry per row group (a few thousand microbatches each)
            rg = md.row_group(g)
            first_rows[g + 1] = first_rows[g] + rg.num_rows
            st = rg.column(step_col).statistics
            if st is None or not st.has_min_max:
                stats_ok = False
            else:
                min_steps[g] = st.min
        per_step = self.dp * self.grad_accum
        if not stats_ok:  # no statistics: the fixed layout still gives each row group's first step
            min_steps = first_rows[:-1] // per_step
        # Rows are in (step, rank, micro) order with per_step rows a step, so a row group's first
        # step and first row must agree; a row group may start in the middle of a step.
        expected = first_rows[:-1] // per_step
        nonempty = first_rows[1:] > first_rows[:-1]
        if np.any(min_steps[nonempty] != expected[nonempty]):
            g = int(np.flatnonzero(nonempty & (min_steps != expected))[0])
            raise PlanError(f"{self.path} rows are not in (step, rank, micro) order: row group {g} starts at step "
                            f"{int(min_steps[g])}, expected {int(expected[g])}")
        self._first_rows = first_rows
        self._nonempty = np.flatnonzero(nonempty)
        self._starts = first_rows[self._nonempty]
        self._min_steps = min_steps[self._nonempty]

    # -- metadata --------------------------------------------------------------------------
    @property
    def epochs(self) -> int:
        return len(self.steps_per_epoch)

    @property
    def num_microbatches(self) -> int:
        return self.num_steps * self.dp * self.grad_accum

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """``(B, T)`` per ``shape_id`` (B is 0 where the batch size varies)."""
        return [(int(b), int(t)) for b, t in self.meta.get("shapes", [])]

    @property
    def warmup_steps(self) -> int:
        return int(self.meta.get("warmup_steps", 0) or 0)

    @property
    def static_shapes(self) -> bool:
        """True when every shape has a fixed batch size (``--static-shapes`` or packing)."""
        shapes = self.shapes
        return bool(shapes) and all(b > 0 for b, _ in shapes)

    @property
    def packing(self) -> dict | None:
        return self.meta.get("packing")

    @property
    def config(self) -> dict:
        return self.meta.get("config", {})

    @property
    def stats(self) -> dict:
        return self.meta.get("stats", {})

    @property
    def input(self) -> dict:
        return self.meta.get("input", {}) or {}

    @property
    def dropped(self) -> dict:
        return self.meta.get("dropped", {}) or {}

    @property
    def fingerprint(self) -> str:
        """A short hash of the plan's metadata: identifies the plan in sampler states (computed once:
        the guard looks it up for every batch)."""
        if self._fingerprint is None:
            self._fingerprint = format.plan_fingerprint(self._pf.schema_arrow)
        return self._fingerprint

    def epoch_start(self, epoch: int) -> int:
        """The global step where ``epoch`` starts."""
        self.check_epoch(epoch)
        return int(self._epoch_starts[epoch])

    def epoch_of(self, step: int) -> int:
        """The epoch that global ``step`` belongs to."""
        self.check_step(step)
        return int(np.searchsorted(self._epoch_starts[1:], step, side="right"))

    def check_epoch(self, epoch: int) -> None:
        if not isinstance(epoch, (int, np.integer)) or isinstance(epoch, (bool, np.bool_)):
            raise PlanError(f"epoch {epoch!r} is not an epoch number: the plan's epochs are 0..{self.epochs - 1}")
        if epoch < 0:
            raise PlanError(f"epoch {epoch} is out of range: the plan's epochs are 0..{self.epochs - 1}")
        if epoch >= self.epochs:
            raise PlanError(f"epoch {epoch} is out of range: the plan has {self.epochs} epoch(s) "
                            f"(re-plan with --epochs {epoch + 1} to train longer)")

    def check_step(self, step: int) -> None:
        if not 0 <= step < self.num_steps:
            raise PlanError(f"step {step} is out of range: the plan has {self.num_steps} steps")

    def check(self, batch, step: int, rank: int | None = None) -> tuple[int, int, int, int]:
        """Raise :class:`PlanError` unless ``batch`` (a collated batch) is a microbatch of global
        ``step`` (and of ``rank``); returns its ``(epoch, step, rank, micro)``. See loader/position.py."""
        return check_batch(self, batch, step, rank)

    def __repr__(self) -> str:
        return (f"Plan({self.path!r}, dp={self.dp}, grad_accum={self.grad_accum}, epochs={self.epochs}, "
                f"steps={self.num_steps}, shapes={len(self.shapes)})")

    # -- validation ------------------------------------------------------------------------
    def validate(self, num_samples: int | None = None, world_size: int | None = None) -> None:
        """Check the plan against the dataset's length and the data-parallel world size."""
        if world_size is not None and world_size != self.dp:
            launched = os.environ.get("WORLD_SIZE", "")
            if launched.isdigit() and int(launched) == self.dp:  # the launcher is right, the framework is not
                raise PlanError(f"the plan was made for {self.dp} data-parallel rank(s) and the launcher started "
                                f"WORLD_SIZE={launched} processes, but this process sees world size {world_size}: the "
                                f"training framework did not join them into one process group (on CPU: "
                                f"Accelerator(cpu=True), TrainingArguments(use_cpu=True), Lightning accelerator='cpu' "
                                f"with devices={launched})")
            raise PlanError(f"the plan was made for {self.dp} data-parallel rank(s) but the world size is "
                            f"{world_size}: re-plan with --dp {world_size} (with model parallelism, pass the "
                            f"data-parallel rank and world size explicitly)")
        if num_samples is None:
            return
        expected = self.input.get("num_rows")
        if expected is not None and int(expected) != int(num_samples):
            raise PlanError(f"the plan was made for a dataset of {int(expected)} samples but the dataset has "
                            f"{int(num_samples)}: re-run `varlen analyze` and `varlen plan` on this dataset")
        largest = self._max_sample_id()
        if largest is not None and largest >= num_samples:
            raise PlanError(f"the plan uses sample id {largest} but the dataset has only {int(num_samples)} samples")

    def _max_sample_id(self) -> int | None:
        """The largest sample id, from the row groups' statistics (no data read)."""
        ids = self._sample_id_range()
        return ids[1] if ids is not None else None

    def _sample_id_range(self) -> tuple[int, int] | None:
        """``(smallest, largest)`` sample id from the row groups' statistics (None where they lack them)."""
        md = self._pf.metadata
        path = None
        for i in range(md.num_columns):
            if md.schema.column(i).path.startswith("sample_ids."):
                path = i
                break
        if path is None or md.num_row_groups == 0:
            return None
        smallest, largest = None, -1
        for g in range(md.num_row_groups):
            st = md.row_group(g).column(path).statistics
            if st is None or not st.has_min_max:
                return None
            smallest = int(st.min) if smallest is None else min(smallest, int(st.min))
            largest = max(largest, int(st.max))
        return (smallest if smallest is not None else 0), largest

    # -- reading ---------------------------------------------------------------------------
    def _row_group_of(self, row: int) -> int:
        """The row group holding ``row``: a binary search over the footer's row-group bounds."""
        k = int(np.searchsorted(self._starts, row, side="right")) - 1
        return int(self._nonempty[k])

    def _load(self, row: int) -> _Group:
        g = self._group
        if g is not None and g.first_row <= row < g.first_row + g.num_rows:
            return g
        index = self._row_group_of(row)
        optional = PACKED_COLUMNS + ("source",) + tuple(name for name, _ in format.PLAN_OPTIONAL_COLUMNS
                                                        + format.TARGET_PLAN_COLUMNS)
        columns = list(REQUIRED_COLUMNS) + [c for c in optional if c in self._pf.schema_arrow.names]
        table = self._pf.read_row_group(index, columns=columns)
        self.row_groups_read += 1
        self._group = _Group(table, int(self._first_rows[index]))
        return self._group

    def microbatch(self, step: int, rank: int, micro: int) -> Microbatch:
        """The microbatch of ``rank`` at ``(step, micro)``; reads at most one row group."""
        self.check_step(step)
        self.check_rank(rank)
        if not 0 <= micro < self.grad_accum:
            raise PlanError(f"micro {micro} is out of range: the plan has grad_accum={self.grad_accum}")
        row = (step * self.dp + rank) * self.grad_accum + micro
        mb = self._load(row).microbatch(row, self.step_figures(step))
        if (mb.step, mb.rank, mb.micro) != (step, rank, micro):
            raise PlanError(f"{self.path} rows are not in (step, rank, micro) order: row {row} holds "
                            f"(step {mb.step}, rank {mb.rank}, micro {mb.micro}), expected ({step}, {rank}, {micro})")
        return mb

    def step_figures(self, step: int):
        """The :class:`~varlen_cli.loader.step_figures.StepFigures` of global ``step`` (all ranks; from
        the plan file, a window of steps at a time): what the trackers log for it."""
        if self._figures is None:
            from .step_figures import StepFigureTable

            self._figures = StepFigureTable(self._pf, self.meta)
        return self._figures.figures(step)

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.dp:
            raise PlanError(f"rank {rank} is out of range for a plan with dp={self.dp}")

    def microbatches(self, rank: int, start_step: int = 0, start_micro: int = 0,
                     stop_step: int | None = None) -> Iterator[Microbatch]:
        """This rank's microbatches from ``(start_step, start_micro)`` up to ``stop_step`` (exclusive)."""
        stop = self.num_steps if stop_step is None else min(stop_step, self.num_steps)
        micro = start_micro
        for step in range(start_step, stop):
            for m in range(micro, self.grad_accum):
                yield self.microbatch(step, rank, m)
            micro = 0

    def step(self, step: int) -> list[Microbatch]:
        """All microbatches of one step, in (rank, micro) order."""
        return [self.microbatch(step, r, m) for r in range(self.dp) for m in range(self.grad_accum)]

    def lr_scales(self) -> np.ndarray:
        """The ``lr_scale`` of every global step (the one float column, read when the plan was opened)."""
        return self._lr_scales  # read and checked when the plan was opened
