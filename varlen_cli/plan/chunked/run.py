"""The chunked planner across workers: phase 0 (a chunk source's preparation) and phase 1 on every
rank, phase 2 shared (rank 0 finishes it), phase 3 on every rank.

:func:`plan_chunked` runs ``varlen plan`` (a metrics or sorted directory, a mixture, a replan's or an
extension's epochs: :class:`Continuation`) as world size 1 in this process, in ``--nproc N`` local
workers, or on the ranks of a torchrun job: every rank forms the (epoch, chunk) jobs ``j`` with
``j mod world_size == rank`` and writes them into a temporary directory beside the output; then one
worker lays the epochs out and streams the plan, or every rank lays out its share of each epoch (rank
0 joins the shares and computes the columns) and writes segments of the plan that rank 0 joins
(:mod:`.segments`). Every rank returns rank 0's result (or raises its error). See the package
docstring for the design."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import numpy as np

from ... import storage
from ...budget import Budget
from ...errors import InputError, UsageError
from ...runtime import artifacts, rank0, safety
from ...runtime.dist import Dist, cap_workers, fault_point, run_distributed, session
from .. import cost_model
from ..batching import fixed_cap
from ..cost_model import FEWER_EPOCHS, check_plan_size, resolve_budget
from ..layout import PLAN_REMEDIES, Remedies
from ..orders import CURRICULAR, epoch_mode
from ..progress import PlanProgress
from ..shapes import ShapeMap, choose_edges
from . import emit, segments, spill
from .chunks import TARGET_COLUMN, ChunkData, ChunkSpec, chunk_rng, global_rng
from .epoch import EpochRows, lay_out
from .finish import Dropped, Finished, LaidOut, finish, tally
from .form import PlanContext, form_chunk
from .output import PlanOutput
from .sources import DirectoryInput, Left, MixtureInput, open_manifest

# rank 0 in phases 2 and 3, per sample entry of an epoch (benchmarks/scale.md, "Rank 0 memory"; heavy-tailed
# lengths of mean 1,089): padded ~18 bytes a microbatch of ~16 samples (its columns in compact dtypes and the
# plan order); packed ~24 bytes a packed row of ~7.5 samples (the same, and the writer's check of split samples)
TABLE_BYTES_PER_ENTRY = 2
PACKED_TABLE_BYTES_PER_ENTRY = 4
CHUNK_BYTES_PER_SAMPLE = 200  # phase 1: one chunk's formation (packing, measured ~190 at 2^23 samples)
SHARED_LAYOUT_MEMORY = 0.8  # a shared layout's tables (one per rank of a node) may take this much of what is free


@dataclasses.dataclass(frozen=True)
class Continuation:
    """How a plan is planned besides its options. A continued plan (``varlen plan --extend``,
    ``varlen replan``) numbers its epochs from ``first_epoch`` (seed streams, curriculum switch,
    compile warm-up only in epoch 0) and uses ``budget``, the parent's as recorded (not resolved again
    from the options); refusals suggest ``remedies``. Epoch ``e`` of the written plan is the job's epoch
    ``first_epoch + e``. A mixture's plan names its ``mixture`` sources (``recorded``: a parent's
    entries of them, which each source must still match)."""

    first_epoch: int = 0
    budget: Budget | None = None
    remedies: Remedies = PLAN_REMEDIES
    too_big: str = FEWER_EPOCHS  # what a plan too big for this machine's memory suggests
    first: Left | None = None  # ``varlen replan``: what the plan's first epoch holds
    metadata: dict | None = None  # entries of the plan's metadata given (lineage, the recorded config)
    mixture: tuple | None = None  # a mixture's sources (sources.MixSource), in the metadata's order
    recorded: tuple | None = None  # a parent's ``mixture.sources`` entries

    def epoch(self, e: int) -> int:
        """The job's epoch number of the plan's epoch ``e``."""
        return self.first_epoch + e

    def chunk(self, data: ChunkData, e: int, ctx: PlanContext) -> ChunkData:
        """A chunk's samples in the plan's epoch ``e``: in a replan's first, what :attr:`first` holds."""
        if e or self.first is None:
            return data
        return self.first.chunk(data, ctx.too_long(data))

    def inputs(self, c) -> list[str]:
        """The directories the plan reads."""
        return [s.path for s in self.mixture] if self.mixture is not None else [c.input]

    def open(self, c):
        """What the plan is planned from (:mod:`.sources`), checked."""
        if self.mixture is not None:
            return MixtureInput(list(self.mixture), c.seed, c.order in CURRICULAR, c.allow_stale,
                                list(self.recorded) if self.recorded is not None else None)
        manifest = open_manifest(c.input, c.allow_stale)
        kind = manifest.get("kind", "metrics")
        if c.order in CURRICULAR and kind != "sorted":
            raise UsageError(f"--order {c.order} needs a sorted input, but {c.input} is a {kind} directory "
                             f"(sample_id order); sort it first: `varlen sort {c.input} -o SORTED_DIR`")
        plan_input = DirectoryInput(c.input, manifest)
        if plan_input.num_rows == 0:
            raise InputError(f"{c.input} holds no samples")
        return plan_input


FRESH = Continuation()  # a plan of its own: epochs from 0, the budget from its options


def plan_chunked(c, t0: float | None = None, cont: Continuation = FRESH):
    """``varlen plan`` on ``c.nproc`` workers (or the torchrun ranks); the result on every rank.
    ``cont``: the epochs continue another plan's (:class:`Continuation`)."""
    t0 = time.perf_counter() if t0 is None else t0
    out = PlanOutput(c.output, c.overwrite)
    out.check(cont.inputs(c))
    c = cap_workers(c, functools.partial(_count_jobs, c, cont))
    entry = functools.partial(_in_session, t0=t0, cont=cont)
    if c.nproc == 1:
        if rank0.needs_group():  # a torchrun rank: every rank forms its share of the chunks
            return entry(c)
        return run_in_group(c, Dist(), t0, cont)  # alone (a process group the caller made stays the caller's)
    with out.locked():  # the launcher holds it; its workers inherit it
        try:
            return run_distributed(entry, c, c.nproc)
        except BaseException:
            if not out.remote:
                safety.clean_leftovers(out.local.path)
            raise


def _count_jobs(c, cont: Continuation) -> tuple[int, str]:
    """The (epoch, chunk) jobs of phase 1, which cap ``--nproc`` (a mixture's estimated from its sources'
    rows: a worker left without a job idles)."""
    rows = sum(int(artifacts.read_manifest(path, what="metrics or sorted directory").get("num_rows", 0))
               for path in cont.inputs(c))
    return max(1, c.epochs) * ChunkSpec(max(rows, 1), int(c.chunk_samples)).count, "chunk job"


def _in_session(c, t0: float, cont: Continuation = FRESH):
    storage.configure(c.storage_options)  # --storage-option, in every worker process
    with session("cpu") as d:
        return _shared(d, lambda: run_in_group(c, d, t0, cont))


def plan_in_group(c, d: Dist, t0: float):
    """The chunked plan by every rank of the caller's process group ``d`` (``varlen run``); the
    result on rank 0, None elsewhere."""
    return run_in_group(c, d, t0)


def _shared(d: Dist, fn):
    """``fn()`` on every rank; rank 0's result (or user error) is every rank's."""
    if not d.distributed:
        return fn()
    return rank0.result_of(d.all_gather_object(rank0.outcome_of(fn))[0])


def on_main(d: Dist, fn):
    """``fn()`` on rank 0 only; its result (or user error) is every rank's. The other ranks meet rank 0
    at this one collective whatever happens, so an error on rank 0 can never be taken for its result."""
    if not d.distributed:
        return fn()
    return rank0.result_of(d.all_gather_object(rank0.outcome_of(fn) if d.is_main else ("ok", None))[0])


def context(c, plan_input, spec: ChunkSpec, d: Dist, cont: Continuation = FRESH) -> PlanContext:
    """The budget, shape map and limits every chunk is formed with."""
    budget = cont.budget if cont.budget is not None else resolve_budget(c)
    shape = ShapeMap(1 if c.packing else c.pad_multiple)
    rows_per_mb = cost_model.rows_per_microbatch(c, budget) if c.packing else None
    cost_model.check_cost_range(c, budget, rows_per_mb)
    if c.packing:
        fit = (1 << 62) if c.split_long else int(c.seq_len)
    else:
        fit = cost_model.longest_fitting(np.array([np.iinfo(np.int32).max], np.int64), budget, shape)
    ctx = PlanContext(order=c.order, shape=shape, budget=budget, dp=c.dp, grad_accum=c.grad_accum,
                      static=c.static_shapes, same_shape=c.same_shape_per_step, packing=c.packing, seq_len=c.seq_len,
                      max_per_row=c.max_per_row, split_long=c.split_long, rows_per_mb=rows_per_mb, tail=c.tail,
                      longest_fitting=int(fit), remedies=cont.remedies,
                      num_sources=plan_input.num_sources if plan_input.mixture is not None else 0)
    if budget.two_sided:  # the target side: padded like the source (--pad-multiple; --num-shapes: its own edges)
        ctx.target_shape = ShapeMap(c.pad_multiple)
        ctx.longest_target_fitting = cost_model.longest_fitting(np.array([np.iinfo(np.int32).max], np.int64),
                                                                budget.target_side(), ctx.target_shape)
    if (c.num_shapes is not None and not c.packing) or (spec.count > 1 and c.order == "random"):
        _census(c, ctx, plan_input, spec, d)
    return ctx


def _census(c, ctx: PlanContext, plan_input, spec: ChunkSpec, d: Dist) -> None:
    """One pass over the lengths (shared out by rank): the bucket edges of ``--num-shapes`` and the
    random order's fixed batch size, from the whole input (the samples that fit); under two budgets
    the target side's too."""
    sides = [ctx.shape] + ([ctx.target_shape] if ctx.two_sided else [])
    counts: list = [{} for _ in sides]
    longest = [-1 for _ in sides]
    for k in range(d.rank, spec.count, d.world_size):
        data = plan_input.census(spec, k, ctx.two_sided)
        fit = ~ctx.too_long(data)
        for s, values in enumerate((data.length, data.target)[:len(sides)]):
            values = values[fit]
            if len(values):
                longest[s] = max(longest[s], int(values.max()))
                u, n = np.unique(sides[s].pad(values), return_counts=True)
                for a, b in zip(u.tolist(), n.tolist()):
                    counts[s][a] = counts[s].get(a, 0) + b
    merged: list = [{} for _ in sides]
    for part in d.all_gather_object((counts, longest)):
        for s in range(len(sides)):
            for a, b in part[0][s].items():
                merged[s][a] = merged[s].get(a, 0) + b
            longest[s] = max(longest[s], part[1][s])
    if c.num_shapes is not None and not c.packing:
        for s, m in enumerate(merged):
            if m:
                u = np.array(sorted(m), np.int64)
                edges = choose_edges(np.repeat(u, [m[x] for x in u.tolist()]), c.num_shapes)
                sides[s] = ShapeMap(c.pad_multiple, edges)
        ctx.shape = sides[0]
        ctx.target_shape = sides[1] if ctx.two_sided else None
    if c.order == "random" and longest[0] >= 0:
        t_max = int(ctx.shape(np.array([longest[0]]))[0])
        target_max = int(ctx.target_shape(np.array([max(longest[1], 0)]))[0]) if ctx.two_sided else None
        ctx.fixed_batch = max(fixed_cap(ctx.budget, t_max, target_max=target_max), 1)


def _spill_dir(d: Dist, out: PlanOutput) -> str:
    return on_main(d, lambda: out.make_spill_dir(d.world_size))


def run_in_group(c, d: Dist, t0: float, cont: Continuation = FRESH):
    """One rank's part (see the module docstring); the result on rank 0, None elsewhere."""
    plan_input = cont.open(c)
    if plan_input.has_target and c.packing and c.split_long:
        raise UsageError(f"--split-long cannot tell which chunk of a split sample holds its {TARGET_COLUMN} loss "
                         f"tokens (analyze --target-length); pack without --split-long")
    if c.max_target_tokens is not None or (cont.budget is not None and cont.budget.two_sided):
        missing = plan_input.missing_target()
        if missing is not None:
            raise InputError(f"--max-target-tokens bounds the target side, but {missing} has no {TARGET_COLUMN} "
                             f"column: run `varlen analyze ... --target-length KIND:PATH` (docs/plan.md, \"Two "
                             "budgets\")")
    n = plan_input.num_rows
    spec = ChunkSpec(n, int(c.chunk_samples))
    # rank 0 holds the microbatch tables of every epoch (~2-4 bytes a sample entry), each worker one chunk
    check_plan_size(n, c.epochs, plan_input.describe(n),
                    bytes_per_entry=PACKED_TABLE_BYTES_PER_ENTRY if c.packing else TABLE_BYTES_PER_ENTRY,
                    fixed=CHUNK_BYTES_PER_SAMPLE * min(spec.size, n) * d.world_size, remedy=cont.too_big)
    out = PlanOutput(c.output, c.overwrite)
    with (out.locked() if d.is_main else contextlib.nullcontext()), \
            PlanProgress(c.progress and d.is_main, c.epochs) as bar:
        directory = _spill_dir(d, out)
        try:
            bar.phase("read")
            canonical = any(epoch_mode(c, cont.epoch(e)) not in CURRICULAR for e in range(c.epochs))
            plan_input.prepare(spec, directory, d, canonical)  # phase 0 (scatter; a mixture's lists and runs)
            d.barrier()
            ctx = context(c, plan_input, spec, d, cont)
            _phase1(c, ctx, plan_input, spec, d, directory, bar, cont)
            d.barrier()
            if d.world_size > 1:  # phase 3 shared out (segments.py)
                result = _phase23_workers(c, ctx, plan_input, spec, directory, out, t0, bar, d, cont)
                if not d.is_main:
                    return None
            else:
                _trim()
                result = _phase23(c, ctx, plan_input, spec, directory, out, t0, bar, cont)
        finally:
            if d.is_main:
                out.remove_spill_dir(directory)
    result.phases = dict(bar.seconds)
    return result


def _phase1(c, ctx: PlanContext, plan_input, spec: ChunkSpec, d: Dist, directory: str, bar: PlanProgress,
            cont: Continuation = FRESH) -> None:
    jobs = [(e, k) for e in range(c.epochs) for k in range(spec.count)]
    cached: tuple | None = None
    shown = None
    for j, (e, k) in enumerate(jobs):
        if j % d.world_size != d.rank:
            continue
        if e != shown:
            bar.phase(f"form epoch {e + 1}/{c.epochs}")
            shown = e
        mode = epoch_mode(c, cont.epoch(e))
        key = (k, mode in CURRICULAR)
        if cached is None or cached[0] != key:
            cached = (key, plan_input.reader(spec, mode in CURRICULAR, mode == "reverse").read(k))
        data = cont.chunk(cached[1], e, ctx)
        cu = form_chunk(data, ctx, mode, e, chunk_rng(c.seed, cont.epoch(e), k), whole=spec.count == 1, config=c)
        spill.write(directory, cu)
        del cu
        fault_point("plan.chunk")
    cached = None
    _trim()


def _trim() -> None:
    from ..heap import trim

    trim()


def _dropped_long(c, ctx: PlanContext, tables: list, n: int) -> Dropped:
    """Too-long samples of the input (counted in the first epoch's chunks): refused unless ``--drop-long``
    (:func:`~varlen_cli.plan.cost_model.too_long_error`); the plan's :class:`~.finish.Dropped`."""
    num_long = sum(int(t.header["num_long"]) for t in tables)
    if num_long:
        longest = max(int(t.header["longest"]) for t in tables)
        shortest = min((int(t.header.get("shortest", 0)) for t in tables), default=0)
        longest_target = max(int(t.header.get("longest_target", 0)) for t in tables)
        error = cost_model.too_long_error(c, ctx.budget, ctx.remedies, num_long, n, longest, shortest, longest_target)
        if error is not None:
            raise error
    long_ids = np.concatenate([np.asarray(t.long_ids, np.int64) for t in tables])
    long_sources = np.concatenate([np.asarray(t.long_sources if t.long_sources is not None else
                                              np.zeros(0, np.int32), np.int64) for t in tables]) \
        if ctx.num_sources else None
    return Dropped(long_ids, [], c.epochs, num_long, long_sources, [] if ctx.num_sources else None)


def _phase23(c, ctx: PlanContext, plan_input, spec: ChunkSpec, directory: str, out: PlanOutput, t0: float,
             bar: PlanProgress, cont: Continuation = FRESH):
    """One worker: phase 2, then the plan streamed by this process."""
    laid = _lay_out(c, ctx, plan_input, spec, directory, bar, (0, 1), cont)
    fin = _finish(c, ctx, plan_input, spec, laid, bar, t0, cont)
    bar.phase("write")
    try:
        out.write(lambda tmp: emit.write(c.output, c.overwrite, laid.epochs, fin, laid.readers, c.dp, c.grad_accum,
                                         bool(c.packing), tmp),
                  before_commit=lambda: fault_point("plan.write"))
    finally:
        _close(laid.readers)
    return _result(c, out, sum(ep.count for ep in laid.epochs), fin, t0)


def _phase23_workers(c, ctx: PlanContext, plan_input, spec: ChunkSpec, directory: str, out: PlanOutput, t0: float,
                     bar: PlanProgress, d: Dist, cont: Continuation = FRESH):
    """W > 1 workers: every rank lays out its share of each epoch (rank 0 joins the parts), rank 0
    finishes the epochs and writes the segments' specs; every rank writes segments; rank 0 joins them
    into the output (:mod:`.segments`). Rank 0's result, None elsewhere; any rank's error on every rank."""
    held: dict = {}
    shared = layout_is_shared(c, plan_input.num_rows, d)

    def lay_out_share() -> None:
        _trim()
        if not shared and not d.is_main:
            return
        laid = _lay_out(c, ctx, plan_input, spec, directory, bar, (d.rank, d.world_size) if shared else (0, 1),
                        cont)
        if d.is_main:
            held["laid"] = laid

    try:
        segments.share_outcome(d, lay_out_share)  # any rank's phase-2 error is every rank's
    except BaseException:
        if "laid" in held:
            _close(held.pop("laid").readers)
        raise

    def finish_and_job() -> None:
        laid = held.pop("laid")
        for e, ep in enumerate(laid.epochs if shared else ()):
            for r in range(1, d.world_size):
                lo, hi = ep.parts[r]
                laid.tallies[e].append(spill.read_order_part(directory, e, r, ep.order[lo:hi]))
        fin = _finish(c, ctx, plan_input, spec, laid, bar, t0, cont)
        bar.phase("write")
        rg = emit.row_groups_of(laid.epochs, fin, c.dp, c.grad_accum, bool(c.packing))
        try:
            held.update(fin=fin, count=rg.total, epochs=laid.epochs,
                        job=segments.write_job(directory, rg, laid.readers))
        finally:
            _close(laid.readers)

    on_main(d, finish_and_job)  # rank 0's phase-2 error is every rank's
    return _write_segments(c, d, directory, out, held, t0, shared)


def _write_segments(c, d: Dist, directory: str, out: PlanOutput, held: dict, t0: float, shared: bool):
    """Phase 3 of ``W > 1`` workers (:mod:`.segments`): rank 0 publishes the segments' specs and joins
    the segments; every rank writes segments. Rank 0's result, None elsewhere."""
    def specs_and_segments() -> int:
        if not d.is_main:
            return segments.write_share(directory, d.rank, c.output)
        # the plan's temporary file, filled with the segments as they come; the segments' specs,
        # published one by one while the other ranks write segments
        held["joiner"] = segments.Joiner(directory, held["job"].segments, held.pop("tmp"), c.output)
        segments.write_specs(directory, held.pop("epochs"), held["job"])
        _trim()  # the epochs' tables go here: rank 0 writes its segments holding one segment's specs
        return segments.write_share(directory, d.rank, c.output, between=held["joiner"].advance)

    def share() -> None:
        segments.share_outcome(d, specs_and_segments)

    if not d.is_main:
        share()
        return None

    def fill(tmp: str) -> None:
        held["tmp"] = tmp
        try:
            share()
            segments.join(directory, d.world_size, held["joiner"])
        finally:
            held.pop("epochs", None)
            if "joiner" in held:
                held.pop("joiner").close()

    out.write(fill, before_commit=lambda: fault_point("plan.write"))
    result = _result(c, out, held["count"], held["fin"], t0)
    result.write_segments = held["job"].segments
    result.layout_shared = shared
    return result


def layout_is_shared(c, num_rows: int, d: Dist) -> bool:
    """Whether every rank lays out a share of each epoch (faster) or rank 0 alone: a rank that shares the
    layout holds the epoch's unit table too (~2-4 bytes a sample entry), so it is shared only while every
    node's ranks can all hold one in :data:`SHARED_LAYOUT_MEMORY` of the memory its ranks see free now (the
    same answer on every rank; the plan is the same either way)."""
    need = num_rows * (PACKED_TABLE_BYTES_PER_ENTRY if c.packing else TABLE_BYTES_PER_ENTRY)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or d.world_size)
    seen = d.all_gather_object((cost_model.available_memory(), local))
    return all(free is None or n * need <= SHARED_LAYOUT_MEMORY * free for free, n in seen)


def _close(readers: list) -> None:
    for rs in readers:
        for r in rs:
            r.close()


def _lay_out(c, ctx: PlanContext, plan_input, spec: ChunkSpec, directory: str, bar: PlanProgress,
             share: tuple[int, int], cont: Continuation = FRESH) -> LaidOut | None:
    """Every epoch laid out by rank ``share[0]`` of ``share[1]``: the whole epochs on rank 0 (the other
    ranks' positions still to be read from their part files), None on the other ranks, which write
    their parts of each epoch's order into the spill directory (:func:`.epoch.lay_out`)."""
    rank, world = share
    laid = LaidOut([], [], [], None, None, [] if ctx.num_sources else None, [] if world > 1 else None)
    for e in range(c.epochs):
        tables = [spill.read_table(directory, e, k) for k in range(spec.count)]
        if e == 0:
            laid.dropped = _dropped_long(c, ctx, tables, plan_input.num_rows)
            laid.fixed_batch = tables[0].header.get("fixed_batch") or ctx.fixed_batch
            if ctx.fixed_batch is None and laid.fixed_batch is not None:
                ctx.fixed_batch = int(laid.fixed_batch)
        if c.packing:
            laid.packing_stats.append(_packing_stats(tables))
        mode = epoch_mode(c, cont.epoch(e))
        bar.phase(f"layout epoch {e + 1}/{c.epochs}")
        ep = lay_out(tables, ctx, mode, global_rng(c.seed, cont.epoch(e)),
                     warmup=c.compile_warmup and cont.epoch(e) == 0, schedule=c.schedule, stages=c.stages,
                     share=share)
        fault_point("plan.layout")  # tests: a worker killed in its share of the layout
        if world > 1:  # the sums finish needs, of this rank's rows
            lo, hi = ep.parts[rank]
            own = tally(c, ctx, ep, lo, hi)
            if rank:
                spill.write_order_part(directory, e, rank, ep.order[lo:hi], own)
                del ep, tables, own
                continue
            laid.tallies.append([own])
        _tail(directory, tables, ep, laid, ctx, cont.first if e == 0 else None)
        laid.epochs.append(ep)
        laid.readers.append([spill.ItemReader(directory, t) for t in tables])
        del tables
    return None if rank else laid


def _tail(directory: str, tables: list, ep: EpochRows, laid: LaidOut, ctx: PlanContext, first: Left | None) -> None:
    """The epoch's ``--tail drop`` samples (the chunks' own, and the units phase 2 dropped, read from their
    chunk files; a replan's first epoch: and those the parent's dropped, ``first``) into ``laid.dropped``;
    a mixture's tokens per source (less those dropped)."""
    dropped = _tail_items(directory, tables, ep, ("ids", "source", "sample_length") if ctx.num_sources else ("ids",))
    before = first.dropped if first is not None and first.dropped is not None else None
    ids = [np.asarray(ep.tail_ids, np.int64), dropped["ids"]] + ([before["ids"]] if before else [])
    laid.dropped.tail_ids.append(np.concatenate(ids))
    if not ctx.num_sources:
        return
    own = [np.asarray(t.tail_sources if t.tail_sources is not None else np.zeros(0, np.int32), np.int64)
           for t in tables]
    own += [dropped["source"].astype(np.int64)] + ([before["sources"]] if before else [])
    laid.dropped.tail_sources.append(np.concatenate(own))
    tokens = np.sum([t.header["source_tokens"] for t in tables], axis=0).astype(np.int64)
    tokens -= np.bincount(dropped["source"], weights=dropped["sample_length"],
                          minlength=ctx.num_sources).astype(np.int64)  # padded units: whole samples
    laid.source_tokens.append(tokens.tolist())


def _finish(c, ctx: PlanContext, plan_input, spec: ChunkSpec, laid: LaidOut, bar: PlanProgress, t0: float,
            cont: Continuation = FRESH) -> Finished:
    """Rank 0, the epochs laid out: the plan's columns and metadata (``finish``)."""
    _trim()  # the layout's block temporaries: their freed pages back to the system before the write's buffers
    bar.phase("columns")
    fin = finish(c, ctx, plan_input, laid, t0, trained_only=plan_input.has_target)
    fin.metadata["chunks"]["count"] = spec.count
    fin.metadata.update(cont.metadata or {})  # before the write: the plan's own check reads it (lineage)
    return fin


def _result(c, out: PlanOutput, num_microbatches: int, fin: Finished, t0: float):
    from ..config import PlanResult

    fin.summary["seconds"] = time.perf_counter() - t0
    return PlanResult(output=out.final, order=c.order, num_steps=int(fin.step_start[-1]),
                      num_microbatches=num_microbatches, stats=fin.summary,
                      packing=fin.metadata.get("packing"), dropped_ids=fin.dropped_ids,
                      seconds=fin.summary["seconds"], metadata=fin.metadata)


def _tail_items(directory: str, tables: list, ep: EpochRows, names: tuple) -> dict:
    """Items ``names`` of the units ``--tail drop`` dropped in phase 2 (read from their chunk files)."""
    units = ep.dropped_units
    if units is None or not len(units["chunk"]):
        return {name: np.zeros(0, np.int64) for name in names}
    parts: dict = {name: [] for name in names}
    for k, lo, n in zip(units["chunk"].tolist(), units["item_lo"].tolist(), units["count"].tolist()):
        r = spill.ItemReader(directory, tables[k])
        for name in names:
            parts[name].append(r.read(name, lo, lo + n).astype(np.int64))
        r.close()
    return {name: np.concatenate(v) for name, v in parts.items()}


def _packing_stats(tables: list) -> dict:
    """An epoch's packing statistics from its chunks' (rows, items, ...; ``Packing.stats``' formulas)."""
    infos = [t.header["packing"] for t in tables]
    if len(infos) == 1 and "samples_per_row_mean" in infos[0]:
        return infos[0]
    rows = sum(int(p["rows"]) for p in infos)
    items = sum(int(p["items"]) for p in infos)
    return {"split_samples": sum(int(p["split_samples"]) for p in infos),
            "samples_per_row_mean": items / rows if rows else 0.0,
            "samples_per_row_max": max(int(p["samples_per_row_max"]) for p in infos)}
