"""Chunked plans (issue 25): chunks of the input, not workers, define the plan.

Small corpora with a tiny ``chunk_samples`` so that every plan spans several chunks: every order and
layout option keeps the plan invariants and passes ``varlen validate``; a one-chunk plan is exactly
the single-process planner's; 1, 2 and 4 workers write the same plan; a killed worker fails the job
and leaves the old plan as it was; the tail rule on the unit table is the single-process rule.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT
from tests.plan_helpers import check_plan, epoch_ids, write_metrics
from varlen_cli.plan.core import PlanConfig, plan
from varlen_cli.validate import ValidateConfig, validate

N = 3000
CHUNK = 700  # 5 chunks of 600 samples


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(5.0, 1.0, N), 1, 2000).astype(np.int64)
    lengths[::97] = 0  # empty samples
    return {"lengths": lengths, "metrics": write_metrics(root / "m", lengths),
            "sorted": write_metrics(root / "s", lengths, sorted_by="length", parts=3), "root": root}


CASES = {
    "bucket-shuffle": dict(max_tokens=4096, dp=4, grad_accum=2, epochs=2),
    "curriculum": dict(order="curriculum", max_tokens=4096, dp=3),
    "reverse": dict(order="reverse", max_tokens=4096, dp=2, grad_accum=3),
    "random": dict(order="random", max_tokens=8192, dp=2),
    "sorted input, bucket-shuffle": dict(max_tokens=4096, dp=2, input="sorted"),
    "curriculum epochs": dict(order="curriculum", curriculum_epochs=1, epochs=2, max_tokens=4096, dp=2),
    "static shapes, warm-up": dict(max_tokens=4096, dp=4, num_shapes=4, static_shapes=True, compile_warmup=True),
    "same shape per step": dict(max_tokens=4096, dp=2, same_shape_per_step=True),
    "random, same shape": dict(order="random", max_tokens=8192, dp=2, same_shape_per_step=True),
    "drop long, pad multiple": dict(max_tokens=1024, dp=2, drop_long=True, pad_multiple=8, max_samples=16),
    "attention cost": dict(max_tokens=4096, dp=2, attention_cost=0.0002),
    "packed": dict(packing=True, seq_len=2048, dp=4),
    "packed curriculum": dict(order="curriculum", packing=True, seq_len=2048, dp=2),
    "packed, rows per microbatch": dict(packing=True, seq_len=1024, max_tokens=4096, dp=2, split_long=True),
    "packed, cap": dict(packing=True, seq_len=2048, dp=2, max_per_row=4, epochs=2),
    "packed, attention cost": dict(packing=True, seq_len=2048, dp=2, grad_accum=2, attention_cost=0.0001,
                                   split_long=True),
}


def _config(dirs, out, options, **more) -> PlanConfig:
    options = dict(options)
    src = options.pop("input", "sorted" if options.get("order") in ("curriculum", "reverse") else "metrics")
    return PlanConfig(input=dirs[src], output=str(out), overwrite=True, progress=False, **options, **more)


def _same_plan(a, b) -> bool:
    """The same file, byte for byte (a plan records no time, host, worker count or output path)."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_plans_keep_the_invariants(dirs, tmp_path, name):
    """Several chunks per epoch: validate passes, every sample once per epoch, budget and layout kept."""
    options = CASES[name]
    c = _config(dirs, tmp_path / "p.parquet", options, chunk_samples=CHUNK)
    result = plan(c)
    assert result.metadata["chunks"] == {"samples": CHUNK, "count": 5}
    src = dirs[options.get("input", "sorted" if options.get("order") in ("curriculum", "reverse") else "metrics")]
    v = validate(ValidateConfig(str(tmp_path / "p.parquet"), metrics=src))
    assert v.ok, [(x.name, x.detail) for x in v.violations]
    packed = bool(options.get("packing"))
    d, md = check_plan(tmp_path / "p.parquet", dirs["lengths"], max_tokens=options.get("max_tokens"),
                       dp=options.get("dp", 1), grad_accum=options.get("grad_accum", 1),
                       attention_cost=0.0 if packed else options.get("attention_cost", 0.0),
                       max_samples=options.get("max_samples"), packed=packed)
    dropped = set(md["dropped"]["sample_ids"])
    for e in range(md["epochs"]):
        seen = epoch_ids(d, e)
        if not options.get("split_long"):
            assert len(seen) == len(set(seen))
        assert set(seen) | dropped == set(range(N))


def test_chunked_quality_close_to_one_chunk(tmp_path):
    """Chunk edges cost at most two microbatches each (the greedy sequence's last, partly filled),
    so budget fill falls by at most 2 x chunks microbatches' worth (200k samples in 8 chunks: < 0.6
    points; 1B samples in chunks of 2^23: < 0.001). Padding grows as chunks shrink (fewer samples of
    each long length to group): here 0.06% -> 0.4%; chunks of 2^23 samples pad < 0.001%
    (benchmarks/README.md, issue 25)."""
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(5.5, 1.0, 200_000), 1, 16000).astype(np.int64)
    m = write_metrics(tmp_path / "m", lengths)
    stats = []
    for chunk in (1 << 23, 25_000):
        r = plan(PlanConfig(input=m, output=str(tmp_path / f"{chunk}.parquet"), max_tokens=16384, dp=8,
                            chunk_samples=chunk, progress=False))
        stats.append(r.stats)
    one, many = stats
    assert one["microbatches"] <= many["microbatches"] <= one["microbatches"] + 2 * 8 + 8
    assert one["padding_pct"] < 0.1 and many["padding_pct"] < 0.6
    assert many["straggler_mean"] < 1.02


def test_too_many_dropped_ids_are_counted_not_listed(dirs, tmp_path, monkeypatch):
    """More too-long samples than the list holds: counted, the rule recorded, and validate checks the
    count (and with --metrics the very samples) with its bitmap."""
    from varlen_cli.plan.chunked import finish

    monkeypatch.setattr(finish, "LIST_LIMIT", 3)
    out = tmp_path / "p.parquet"
    r = plan(_config(dirs, out, dict(max_tokens=512, drop_long=True, dp=2), chunk_samples=CHUNK))
    dropped = r.metadata["dropped"]
    n_long = int((dirs["lengths"] > 512).sum())
    assert dropped["too_long_listed"] is False and dropped["too_long_count"] == n_long > 3
    assert dropped["too_long_over"] == 512 and dropped["too_long_ids"] == []
    for metrics in (None, dirs["metrics"]):
        v = validate(ValidateConfig(str(out), metrics=metrics))
        assert v.ok, [(x.name, x.detail) for x in v.violations]
    # a sample that fits, taken out of the plan: caught by the count
    t = pq.read_table(out)
    ids = t.column("sample_ids").to_pylist()
    ids[0] = ids[0][1:] if len(ids[0]) > 1 else ids[0]
    bad = t.set_column(t.schema.get_field_index("sample_ids"), "sample_ids",
                       __import__("pyarrow").array(ids, type=t.schema.field("sample_ids").type))
    if len(pq.read_table(out).column("sample_ids")[0]) > 1:
        pq.write_table(bad.replace_schema_metadata(t.schema.metadata), tmp_path / "bad.parquet")
        v = validate(ValidateConfig(str(tmp_path / "bad.parquet")))
        assert any(x.name == "coverage" and "missing" in x.detail for x in v.violations)


def test_validate_and_readers_in_windows(dirs, tmp_path, monkeypatch):
    """A plan read back in many small windows (bounded memory): validate, Plan.open, the sampler."""
    from varlen_cli.checks import scan
    from varlen_cli.loader import Plan
    from varlen_cli.plan import writer

    monkeypatch.setattr(writer, "ROW_GROUP_TARGET", 8)
    monkeypatch.setattr(scan, "TARGET_VALUES", 64)
    out = tmp_path / "p.parquet"
    plan(_config(dirs, out, CASES["packed, cap"], chunk_samples=CHUNK))
    windows = list(scan.windows(pq.ParquetFile(out), ["step", "epoch"], ["sample_ids"], 2))
    assert len(windows) > 10 and all(w.n % 2 == 0 for w in windows)
    assert sum(w.n for w in windows) == pq.ParquetFile(out).metadata.num_rows
    v = validate(ValidateConfig(str(out), metrics=dirs["metrics"]))
    assert v.ok, [(x.name, x.detail) for x in v.violations]
    p = Plan.open(out, num_samples=N, world_size=2)
    got = [i for mb in p.microbatches(rank=0) for i in mb.sample_ids.tolist()]
    got += [i for mb in p.microbatches(rank=1) for i in mb.sample_ids.tolist()]
    assert sorted(set(got)) == list(range(N))


def test_inspect_and_simulate_in_windows(dirs, tmp_path, monkeypatch):
    """inspect's series summed window by window and simulate's row-group reads give what the whole
    table gives (a packed attention-cost plan: the straggler needs the segments' lengths)."""
    from varlen_cli import format, inspect
    from varlen_cli.checks import scan
    from varlen_cli.plan import writer
    from varlen_cli.schedule.simulate import read_plan_costs

    monkeypatch.setattr(writer, "ROW_GROUP_TARGET", 8)
    out = tmp_path / "p.parquet"
    plan(_config(dirs, out, CASES["packed, attention cost"], chunk_samples=CHUNK))
    pf, meta = format.open_plan_file(str(out))
    assert pf.metadata.num_row_groups > 10
    whole = inspect.plan_series(pf, meta)  # one window: TARGET_VALUES exceeds the plan's ids
    monkeypatch.setattr(scan, "TARGET_VALUES", 64)
    windowed = inspect.plan_series(pf, meta)
    assert _leaves(windowed).keys() == _leaves(whole).keys()
    for key, value in _leaves(whole).items():
        want = value if isinstance(value, str) else pytest.approx(value, rel=1e-12, nan_ok=True)
        assert _leaves(windowed)[key] == want, key
    t = pq.read_table(out)
    step, rank = t.column("step").to_numpy(), t.column("rank").to_numpy()
    cost = format.table_cost(t, format.plan_budget(meta))
    assert whole["steps"] == int(step.max()) + 1
    assert whole["straggler_mean"] == pytest.approx(float(format.straggler(step, rank, cost, meta["dp"]).mean()))
    costs = read_plan_costs(str(out))
    padded = (t.column("batch_size").to_numpy() * t.column("seqlen").to_numpy()).astype(np.float64)
    assert np.array_equal(costs.tokens.ravel(), padded)


def _leaves(value, key: str = "") -> dict:
    """A nested dict/list of numbers as {path: number or string}."""
    if isinstance(value, dict):
        return {k: v for name, x in value.items() for k, v in _leaves(x, f"{key}.{name}").items()}
    if isinstance(value, list):
        return {k: v for i, x in enumerate(value) for k, v in _leaves(x, f"{key}[{i}]").items()}
    return {key: value}


@pytest.mark.parametrize("order", ["bucket-shuffle", "random"])
def test_chunked_target_length_loss_tokens(tmp_path, monkeypatch, order):
    """Metrics with target_length over several chunks: step_loss_tokens sums the targets (counted
    here from the data), the planner's own check and validate --metrics both count them."""
    from varlen_cli import format
    from varlen_cli.errors import InternalConsistencyError

    rng = np.random.default_rng(8)
    lengths = rng.integers(1, 400, N)
    targets = (rng.random(N) * lengths).astype(np.int64)
    m = write_metrics(tmp_path / "m", lengths, targets=targets)
    out = tmp_path / "p.parquet"
    plan(PlanConfig(input=m, output=str(out), max_tokens=2048, dp=2, order=order, chunk_samples=CHUNK,
                    progress=False))
    t = pq.read_table(out, columns=["step", "sample_ids", "step_loss_tokens"])
    want: dict = {}
    for step, ids in zip(t.column("step").to_pylist(), t.column("sample_ids").to_pylist()):
        want[step] = want.get(step, 0) + int(targets[ids].sum())
    got = dict(zip(t.column("step").to_pylist(), t.column("step_loss_tokens").to_pylist()))
    assert got == want
    check = next(c for c in validate(ValidateConfig(str(out), metrics=m)).checks if c.name == "loss tokens")
    assert check.ok and not check.skipped and "target_length" in check.detail
    real = format.loss_targets  # the check counting one target more per entry: the planner refuses its plan
    monkeypatch.setattr(format, "loss_targets", lambda length, final=None, target=None:
                        real(length, final, target) + (target is not None))
    with pytest.raises(InternalConsistencyError, match="loss tokens"):
        plan(PlanConfig(input=m, output=str(tmp_path / "q.parquet"), max_tokens=2048, dp=2, order=order,
                        chunk_samples=CHUNK, progress=False))
    assert not (tmp_path / "q.parquet").exists()


# -- the tail on the unit table is the single-process rule ---------------------------------------------
@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 6), min_size=1, max_size=40), chunks=st.integers(1, 4),
       slots=st.integers(1, 9))
def test_table_tail_is_the_single_process_tail(counts, chunks, slots):
    """Splitting the fullest units of a chunked table (their candidates, or every splittable one with
    its lengths) gives the microbatches the rule gives on the whole epoch (``tail.fix_padded``)."""
    from varlen_cli.plan import batching, tail
    from varlen_cli.plan.shapes import Budget, ShapeMap

    counts = np.array(counts, np.int64)
    n = int(counts.sum())
    m = len(counts)
    if n < slots * -(-m // slots):
        return  # fewer samples than slots: the drop path
    lengths = np.arange(1, n + 1, dtype=np.int64) % 7 + 1
    offsets = np.concatenate([[0], np.cumsum(counts)])
    budget, shape = Budget(10**9), ShapeMap(1)

    def refinalize(samples, off):
        return batching.finalize_padded(samples, off, lengths, shape, budget, False)

    whole = batching.finalize_padded(np.arange(n), offsets, lengths, shape, budget, False)
    want, _ = tail.fix_padded(whole, slots, slots, 1, "split", refinalize)
    # the same units cut into chunks (consecutive units), each reporting its candidates
    cut = np.linspace(0, m, chunks + 1).astype(int)
    tables = []
    for a, b in zip(cut[:-1], cut[1:]):
        sub = dataclasses.replace(whole, samples=whole.samples[offsets[a]:offsets[b]],
                                  offsets=offsets[a:b + 1] - offsets[a], seqlen=whole.seqlen[a:b],
                                  batch_size=whole.batch_size[a:b], tokens=whole.tokens[a:b])
        pick, complete = tail.top_candidates(np.diff(sub.offsets), slots)
        cand = {"index": pick, "complete": complete}
        if len(pick):
            s2 = sub.take(pick)
            c2 = np.diff(s2.offsets)
            hoff = np.sort(np.concatenate([s2.offsets, s2.offsets[:-1] + c2 // 2]))
            halves = batching.finalize_padded(s2.samples, hoff, lengths, shape, budget, False)
            cand.update(half_count=np.diff(hoff), half_seqlen=halves.seqlen, half_batch=halves.batch_size,
                        half_tokens=halves.tokens, half_lost=np.diff(hoff))
            if complete:
                cand.update(lengths=lengths[s2.samples], offsets=s2.offsets)
        units = {"count": np.diff(sub.offsets), "seqlen": sub.seqlen, "batch": sub.batch_size,
                 "tokens": sub.tokens, "lost": np.diff(sub.offsets)}
        tables.append(dataclasses.make_dataclass("T", ["units", "offsets", "candidates", "count"])(
            units, sub.offsets, cand, b - a))
    from varlen_cli.plan.chunked.epoch import _concat

    units, start = _concat(tables, ("count", "seqlen", "batch", "tokens", "lost"))

    def pieces(lengths_, off, extras):
        mb = batching.finalize_padded(np.arange(len(lengths_)), off, lengths_, shape, budget, False)
        return {"count": np.diff(off), "seqlen": mb.seqlen, "batch": mb.batch_size, "tokens": mb.tokens,
                "lost": np.diff(off)}

    fix = tail.fix(units.cols["count"], tables, start, slots, slots, 1, "split", pieces)
    assert not len(fix.dropped)
    units.apply(fix)
    seq = units.ids(np.arange(len(units)))
    chunk_first = np.concatenate([[0], np.cumsum([len(t.offsets) - 1 for t in tables])])
    first_item = offsets[chunk_first[units.take("chunk", seq).astype(np.int64)]] + units.take("item_lo", seq)
    assert np.array_equal(first_item, want.offsets[:-1])
    assert np.array_equal(units.take("count", seq), np.diff(want.offsets))
    assert np.array_equal(units.take("tokens", seq), want.tokens)
    assert np.array_equal(units.take("seqlen", seq), want.seqlen)


# -- workers ------------------------------------------------------------------------------------------
ENV = dict(os.environ, VARLEN_NO_PROGRESS="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "varlen_cli", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=300)


@pytest.fixture
def small_segments(monkeypatch):
    """Row groups of 8 rows and segments of 3 row groups in this process and its --nproc workers (forked:
    they inherit the module constants), so that a small plan is written in several segments; layout
    blocks of 16 rows and bucket-shuffle windows of 2 steps, so that the workers share each epoch's
    layout in several blocks."""
    from varlen_cli.plan import writer
    from varlen_cli.plan.chunked import epoch, segments
    from varlen_cli.runtime import dist

    monkeypatch.setenv("VARLEN_START_METHOD", "fork")
    monkeypatch.setattr(dist, "available_cores", lambda: 8)  # --nproc 4 is 4 workers on a 2-core machine too
    monkeypatch.setattr(writer, "ROW_GROUP_TARGET", 8)
    monkeypatch.setattr(segments, "SEGMENT_GROUPS", 3)
    monkeypatch.setattr(epoch, "BLOCK_ROWS", 16)
    monkeypatch.setattr(epoch, "WINDOW_STEPS", 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bucket-shuffle", "curriculum", "random", "random, same shape",
                                  "static shapes, warm-up", "packed, attention cost",
                                  "packed, rows per microbatch"])  # padded, runs, packed, R > 1 rows
def test_same_plan_for_1_2_and_4_workers(dirs, tmp_path, name, small_segments):
    """The plan is a function of the chunks: --nproc 1, 2 and 4 write the same rows and metadata, the
    workers each laying out a share of every epoch (rank 0 joining the shares), writing some of the
    plan's segments (rank 0 joining them) and checking them."""
    from varlen_cli.plan.chunked import epoch

    options = CASES[name]
    outs = []
    for nproc in (1, 2, 4):
        out = tmp_path / f"p{nproc}.parquet"
        r = plan(_config(dirs, out, options, chunk_samples=CHUNK, nproc=nproc))
        rows = pq.ParquetFile(out).metadata.num_row_groups
        assert r.write_segments == (0 if nproc == 1 else -(-rows // 3)) and rows > 6
        outs.append(out)
    assert _same_plan(outs[0], outs[1]) and _same_plan(outs[0], outs[2])
    # with these block sizes both of 2 workers had rows of each epoch to lay out (but a warm-up's
    # epoch, or --same-shape-per-step rewriting a random order's units, which rank 0 lays out whole)
    slots = options.get("dp", 1) * options.get("grad_accum", 1)
    whole = bool(options.get("compile_warmup") or options.get("same_shape_per_step") and "packing" not in options)
    windows = options.get("order", "bucket-shuffle") == "bucket-shuffle" and "packing" not in options
    per_epoch = r.num_microbatches // options.get("epochs", 1)
    shared = [hi - lo for lo, hi in epoch.shares(per_epoch, epoch.split_block(slots, per_epoch, whole, windows), 2)]
    assert (min(shared) > 0) == (not whole)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bucket-shuffle", "packed, rows per microbatch"])
def test_rank_0_lays_out_alone_when_the_workers_could_not_hold_the_tables(dirs, tmp_path, name, small_segments,
                                                                        monkeypatch):
    """A shared layout holds an epoch's unit table on every worker; where a node's workers could not all
    hold one in the memory free, rank 0 lays the epochs out alone: the same plan, one table in memory."""
    from varlen_cli.plan.chunked import run

    options = CASES[name]
    paths = [tmp_path / f"p{i}.parquet" for i in range(3)]
    one = plan(_config(dirs, paths[0], options, chunk_samples=CHUNK))
    shared = plan(_config(dirs, paths[1], options, chunk_samples=CHUNK, nproc=2))
    monkeypatch.setattr(run, "SHARED_LAYOUT_MEMORY", 1e-12)  # inherited by the forked workers
    alone = plan(_config(dirs, paths[2], options, chunk_samples=CHUNK, nproc=2))
    assert (one.layout_shared, shared.layout_shared, alone.layout_shared) == (False, True, False)
    assert alone.write_segments == shared.write_segments > 1  # the write is shared either way
    assert _same_plan(paths[0], paths[1]) and _same_plan(paths[0], paths[2])


def _interleaving(per_chunk, seed: int, block: int, lo: int = 0, hi: int | None = None):
    from varlen_cli.plan.chunked import epoch

    was, epoch.BLOCK_ROWS = epoch.BLOCK_ROWS, block
    try:
        parts = list(epoch.interleave(np.array(per_chunk), np.random.default_rng(seed), lo, hi))
    finally:
        epoch.BLOCK_ROWS = was
    if not parts:
        return [], []
    assert parts[0][0] == lo and all(a[0] + len(a[1]) == b[0] for a, b in zip(parts, parts[1:]))
    return np.concatenate([p[1] for p in parts]).tolist(), np.concatenate([p[2] for p in parts]).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=5), st.integers(1, 30), st.integers(0, 2**32), st.data())
def test_interleaving_any_range_is_the_whole_ones(per_chunk, block, seed, data):
    """The interleaving takes every chunk's units once, in their order, and any range of positions (a
    rank's share) gets what the whole interleaving gives those positions."""
    labels, ranks = _interleaving(per_chunk, seed, block)
    assert np.bincount(labels, minlength=len(per_chunk)).tolist() == per_chunk
    for k, n in enumerate(per_chunk):
        assert [r for label, r in zip(labels, ranks) if label == k] == list(range(n))
    lo = data.draw(st.integers(0, sum(per_chunk)))
    hi = data.draw(st.integers(lo, sum(per_chunk)))
    assert _interleaving(per_chunk, seed, block, lo, hi) == (labels[lo:hi], ranks[lo:hi])
    if len(per_chunk) == 1:  # one chunk: its own order, no draws (the single-process planner's)
        assert ranks == list(range(per_chunk[0]))


@pytest.mark.parametrize("block", [1, 2, 3, 100])
def test_interleaving_is_uniform(block):
    """Every arrangement of the labels 0 0 1 1 2 is equally likely (30 of them), however the positions
    are cut into blocks: 6,000 seeds, each arrangement within 5 standard deviations of 200."""
    from collections import Counter

    seen = Counter(tuple(_interleaving([2, 2, 1], seed, block)[0]) for seed in range(6000))
    assert len(seen) == 30
    sd = (6000 * (1 / 30) * (29 / 30)) ** 0.5
    assert all(abs(n - 200) < 5 * sd for n in seen.values()), seen.most_common(3)


def test_layout_shares_are_whole_blocks_covering_the_epoch():
    """Each rank's positions are whole blocks, contiguous, in rank order, covering the epoch once."""
    from varlen_cli.plan.chunked import epoch

    for n, block, world in [(0, 4, 2), (7, 4, 2), (64, 8, 3), (10, 100, 4), (96, 16, 4)]:
        parts = epoch.shares(n, block, world)
        assert len(parts) == world and parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all((lo % block == 0 or lo == n) and (hi % block == 0 or hi == n) for lo, hi in parts)
    assert epoch.split_block(48, 10**9, False, True) % (48 * epoch.WINDOW_STEPS) == 0
    assert epoch.split_block(8, 100, True, False) == 100  # a warm-up looks across the epoch


@pytest.mark.slow
def test_workers_refuse_a_plan_failing_its_merged_check(dirs, tmp_path, small_segments, monkeypatch):
    """The workers' checks of their segments, merged on rank 0, refuse a plan as one check would: the
    check counting one loss token more per entry fails the plan, and the old plan stays."""
    from varlen_cli import format
    from varlen_cli.errors import WorkerError

    out = tmp_path / "p.parquet"
    options = dict(CASES["bucket-shuffle"], epochs=1)
    plan(_config(dirs, out, options, chunk_samples=CHUNK))
    before = out.read_bytes()
    real = format.loss_targets
    monkeypatch.setattr(format, "loss_targets", lambda length, final=None, target=None:
                        real(length, final, target) + 1)
    with pytest.raises(WorkerError, match="InternalConsistencyError: the plan fails its own check: loss tokens"):
        plan(_config(dirs, out, options, chunk_samples=CHUNK, nproc=2))
    assert out.read_bytes() == before


@pytest.mark.slow
def test_a_workers_segment_error_fails_the_job(dirs, tmp_path, small_segments, monkeypatch):
    """Rank 1 failing to write a segment (a full disk, here injected): every rank raises its error, the
    old plan stays and nothing is left beside it."""
    from varlen_cli.errors import OutputError
    from varlen_cli.plan.chunked import emit
    from varlen_cli.runtime import safety

    out = tmp_path / "p.parquet"
    options = dict(CASES["bucket-shuffle"], epochs=1)
    plan(_config(dirs, out, options, chunk_samples=CHUNK))
    before = out.read_bytes()
    real = emit.write_groups

    def failing(path, tmp_path_, *args):
        if os.environ.get("RANK") == "1":
            raise OutputError(f"cannot write {path}: No space left on device")
        return real(path, tmp_path_, *args)

    monkeypatch.setattr(emit, "write_groups", failing)
    with pytest.raises(OutputError, match="No space left on device"):
        plan(_config(dirs, out, options, chunk_samples=CHUNK, nproc=2))
    assert out.read_bytes() == before
    tags = (safety.TMP_TAG, safety.OLD_TAG, safety.LOCK_TAG)
    assert [n for n in os.listdir(tmp_path) if any(t in n for t in tags)] == []


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["layout", "specs"])
def test_a_workers_phase2_error_fails_the_job(dirs, tmp_path, small_segments, monkeypatch, phase):
    """Rank 1 failing to write its share of the layout, or rank 0 failing while it publishes the
    segments' specs (rank 1 already writing segments): every rank raises the error, the old plan stays
    and nothing is left beside it."""
    from varlen_cli.errors import OutputError
    from varlen_cli.plan.chunked import emit, spill
    from varlen_cli.runtime import safety

    out = tmp_path / "p.parquet"
    options = dict(CASES["bucket-shuffle"], epochs=1)
    plan(_config(dirs, out, options, chunk_samples=CHUNK))
    before = out.read_bytes()
    if phase == "layout":
        real_part = spill.write_order_part

        def failing(directory, e, rank, values, tally):
            if rank == 1:
                raise OutputError(f"cannot write the plan's temporary files in {directory}: No space left on device")
            return real_part(directory, e, rank, values, tally)
        monkeypatch.setattr(spill, "write_order_part", failing)
    else:
        real_specs, calls = emit.row_specs, []

        def failing(*args):
            calls.append(1)
            if len(calls) > 4:  # after a segment's spec: rank 1 has started writing
                raise OutputError("cannot write the plan's temporary files: No space left on device")
            return real_specs(*args)
        monkeypatch.setattr(emit, "row_specs", failing)
    with pytest.raises(OutputError, match="No space left on device"):
        plan(_config(dirs, out, options, chunk_samples=CHUNK, nproc=2))
    assert out.read_bytes() == before
    tags = (safety.TMP_TAG, safety.OLD_TAG, safety.LOCK_TAG)
    assert [n for n in os.listdir(tmp_path) if any(t in n for t in tags)] == []


@pytest.mark.slow
def test_killed_worker_fails_the_job_and_keeps_the_old_plan(dirs, tmp_path):
    """A worker killed while forming its chunks: the job fails (exit 5), the previous plan is intact and
    nothing is left beside it; the same with rank 1 killed in its share of the layout, rank 0 killed
    while it publishes the segments' specs, a worker killed as it writes its segments, and rank 0
    killed before it commits."""
    from varlen_cli.runtime import safety

    out = tmp_path / "p.parquet"
    args = ["plan", dirs["metrics"], "-o", str(out), "--max-tokens", "4096", "--dp", "2",
            "--chunk-samples", str(CHUNK), "--overwrite"]
    assert _cli(*args).returncode == 0
    before = out.read_bytes()
    for fault in ("plan.chunk:1", "plan.layout:1", "plan.specs:0", "plan.segment:1", "plan.write:0"):
        proc = _cli(*args, "--nproc", "2", "--seed", "9", env=dict(ENV, VARLEN_FAULT=fault))
        assert proc.returncode == 5, proc.stderr
        assert "killed by signal 9" in proc.stderr
        assert out.read_bytes() == before
        tags = (safety.TMP_TAG, safety.OLD_TAG, safety.LOCK_TAG)
        assert [n for n in os.listdir(tmp_path) if any(t in n for t in tags)] == []
