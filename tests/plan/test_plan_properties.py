"""Property tests (hypothesis) of varlen plan over random lengths and options."""

import os
import tempfile

import numpy as np
import pyarrow.parquet as pq
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.plan_helpers import check_plan, write_metrics
from varlen_cli.errors import InputError
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.plan.shapes import Budget, ShapeMap

SETTINGS = settings(max_examples=int(os.environ.get("PLAN_EXAMPLES", "80")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

lengths_st = st.one_of(
    st.lists(st.integers(0, 400), min_size=1, max_size=300),
    st.lists(st.sampled_from([1, 7, 64, 65, 300, 1000]), min_size=1, max_size=200),
    st.integers(1, 500).flatmap(lambda n: st.just(
        np.clip(np.random.default_rng(n).lognormal(4, 1.2, n).astype(int), 0, 3000).tolist())),
)


@st.composite
def options(draw):
    opts = dict(
        order=draw(st.sampled_from(["curriculum", "reverse", "bucket-shuffle", "random"])),
        dp=draw(st.integers(1, 4)), grad_accum=draw(st.integers(1, 3)),
        max_tokens=draw(st.sampled_from([64, 300, 1024, 4096])),
        pad_multiple=draw(st.sampled_from([1, 1, 8])),
        num_shapes=draw(st.sampled_from([None, None, 1, 2, 3, 5])),
        same_shape_per_step=draw(st.booleans()), compile_warmup=draw(st.booleans()),
        max_samples=draw(st.sampled_from([None, None, 1, 5, 16])),
        attention_cost=draw(st.sampled_from([0.0, 0.0, 0.002])),
        epochs=draw(st.integers(1, 2)), seed=draw(st.integers(0, 3)),
        lr_scaling=draw(st.sampled_from(["linear", "sqrt", "none"])),
        lr_scale_by=draw(st.sampled_from(["loss-tokens", "samples", "tokens"])),
        drop_long=True, tail=draw(st.sampled_from(["split", "drop"])),
    )
    opts["static_shapes"] = opts["num_shapes"] is not None and draw(st.booleans())
    return opts


def _fits(lengths, o):
    b = Budget(o["max_tokens"], o.get("max_samples"), o.get("attention_cost", 0.0))
    return b.cap(ShapeMap(o.get("pad_multiple", 1)).pad(lengths)) >= 1


def _unplannable(n_fit: int, slots: int, tail: str, same_shape: bool) -> tuple[bool, bool]:
    """(must fail, may fail) of a padded plan, from the inputs: with fewer fitting samples than the
    slots of one step nothing can be planned; with at least that many, --tail drop always plans, and
    --tail split (also with --same-shape-per-step) can only fail when the samples do not divide into
    whole steps (n % slots != 0)."""
    if n_fit < slots:
        return True, True
    if tail == "drop":
        return False, False
    return False, n_fit % slots != 0


def _expected_error(msg: str, n_fit: int, slots: int, tail: str) -> bool:
    """The message a plan that cannot be made must give (docs/plan.md, "Tail")."""
    if n_fit == 0:
        return "below every sample" in msg
    if tail == "drop":
        return "are fewer than the" in msg and f"{slots:,} microbatches of one step" in msg
    return "samples cannot fill" in msg and msg.endswith("lower --dp/--grad-accum or pass --tail drop")


RANDOM_LAYOUT = dict(order="random", dp=3, grad_accum=2, max_tokens=1024, pad_multiple=1, num_shapes=None,
                     same_shape_per_step=False, compile_warmup=False, max_samples=None, attention_cost=0.0, epochs=2,
                     seed=1, lr_scaling="linear", lr_scale_by="samples", drop_long=True, tail="split",
                     static_shapes=False)


@SETTINGS
@given(lengths=lengths_st, o=options(), diff_is_length=st.booleans())
# the random order with several ranks and microbatches per rank, always run (not left to the draw)
@example(lengths=list(range(1, 301)), o=RANDOM_LAYOUT, diff_is_length=True)
@example(lengths=list(range(1, 301)), o={**RANDOM_LAYOUT, "tail": "drop", "dp": 4, "grad_accum": 3},
         diff_is_length=True)
@example(lengths=[5, 70, 300, 1000, 9] * 40, o={**RANDOM_LAYOUT, "num_shapes": 3, "static_shapes": True,
                                                 "compile_warmup": True, "attention_cost": 0.002},
         diff_is_length=False)
@example(lengths=list(range(0, 200)), o={**RANDOM_LAYOUT, "dp": 2, "grad_accum": 4, "max_samples": 5,
                                          "lr_scale_by": "tokens", "lr_scaling": "sqrt"}, diff_is_length=True)
def test_padded_plan_properties(lengths, o, diff_is_length):
    L = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng(len(L))
    difficulty = None if diff_is_length else rng.random(len(L)).round(2)
    with tempfile.TemporaryDirectory() as tmp:
        sorted_input = o["order"] in ("curriculum", "reverse")
        src = write_metrics(f"{tmp}/in", L, difficulty, sorted_by=("length" if diff_is_length else "difficulty")
                            if sorted_input else None, parts=2)
        out = f"{tmp}/p.parquet"
        n_fit, slots = int(_fits(L, o).sum()), o["dp"] * o["grad_accum"]
        must_fail, may_fail = _unplannable(n_fit, slots, o["tail"], o["same_shape_per_step"])
        try:
            res = plan(PlanConfig(input=src, output=out, **o))
        except InputError as exc:
            event("input error")
            assert may_fail, str(exc)  # only inputs the predicate allows to fail may fail
            assert _expected_error(str(exc), n_fit, slots, o["tail"]), str(exc)
            return
        assert not must_fail
        d, md = check_plan(out, L, max_tokens=o["max_tokens"], dp=o["dp"], grad_accum=o["grad_accum"],
                           attention_cost=o["attention_cost"], max_samples=o["max_samples"])
        fits = _fits(L, o)
        too_long = set(np.flatnonzero(~fits).tolist())
        assert set(md["dropped"]["too_long_ids"]) == too_long
        tails = {t["epoch"]: set(t["sample_ids"]) for t in md["dropped"]["tail"]}
        for e in range(o["epochs"]):
            ids = [i for ep, row in zip(d["epoch"], d["sample_ids"]) if ep == e for i in row]
            assert len(ids) == len(set(ids))  # exactly once
            assert set(ids) | too_long | tails.get(e, set()) == set(range(len(L)))
            assert not set(ids) & (too_long | tails.get(e, set()))
        if o["tail"] == "split":
            assert not tails
        T = np.array(d["seqlen"])
        B = np.array(d["batch_size"])
        step = np.array(d["step"])
        if o["num_shapes"]:
            assert len(set(T.tolist())) <= o["num_shapes"]
        if o["pad_multiple"] > 1 and not o["num_shapes"]:
            assert (T % o["pad_multiple"] == 0).all()
        if o["same_shape_per_step"]:
            for s in range(md["num_steps"]):
                assert len(set(zip(T[step == s], B[step == s]))) == 1
        if o["static_shapes"]:
            kept = np.setdiff1d(np.arange(len(L)), list(too_long))
            distinct = len(np.unique(ShapeMap(o["pad_multiple"]).pad(L[kept])))
            shapes = {(b, t) for b, t in zip(B.tolist(), T.tolist())}
            assert len({t for _, t in shapes}) == len(shapes)  # one B per T
            if (o["order"] == "bucket-shuffle" or (sorted_input and diff_is_length)) \
                    and not o["same_shape_per_step"] and not tails:
                assert len(shapes) == min(o["num_shapes"], distinct)
        if sorted_input and not o["same_shape_per_step"]:
            # curriculum: steps non-decreasing in difficulty (reverse: non-increasing), after the warm-up
            key = L if diff_is_length else difficulty
            w = md["warmup_steps"]
            for e in range(o["epochs"]):
                lo_hi = []
                for s in sorted(set(step[np.array(d["epoch"]) == e].tolist())):
                    if s < w:
                        continue
                    vals = key[np.concatenate([np.array(r, dtype=np.int64) for r, ss in zip(d["sample_ids"], step)
                                               if ss == s])]
                    lo_hi.append((vals.min(), vals.max()))
                for (lo1, hi1), (lo2, hi2) in zip(lo_hi, lo_hi[1:]):
                    assert (hi1 <= lo2) if o["order"] == "curriculum" else (lo1 >= hi2)
        if o["compile_warmup"] and md["warmup_steps"] and not md["stats"].get("warmup_missing"):
            w = md["warmup_steps"]
            sid = np.array(d["shape_id"])
            ep0 = sid[np.array(d["epoch"]) == 0]
            rank = np.array(d["rank"])
            for r in range(o["dp"]):
                assert set(sid[(step < w) & (rank == r)].tolist()) == set(ep0.tolist())
        assert res.stats["over_budget_microbatches"] == 0
        event(f"planned {o['order']}")


@SETTINGS
@given(lengths=lengths_st, cuts=st.lists(st.floats(0, 1), min_size=3, max_size=3),
       order=st.sampled_from(["curriculum", "reverse", "bucket-shuffle", "random"]), dp=st.integers(1, 3),
       seed=st.integers(0, 5))
def test_same_plan_whether_sorted_by_1_or_4_workers(lengths, cuts, order, dp, seed):
    L = np.asarray(lengths, dtype=np.int64)
    n = len(L)
    split = sorted(int(c * n) for c in cuts)
    with tempfile.TemporaryDirectory() as tmp:
        one = write_metrics(f"{tmp}/one", L, sorted_by="length", parts=1)
        four = write_metrics(f"{tmp}/four", L, sorted_by="length", split_points=split)
        tables = []
        for i, src in enumerate((one, four)):
            try:
                plan(PlanConfig(input=src, output=f"{tmp}/p{i}.parquet", max_tokens=2048, dp=dp, order=order,
                                seed=seed, epochs=2, drop_long=True))
            except InputError:
                tables.append(None)
                continue
            tables.append(pq.read_table(f"{tmp}/p{i}.parquet"))
        assert (tables[0] is None) == (tables[1] is None)
        if tables[0] is not None:
            assert tables[0].equals(tables[1])


@SETTINGS
@given(lengths=st.lists(st.integers(0, 600), min_size=1, max_size=300), seq_len=st.sampled_from([64, 512, 1024]),
       rows=st.integers(1, 3), max_per_row=st.sampled_from([None, 1, 4]), dp=st.integers(1, 3),
       grad_accum=st.integers(1, 2), split_long=st.booleans(),
       order=st.sampled_from(["curriculum", "bucket-shuffle"]))
def test_packed_plan_properties(lengths, seq_len, rows, max_per_row, dp, grad_accum, split_long, order):
    L = np.asarray(lengths, dtype=np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        src = write_metrics(f"{tmp}/in", L, sorted_by="length" if order == "curriculum" else None)
        out = f"{tmp}/p.parquet"
        # the plan's entries: one per fitting sample, or one per chunk of every sample (--split-long)
        entries = int(np.maximum(1, -(-L // seq_len)).sum()) if split_long else int((L <= seq_len).sum())
        try:
            plan(PlanConfig(input=src, output=out, packing=True, seq_len=seq_len, rows_per_microbatch=rows,
                            max_per_row=max_per_row, dp=dp, grad_accum=grad_accum, order=order,
                            split_long=split_long, drop_long=not split_long, tail="drop"))
        except InputError as exc:
            # must fail with fewer entries than the slots of one step (none: below every sample); may
            # fail when the rows do not divide into whole steps and the tail drop takes a split
            # sample whole (never when the entries divide into whole steps)
            slots = dp * grad_accum
            assert entries < slots or entries % slots != 0, str(exc)
            msg = str(exc)
            assert ("below every sample" in msg) if entries == 0 else (
                f"packed samples are fewer than the {slots:,} microbatches" in msg
                or msg.endswith("lower --dp/--grad-accum or pass --tail drop")), msg
            return
        assert entries >= dp * grad_accum
        d, md = check_plan(out, L, dp=dp, grad_accum=grad_accum, packed=True)
        dropped = set(md["dropped"]["sample_ids"])
        tokens = {}
        for ids, starts, lens, rws in zip(d["sample_ids"], d["sample_starts"], d["sample_lengths"], d["sample_rows"]):
            if max_per_row:
                assert np.bincount(rws).max() <= max_per_row
            for i, s, n in zip(ids, starts, lens):
                tokens.setdefault(i, []).append((s, n))
        assert set(tokens) | dropped == set(range(len(L))) and not set(tokens) & dropped
        for i, segs in tokens.items():
            segs.sort()
            if not split_long:
                assert segs == [(0, L[i])]
            assert segs[0][0] == 0 and sum(n for _, n in segs) == L[i]
            assert all(a + n == b for (a, n), (b, _) in zip(segs, segs[1:]))
        assert md["shapes"] == [[rows, seq_len]]
