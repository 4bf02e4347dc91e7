"""Which plots a plan's report shows, each with a one-line caption of what to look for, drawn from
``varlen inspect``'s data (:func:`varlen_cli.inspect.inspect_artifact`): the report computes nothing
of its own, so its numbers are ``varlen inspect --json``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..runtime.text import fmt
from .canvas import Canvas
from .charts import PALETTE, Series, bar_chart, hbar_chart, heat_chart, note_chart, series_chart, stacked_chart

SHAPES_SHOWN = 30  # rows of the shapes chart (the rest are summed in the caption)
CURRICULUM_ORDERS = ("curriculum", "reverse")


@dataclass(frozen=True)
class Figure:
    """One plot: ``id`` names it in the page (``<figure id="fig-ID">``), ``caption`` says what to look for."""

    id: str
    title: str
    caption: str
    canvas: Canvas


def is_curriculum(meta: dict) -> bool:
    """A plan ordered by difficulty in some epoch (``--order curriculum`` or ``reverse``)."""
    orders = meta.get("orders") or [(meta.get("config") or {}).get("order")]
    return any(o in CURRICULUM_ORDERS for o in orders)


def figure_ids(meta: dict) -> list[str]:
    """The plots a report of a plan with this metadata shows, in page order."""
    ids = ["lengths", "tokens", "padding", "samples", "lr_scale", "straggler", "rank_cost", "shapes"]
    ids += ["row_fill"] if meta.get("packing") else []
    ids += ["difficulty"] if is_curriculum(meta) else []
    ids += ["sources"] if meta.get("mixture") else []
    return ids + ["dropped"]


def figures(info: dict) -> list[Figure]:
    """The report's plots of ``info`` (a plan's :func:`~varlen_cli.inspect.inspect_artifact`)."""
    meta, series = info["metadata"], info["series"]
    out = []
    for fid in figure_ids(meta):
        title, caption, draw = _FIGURES[fid]
        if fid not in ("lengths", "dropped") and not series.get("steps"):
            canvas = note_chart(title, "the plan has no steps")
        else:
            canvas = draw(info, title)
        out.append(Figure(fid, title, caption(info) if callable(caption) else caption, canvas))
    return out


# -- the plots ------------------------------------------------------------------------------------------
def _bin_name(k: int) -> str:
    return "0" if k == 0 else f"{1 << (k - 1):,}" if k < 11 else f"{(1 << (k - 1)) // 1024:,}k"


def _metrics_histogram(info: dict) -> list | None:
    """The metrics' log2 length histogram (``--metrics``; None without, or in a manifest without one)."""
    stats = (info.get("metrics") or {}).get("stats") or {}
    return ((stats.get("length") or {}).get("histogram") or {}).get("log2_bins")


def _lengths_source(info: dict) -> tuple[list, str]:
    bins = _metrics_histogram(info)
    if bins is not None:
        return bins, "samples"
    hist = info["series"].get("length_histogram") or {"log2_bins": [], "of": "seqlen"}
    return hist["log2_bins"], "entries" if hist["of"] == "sample_lengths" else "samples"


def _budget_line(meta: dict) -> tuple[float, str] | None:
    """Where the budget cuts the length axis: a packed row's T, else the token budget."""
    packing = meta.get("packing") or {}
    limit, what = packing.get("seq_len"), "row length T"
    if not limit:
        limit, what = (meta.get("budget") or {}).get("max_tokens"), "budget --max-tokens"
    if not limit or limit <= 0:
        return None
    k = math.floor(math.log2(limit)) + 1  # bin k holds [2^(k-1), 2^k)
    return k + (math.log2(limit) - (k - 1)), f"{what} {int(limit):,}"


def _draw_lengths(info: dict, title: str) -> Canvas:
    bins, unit = _lengths_source(info)
    marker = _budget_line(info["metadata"])
    if marker is not None:  # empty bins up to the budget's, so the line is on the axis
        bins = list(bins) + [0] * max(0, math.ceil(marker[0]) - len(bins))
    return bar_chart(title, [_bin_name(k) for k in range(len(bins))], bins, unit,
                     "length (log2 bins: each bar from its label to twice that)", marker)


def _lengths_caption(info: dict) -> str:
    if _metrics_histogram(info) is not None:
        return ("How long the samples are (the metrics' histogram) and where the budget cuts: samples right of the "
                "red line fit no microbatch (dropped, or split with --split-long).")
    if info["series"].get("length_histogram", {}).get("of") == "sample_lengths":
        return ("Lengths of the packed entries (a split sample once per chunk): entries right of the red line cannot "
                "be packed whole.")
    return ("Samples by the padded length T of their microbatch (pass --metrics for their own lengths): much mass far "
            "below the budget means many short samples per microbatch.")


def _bucket_series(entry: dict, label: str, color: str) -> Series:
    b = entry["buckets"]
    return Series(label, b["mean"], b["min"], b["max"], color)


def _draw_tokens(info: dict, title: str) -> Canvas:
    s = info["series"]
    return series_chart(title, s["bucket_edges"], [_bucket_series(s["padded_tokens_per_step"], "padded", PALETTE[1]),
                                                   _bucket_series(s["tokens_per_step"], "real", PALETTE[0])],
                        "tokens per step", floor=0.0)


def _draw_padding(info: dict, title: str) -> Canvas:
    s, stats = info["series"], info["metadata"].get("stats") or {}
    refs = ((stats["padding_pct"], f"plan: {stats['padding_pct']:.2f} %"),) if "padding_pct" in stats else ()
    return series_chart(title, s["bucket_edges"], [_bucket_series(s["padding_pct"], "padding %", PALETTE[3])],
                        "padding % of the step's padded tokens", refs=refs, floor=0.0)


def _draw_samples(info: dict, title: str) -> Canvas:
    s = info["series"]
    return series_chart(title, s["bucket_edges"], [_bucket_series(s["samples_per_step"], "samples", PALETTE[2])],
                        "samples per step", floor=0.0)


def _draw_lr(info: dict, title: str) -> Canvas:
    s = info["series"]
    return series_chart(title, s["bucket_edges"], [_bucket_series(s["lr_scale"], "lr_scale", PALETTE[4])],
                        "lr_scale (multiplies the base LR)", refs=((1.0, "1.0"),))


def _draw_straggler(info: dict, title: str) -> Canvas:
    s = info["series"]
    return series_chart(title, s["bucket_edges"], [_bucket_series(s["straggler"], "busiest / mean", PALETTE[3])],
                        "busiest rank's cost / mean rank's", refs=((1.0, "balanced"),))


def _straggler_caption(info: dict) -> str:
    s = info["series"]
    return (f"Every rank waits for the busiest each step, so time lost is about this minus 1: mean "
            f"{s.get('straggler_mean', float('nan')):.3f}, worst {s.get('straggler_max', float('nan')):.3f}, "
            f"overhead {100 * s.get('straggler_overhead', 0.0):.2f} % of the balanced time.")


def _draw_rank_cost(info: dict, title: str) -> Canvas:
    heat = info["series"]["rank_cost_heat"]
    spread = max((abs(v - 1.0) for row in heat["ratio"] for v in row if v is not None and math.isfinite(v)),
                 default=0.0)
    names = [f"rank {a}" if a == b else f"ranks {a}-{b}" for a, b in heat["rows"]]
    return heat_chart(title, heat["bucket_edges"], heat["ratio"], names, min(max(spread, 0.02), 0.5))


def _draw_shapes(info: dict, title: str) -> Canvas:
    top = info["series"]["shapes"]["top"][:SHAPES_SHOWN]
    return hbar_chart(title, [f"{b:,} x {t:,}" for b, t, _ in top], [n for _, _, n in top],
                      "microbatches (B x T: padded rows x length)")


def _shapes_caption(info: dict) -> str:
    shapes = info["series"]["shapes"]
    shown = min(SHAPES_SHOWN, len(shapes["top"]))
    rest = shapes["microbatches"] - sum(n for _, _, n in shapes["top"][:shown])
    more = f"; {shapes['distinct'] - shown:,} more with {rest:,} microbatches" if shapes["distinct"] > shown else ""
    return (f"{shapes['distinct']:,} distinct shapes{more}: few shapes help torch.compile and CUDA graphs "
            "(--num-shapes, --static-shapes).")


def _draw_row_fill(info: dict, title: str) -> Canvas:
    bins = info["series"]["row_fill"]["bins"]
    width = 100 // len(bins)
    return bar_chart(title, [f"{k * width}%" for k in range(len(bins))], bins, "packed rows",
                     "real tokens / row length T (bins of 5 %)", color=PALETTE[2])


def _draw_difficulty(info: dict, title: str) -> Canvas:
    s = info["series"]
    if "difficulty" in s:
        return series_chart(title, s["bucket_edges"], [_bucket_series(s["difficulty"], "difficulty", PALETTE[5])],
                            "difficulty of the step's samples")
    return series_chart(title, s["bucket_edges"], [_bucket_series(s["mean_sample_length"], "tokens / sample",
                                                                  PALETTE[5])],
                        "mean sample length (tokens / samples)", floor=0.0)


def _difficulty_caption(info: dict) -> str:
    where = ("the samples' difficulty from --metrics" if "difficulty" in info["series"] else
             "mean sample length of each step (pass --metrics for the difficulty itself)")
    skipped = (info.get("metrics") or {}).get("difficulty_skipped")
    return (f"Curriculum order: this should rise over each epoch (fall for --order reverse); shown: {where}"
            + (f" ({skipped})" if skipped else "") + ".")


def _draw_sources(info: dict, title: str) -> Canvas:
    shares = info["series"]["source_shares"]
    return stacked_chart(title, info["series"]["bucket_edges"], shares["buckets"], shares["sources"])


def _sources_caption(info: dict) -> str:
    weights = ", ".join(f"{s['name']} {s['weight']:g}" for s in info["metadata"]["mixture"]["sources"])
    return (f"Each source's share of the samples of the steps: flat bands mean the weights ({weights}) hold "
            "throughout training, not only on average.")


def _draw_dropped(info: dict, title: str) -> Canvas:
    dropped = info["metadata"].get("dropped") or {}
    reasons = {k: int(v) for k, v in (dropped.get("reason") or {}).items()}
    if not int(dropped.get("count", 0) or 0):
        return note_chart(title, "no sample dropped: every sample is planned once per epoch")
    names = sorted(reasons)
    return bar_chart(title, [n.replace("_", "-") for n in names], [reasons[n] for n in names], "sample entries",
                     "reason", color=PALETTE[7])


def _dropped_caption(info: dict) -> str:
    dropped = info["metadata"].get("dropped") or {}
    return (f"{fmt(int(dropped.get('count', 0) or 0))} sample entries left out over all epochs: too-long ones fit "
            "no microbatch (raise --max-tokens, or --split-long), the tail did not fill a step (--tail).")


_FIGURES = {
    "lengths": ("Sample lengths", _lengths_caption, _draw_lengths),
    "tokens": ("Real and padded tokens per step", "The gap between the lines is padding; a flat real line means the "
               "same work every step (what a token budget buys).", _draw_tokens),
    "padding": ("Padding per step", "The share of each step's padded tokens that hold no sample; spikes are steps of "
                "badly matched lengths (--num-shapes, --pad-multiple, --packing).", _draw_padding),
    "samples": ("Samples per step", "Under a token budget the sample count follows the lengths: short samples, big "
                "steps; lr_scale follows it with --lr-scale-by samples (by default it follows the loss tokens).",
                _draw_samples),
    "lr_scale": ("lr_scale per step", "The learning-rate multiplier of each step (--lr-scaling, --base-batch-size): a "
                 "jump here is a jump in the effective learning rate.", _draw_lr),
    "straggler": ("Straggler: busiest rank over the mean", _straggler_caption, _draw_straggler),
    "rank_cost": ("Per-rank cost heat strip (ranks x steps)", "Each rank's cost over its step's mean: white is "
                  "balanced, a red row a rank that is always the busiest, blue an idle one.", _draw_rank_cost),
    "shapes": ("Shapes used", _shapes_caption, _draw_shapes),
    "row_fill": ("Packed-row fill", "How full the packed rows are: most should be near 100 %; many empty rows mean "
                 "more rows per microbatch than the samples fill.", _draw_row_fill),
    "difficulty": ("Difficulty over steps", _difficulty_caption, _draw_difficulty),
    "sources": ("Source shares over steps", _sources_caption, _draw_sources),
    "dropped": ("Dropped and too-long samples", _dropped_caption, _draw_dropped),
}
