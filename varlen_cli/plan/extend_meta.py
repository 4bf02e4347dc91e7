"""The metadata entries of an extended plan (``varlen plan --extend``) from its two parts': the
parent's, then the new epochs' (numbered after the parent's), as :mod:`.extend_stream` joins them."""

from __future__ import annotations

import numpy as np

from .. import format


def merged_shapes(old: list, new: list) -> tuple[list, np.ndarray]:
    """The parent's shapes with the new plan's appended (those it lacks), and each new shape's id."""
    shapes = [list(s) for s in old]
    index = {tuple(s): i for i, s in enumerate(shapes)}
    for s in new:
        if tuple(s) not in index:
            index[tuple(s)] = len(shapes)
            shapes.append(list(s))
    return shapes, np.array([index[tuple(s)] for s in new], np.int64)


def merged_dropped(old: dict, new: dict, epochs_before: int) -> dict:
    ids = sorted(set(old.get("sample_ids", [])) | set(new.get("sample_ids", [])))
    reasons = {k: int((old.get("reason") or {}).get(k, 0)) + int((new.get("reason") or {}).get(k, 0))
               for k in ("too_long", "tail")}
    tail = list(old.get("tail", [])) + [{**t, "epoch": t["epoch"] + epochs_before} for t in new.get("tail", [])]
    out = {"count": int(old.get("count", 0)) + int(new.get("count", 0)), "reason": reasons, "sample_ids": ids,
           "too_long_ids": old.get("too_long_ids", []), "tail": tail}
    for key in ("too_long_sources", "too_long_listed", "too_long_count", "too_long_over", "too_long_target_over"):
        if key in old:
            out[key] = old[key]
    return out


def merged_packing(old: dict | None, new: dict | None, old_tokens: int, new_tokens: int) -> dict | None:
    if old is None or new is None:
        return old
    rows = old_tokens / old["efficiency"] + new_tokens / new["efficiency"]  # used rows x T
    return {**old, "efficiency": (old_tokens + new_tokens) / rows if rows else 1.0,
            "split_samples": int(old.get("split_samples", 0)) + int(new.get("split_samples", 0)),
            "samples_per_row_max": max(old.get("samples_per_row_max", 0), new.get("samples_per_row_max", 0))}


def merged_mixture(old: dict | None, new: dict | None) -> dict | None:
    if not old or not new:
        return old
    sources = [{**a, "tokens_per_epoch": list(a.get("tokens_per_epoch", [])) + list(b.get("tokens_per_epoch", []))}
               for a, b in zip(old["sources"], new["sources"])]
    return {**old, "sources": sources}


def budget_tokens(meta: dict) -> float:
    """A plan's per-microbatch token budget (padded: ``max_tokens``; packed: rows x seq_len)."""
    budget = format.plan_budget(meta)
    if budget.max_tokens is not None:
        return float(budget.max_tokens)
    return float(meta["packing"]["rows_per_microbatch"] * meta["packing"]["seq_len"])


def merged_metadata(old_meta: dict, new_meta: dict, summary: dict, shapes: list, dropped: dict,
                    packing: dict | None, epochs: int, record: dict, lineage: dict) -> dict:
    """The metadata of the whole: the parent's, with the new epochs' entries appended, ``summary`` (the
    statistics of both parts) and the new ``record`` of options and ``lineage``."""
    meta = {**old_meta, "config": record, "epochs": epochs, "num_steps": summary["steps"],
            "steps_per_epoch": list(old_meta["steps_per_epoch"]) + list(new_meta["steps_per_epoch"]),
            "num_microbatches": summary["microbatches"], "orders": old_meta.get("orders", []) +
            new_meta.get("orders", []), "shapes": shapes, "dropped": dropped, "packing": packing,
            "budget": new_meta["budget"], "stats": {k: v for k, v in summary.items() if k != "seconds"},
            "lineage": lineage}
    meta.pop("created_at", None)  # plans made before their files were a function of input and options
    for key in ("straggler_cost", "cost_model"):  # older plans' copies of the budget: it is in "budget" now
        meta.pop(key, None)
    if old_meta.get("mixture"):
        meta["mixture"] = merged_mixture(old_meta["mixture"], new_meta.get("mixture"))
    meta.pop("schedule", None)  # the schedule report covered the parent's steps only
    return meta
