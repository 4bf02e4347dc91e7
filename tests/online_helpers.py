"""Checks of a :class:`varlen_cli.online.StepPlan` against its inputs, derived from the lengths alone
(never from the planner's own arrays): the guarantees of docs/online.md, one assertion each."""

from __future__ import annotations

import numpy as np

from varlen_cli.online import StepPlan


def entries(plan: StepPlan):
    """(rank, micro, index, start, length) of every entry, one row each."""
    out = []
    for r, micros in enumerate(plan.ranks):
        for m, idx in enumerate(micros):
            for k, i in enumerate(np.asarray(idx).tolist()):
                start = int(plan.entry_starts[r][m][k]) if plan.packed else 0
                length = int(plan.entry_lengths[r][m][k]) if plan.packed else None
                out.append((r, m, i, start, length))
    return out


def check_exactly_once(plan: StepPlan, lengths: np.ndarray) -> None:
    """Every index once; a split sample (packed) as chunks covering its tokens once, in order."""
    got = entries(plan)
    if not plan.packed:
        assert sorted(e[2] for e in got) == list(range(len(lengths)))
        return
    by_index: dict = {}
    for _, _, i, start, length in got:
        by_index.setdefault(i, []).append((start, length))
    assert sorted(by_index) == list(range(len(lengths)))
    for i, chunks in by_index.items():
        chunks.sort()
        pos = 0
        for start, length in chunks:
            assert start == pos and length >= 0
            pos += length
        assert pos == int(lengths[i])
        assert len(chunks) == 1 or all(c[1] > 0 for c in chunks)


def check_budget(plan: StepPlan, lengths: np.ndarray, *, max_tokens=None, seq_len=None, attention_cost=0.0,
                 max_samples=None, pad_multiple=1, max_per_row=None) -> None:
    """Padded: B x T (+ A B T^2) <= max_tokens, B <= max_samples, T a multiple of pad_multiple holding
    every sample; packed: every row <= seq_len, R rows within the budget, <= max_per_row entries a row."""
    for r, micros in enumerate(plan.ranks):
        for m, idx in enumerate(micros):
            b, t = int(plan.batch_sizes[r, m]), int(plan.seqlens[r, m])
            if plan.packed:
                assert t == seq_len
                rows = np.asarray(plan.entry_rows[r][m])
                toks = np.asarray(plan.entry_lengths[r][m])
                assert len(rows) == len(idx) and (rows >= 0).all() and (rows < b).all()
                assert (np.bincount(rows, weights=toks, minlength=b) <= seq_len).all() if len(rows) else True
                if max_per_row is not None and len(rows):
                    assert np.bincount(rows).max() <= max_per_row
                if max_tokens is not None:
                    assert b * t + attention_cost * b * t * t <= max_tokens * (1 + 1e-12)
                assert int(toks.sum()) == int(plan.tokens[r, m])
            else:
                real = lengths[np.asarray(idx, np.int64)]
                assert b >= max(len(idx), 1) and t % pad_multiple == 0
                assert len(real) == 0 or t >= max(int(real.max()), 1)
                assert b * t + attention_cost * b * t * t <= max_tokens * (1 + 1e-12)
                assert max_samples is None or b <= max_samples
                assert int(real.sum()) == int(plan.tokens[r, m])


def check_counts(plan: StepPlan, dp: int, num_microbatches=None, units: int | None = None) -> None:
    """dp ranks of G microbatches each (G = num_microbatches when given); empty microbatches only when
    there are fewer units than microbatches, and counted."""
    g = plan.num_microbatches
    assert len(plan.ranks) == dp and all(len(micros) == g for micros in plan.ranks)
    assert plan.seqlens.shape == plan.batch_sizes.shape == plan.tokens.shape == (dp, g)
    if num_microbatches is not None:
        assert g == num_microbatches
    empty = sum(len(idx) == 0 for micros in plan.ranks for idx in micros)
    assert empty == plan.empty_microbatches
    if units is not None:
        assert empty == max(0, dp * g - units)


def check_groups(plan: StepPlan, groups) -> None:
    """All samples of a group id in one microbatch."""
    where = {}
    for r, m, i, _, _ in entries(plan):
        where.setdefault(groups[i], set()).add((r, m))
    assert all(len(places) == 1 for places in where.values())


def microbatch_cost(plan: StepPlan, r: int, m: int, attention_cost: float) -> float:
    """Padded B*T + A*B*T^2; packed tokens + A*sum(l^2) over its entries."""
    if plan.packed:
        toks = np.asarray(plan.entry_lengths[r][m], np.float64)
        return float(toks.sum() + attention_cost * (toks ** 2).sum())
    b, t = float(plan.batch_sizes[r, m]), float(plan.seqlens[r, m])
    return b * t + attention_cost * b * t * t


def check_balance(plan: StepPlan, attention_cost: float) -> None:
    """The reported cost is the cost model's, and no rank is busier than the least busy by more than
    the costliest microbatch (LPT's bound)."""
    each = np.array([[microbatch_cost(plan, r, m, attention_cost) for m in range(plan.num_microbatches)]
                     for r in range(len(plan.ranks))]).reshape(len(plan.ranks), plan.num_microbatches)
    costs = each.sum(axis=1)
    assert np.allclose(costs, plan.cost, rtol=1e-9, atol=1e-6)
    if each.size:
        assert costs.max() - costs.min() <= each.max() * (1 + 1e-9) + 1e-6


def fingerprint(plan: StepPlan) -> tuple:
    """Everything a plan holds, as plain values (two plans are the same iff these are equal)."""
    nested = [[np.asarray(i).tolist() for i in micros] for micros in plan.ranks]
    extra = [] if not plan.packed else [[[np.asarray(a).tolist() for a in micros] for micros in part]
                                        for part in (plan.entry_starts, plan.entry_lengths, plan.entry_rows)]
    return (nested, plan.seqlens.tolist(), plan.batch_sizes.tolist(), plan.tokens.tolist(), plan.cost.tolist(),
            plan.loss_tokens, plan.lr_scale, plan.num_microbatches, plan.empty_microbatches, extra)
