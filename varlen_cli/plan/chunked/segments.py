"""Phase 3 shared out: every worker writes segments of the plan, rank 0 joins them (issue 25).

With one worker the plan is streamed row group by row group (:func:`.emit.write`). With ``W > 1``
workers the plan's row groups (``writer.rows_per_group(slots)`` rows each, as one writer cuts
them) are cut into **segments** of :data:`SEGMENT_GROUPS` row groups, a constant (never dependent
on ``W``):

1. rank 0, after phase 2 and ``finish``, writes into the spill directory what a worker needs to
   write a segment without rank 0's memory: the :class:`~.emit.RowGroups` (step columns, shapes,
   metadata) and the chunk files' readers once (``write-job.pkl``); then, while the other workers
   already write segments, each segment's row specs (:class:`~.emit.RowSpec`: about 30 bytes a row),
   one segment at a time in segment order, each published whole by a rename (``seg-S.spec``; a
   failure leaves ``specs.failed``, which stops the workers waiting for a spec);
2. every worker (rank 0 after its last spec) claims segments (an atomic create of ``seg-S.claim``:
   whoever comes first), waits for the segment's spec, reads its items, checks each row group with its own
   :class:`~varlen_cli.checks.PlanChecks` and writes the segment's row groups into
   ``seg-S.parquet`` with the plan's schema and writer settings; then it pickles its checks
   (``checks-R.pkl``);
3. rank 0 concatenates the segments in order into the plan's temporary file
   (:class:`varlen_cli.runtime.parquet_concat.Concatenation`): between its own segments it appends
   those already written (:class:`Joiner`), and once every worker is done it merges the checks
   (:meth:`PlanChecks.merge`: the results of one check fed every row group), refuses a plan that
   fails them, appends the rest and writes the footer: the very bytes one writer writes, whoever
   wrote which segment.

A worker's error is every worker's (:func:`share_outcome`): nothing is committed, and the
temporary files go with the spill directory.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass

import numpy as np

from ...checks import PlanChecks
from ...errors import OutputError, WorkerError
from ...runtime import parquet_concat, rank0
from ...runtime.dist import Dist, collective_timeout, fault_point
from . import emit
from .epoch import EpochRows
from .spill import ItemReader

SPEC_POLL_S = 0.005  # a worker waiting for a segment's spec looks again after this long
SPECS_FAILED = "specs.failed"  # rank 0 failed while writing the specs: the waiting workers stop
SEGMENT_GROUPS = 32  # row groups a segment (100M samples, padded: ~46 segments; 1B: ~460): a worker that
# finishes last waits at most one segment for the other
JOB = "write-job.pkl"


@dataclass
class WriteJob:
    """What every worker needs to write any segment (besides the segment's specs)."""

    row_groups: emit.RowGroups
    readers: list  # per epoch, per chunk: ItemReader (pickled without open files)
    segments: int
    segment_groups: int

    @property
    def segment_rows(self) -> int:
        return self.row_groups.group * self.segment_groups


def _path(directory: str, name: str) -> str:
    return os.path.join(directory, name)


def _dump(value, path: str) -> None:
    try:
        with open(path + ".tmp", "wb") as fh:
            pickle.dump(value, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(path + ".tmp", path)
    except OSError as exc:
        raise OutputError(f"cannot write the plan's temporary files in {os.path.dirname(path)}: "
                          f"{exc.strerror or exc}") from None


def _load(path: str):
    with open(path, "rb") as fh:
        return pickle.load(fh)  # our own spill directory, written by this job's workers


def segment_name(s: int, ext: str) -> str:
    return f"seg-{s:06d}.{ext}"


def write_job(directory: str, rg: emit.RowGroups, readers: list[list[ItemReader]]) -> WriteJob:
    """Rank 0: what every worker needs besides the segments' specs (``write-job.pkl``)."""
    job = WriteJob(rg, readers, 0, SEGMENT_GROUPS)
    job.segments = max(1, -(-rg.total // job.segment_rows))
    _dump(job, _path(directory, JOB))
    return job


def write_specs(directory: str, epochs: list[EpochRows], job: WriteJob) -> None:
    """Rank 0: each segment's row specs in segment order, each published whole (renamed into place) as
    soon as it is written, so that the other workers write segment 0 while rank 0 writes the next
    specs. A failure leaves :data:`SPECS_FAILED` for the workers waiting on a spec."""
    rg = job.row_groups
    starts = np.concatenate([[0], np.cumsum([ep.count for ep in epochs])])
    try:
        for s in range(job.segments):
            lo = s * job.segment_rows
            hi = min(rg.total, lo + job.segment_rows)
            firsts = range(lo, max(hi, lo + 1), rg.group)  # (an empty plan: one empty group, as one writer writes)
            groups = [(g, emit.row_specs(epochs, starts, g, min(hi, g + rg.group))) for g in firsts]
            fault_point("plan.specs")
            _dump(groups, _path(directory, segment_name(s, "spec")))
    except BaseException:
        with open(_path(directory, SPECS_FAILED), "wb"):
            pass
        raise


def _wait_spec(directory: str, s: int, timeout: float) -> None:
    """Until rank 0 has published segment ``s``'s spec (it writes them in order while the others write)."""
    path = _path(directory, segment_name(s, "spec"))
    waited = 0.0
    while not os.path.exists(path):
        if os.path.exists(_path(directory, SPECS_FAILED)):
            raise WorkerError("rank 0 failed while writing the plan's segment specs")
        if waited > timeout:
            raise WorkerError(f"rank 0 wrote no segment spec {s} in {timeout:.0f} s (VARLEN_TIMEOUT)")
        time.sleep(SPEC_POLL_S)
        waited += SPEC_POLL_S


def _claim(directory: str, s: int, count: int) -> int | None:
    """The first segment from ``s`` on that no worker has claimed yet (now this worker's), or None."""
    while s < count:
        try:
            os.close(os.open(_path(directory, segment_name(s, "claim")), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return s
        except FileExistsError:
            s += 1
    return None


def write_share(directory: str, rank: int, output: str, between=None) -> int:
    """Every worker: claim segments until none is left, write and check each (waiting for a segment's
    spec while rank 0 still writes it), calling ``between()`` after each; pickle the checks. The number
    of segments this worker wrote."""
    job: WriteJob = _load(_path(directory, JOB))
    fault_point("plan.segment")  # tests: a worker killed in phase 3
    checks = PlanChecks(job.row_groups.fin.metadata, lengths=True, mergeable=True)
    written, s = 0, 0
    timeout = collective_timeout()
    try:
        while (s := _claim(directory, s, job.segments)) is not None:
            _wait_spec(directory, s, timeout)
            groups = _load(_path(directory, segment_name(s, "spec")))
            out = _path(directory, segment_name(s, "parquet"))
            emit.write_groups(output, out + ".tmp", job.row_groups, job.readers, checks,
                              ((first, lambda specs=specs: specs) for first, specs in groups))
            os.replace(out + ".tmp", out)
            written += 1
            s += 1
            if between is not None:
                between()
    except OSError as exc:
        raise OutputError(f"cannot write the plan's temporary files in {directory}: {exc.strerror or exc}") from None
    finally:
        for rs in job.readers:
            for r in rs:
                r.close()
    _dump(checks, _path(directory, f"checks-{rank:05d}.pkl"))
    return written


class Joiner:
    """Rank 0: the segments appended to the plan's temporary file in segment order as soon as they
    are written (``advance``, between rank 0's own segments: the copying overlaps the other workers'
    writing), each removed once appended, then the rest and the footer (:func:`join`)."""

    def __init__(self, directory: str, count: int, tmp_path: str, output: str):
        self.directory, self.count, self.next = directory, count, 0
        self.cat = parquet_concat.Concatenation(tmp_path, what=output)

    def advance(self) -> None:
        """Append every written segment that follows the appended ones."""
        while self.next < self.count:
            path = _path(self.directory, segment_name(self.next, "parquet"))
            if not os.path.exists(path):  # renamed into place once whole
                return
            self.cat.add(path)
            os.remove(path)  # its bytes are in the plan now: the disk holds the plan about once, not twice
            self.next += 1

    def close(self) -> None:
        self.cat.out.close()


def join(directory: str, world_size: int, joiner: Joiner) -> None:
    """Rank 0, every worker done: the merged checks (refusing a plan that fails them), then the segments
    not yet appended and the footer."""
    checks = None
    for rank in range(world_size):
        part = _load(_path(directory, f"checks-{rank:05d}.pkl"))
        if checks is None:
            checks = part
        else:
            checks.merge(part)
        del part
    emit.raise_failed(checks)
    joiner.advance()
    if joiner.next < joiner.count:  # pragma: no cover - every worker returned, every segment written
        raise OutputError(f"segment {joiner.next} of the plan is missing in {directory}")
    joiner.cat.finish()


def share_outcome(d: Dist, fn):
    """``fn()`` on every rank, then every rank's outcome on every rank: the first failing rank's error
    raised everywhere (marked ``shared``, as ``run.on_main`` marks it: no rank gathers it again), else
    the values by rank."""
    outcomes = d.all_gather_object(rank0.outcome_of(fn))
    for o in outcomes:
        if o[0] == "error":
            rank0.result_of(o)
    return [o[1] for o in outcomes]
