"""The report as one self-contained HTML page: inline CSS, inline SVG plots, tables of the summary,
config and provenance, and ``varlen inspect``'s data as an inline JSON block (``<script
type="application/json" id="varlen-inspect">``, data only: the page runs no script). It links to,
loads and fetches nothing, so it opens offline in any browser.
"""

from __future__ import annotations

import json
import math
from html import escape

from .. import __version__, format
from ..runtime.text import fmt

STYLE = """
body{font-family:sans-serif;color:#222;background:#fff;margin:24px auto;max-width:820px;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:16px;margin:0 0 4px}.sub{color:#666;margin:0 0 20px}
figure{margin:0 0 28px;padding:0}.caption{color:#555;font-size:13px;margin:0 0 8px}
table{border-collapse:collapse;font-size:12px;margin:0 0 16px;width:100%}
td,th{border-bottom:1px solid #eee;padding:3px 6px;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}th{color:#444}
.cols{display:flex;gap:24px}.cols>div{flex:1}code{font-size:12px}
"""
SUMMARY_KEYS = ("steps", "microbatches", "samples", "tokens", "padded_tokens", "padding_pct", "budget_fill_pct",
                "mean_samples_per_microbatch", "straggler_mean", "straggler_max", "straggler_overhead",
                "distinct_shapes", "lr_scale_min", "lr_scale_max", "dropped", "epochs", "warmup_steps")
LAYOUT_KEYS = ("varlen_version", "dp", "grad_accum", "epochs", "num_steps", "num_microbatches", "steps_per_epoch",
               "orders", "warmup_steps", "base_batch_size", "lr_scaling", "lr_scale_by")
IDS_SHOWN = 20  # dropped sample ids listed


def clean(value):
    """``value`` with NaN and infinities as None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def data_block(info: dict) -> str:
    """``info`` as the page's inline JSON, every ``<`` written ``\\u003c`` (still the same JSON): no string
    can end the block, nor change where it ends (``<!--<script>`` would, with only ``</`` escaped)."""
    text = json.dumps(clean(info), default=str, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c")


def _cell(value, numbers_right: bool) -> str:
    if isinstance(value, (dict, list)):
        text = json.dumps(clean(value), default=str)
        return f"<td><code>{escape(text if len(text) <= 400 else text[:400] + ' ...')}</code></td>"
    numeric = numbers_right and isinstance(value, (int, float)) and not isinstance(value, bool)
    return f'<td class="num">{escape(fmt(value))}</td>' if numeric else f"<td>{escape(fmt(value))}</td>"


def table(rows, title: str | None = None, table_id: str | None = None, numbers_right: bool = False) -> str:
    """Rows of ``(key, value)`` as an HTML table (``numbers_right``: numbers in a right-aligned column)."""
    head = f"<h2>{escape(title)}</h2>" if title else ""
    ident = f' id="{table_id}"' if table_id else ""
    body = "".join(f"<tr><th>{escape(str(k))}</th>{_cell(v, numbers_right)}</tr>" for k, v in rows)
    return f"{head}<table{ident}>{body}</table>"


def _provenance_rows(info: dict) -> list:
    meta = info["metadata"]
    inp = meta.get("input") or {}
    rows = [("plan", info["path"])] + [(k, meta.get(k)) for k in LAYOUT_KEYS if k in meta]
    rows += [(f"input.{k}", v) for k, v in inp.items()]
    rows += [(f"budget.{k}", v) for k, v in (meta.get("budget") or {}).items()]
    for key in ("packing", "lineage", "chunks", "shape_map", "schedule"):
        rows += [(f"{key}.{k}", v) for k, v in (meta.get(key) or {}).items()]
    metrics = info.get("metrics")
    if metrics:
        rows += [("metrics.path", metrics["path"]), ("metrics.kind", metrics["kind"])]
    return rows


def _dropped_rows(meta: dict) -> list:
    dropped = meta.get("dropped") or {}
    rows = [("count", int(dropped.get("count", 0) or 0))]
    rows += [(f"reason.{k}", v) for k, v in (dropped.get("reason") or {}).items()]
    ids = dropped.get("sample_ids") or []
    if ids:
        more = f" ... ({len(ids):,} in all)" if len(ids) > IDS_SHOWN else ""
        rows.append(("sample ids", ", ".join(map(str, ids[:IDS_SHOWN])) + more))
    if dropped.get("too_long_listed") is False:
        rows.append(("too long (counted, not listed)", f"{dropped.get('too_long_count')} a epoch, longer than "
                                                       f"{dropped.get('too_long_over')}"))
    return rows


def _mixture_rows(meta: dict) -> list:
    sources = (meta.get("mixture") or {}).get("sources") or []
    return [(s["name"], {"weight": s["weight"], "samples_per_epoch": s.get("samples_per_epoch"),
                         "tokens_per_epoch": s.get("tokens_per_epoch"), "path": s.get("path")}) for s in sources]


def _figure(fig) -> str:
    return (f'<figure id="fig-{fig.id}" class="plot"><h2>{escape(fig.title)}</h2>'
            f'<p class="caption">{escape(fig.caption)}</p>{fig.canvas.svg()}</figure>')


def html_page(info: dict, figs: list) -> str:
    """The whole page for a plan's ``info`` (:func:`~varlen_cli.inspect.inspect_artifact`) and its plots."""
    meta = info["metadata"]
    stats = meta.get("stats") or {}
    name = info["path"].rstrip("/").rsplit("/", 1)[-1]
    sub = (f"{fmt(meta.get('num_steps'))} steps, dp {meta.get('dp')} x grad_accum {meta.get('grad_accum')}, "
           f"{fmt(meta.get('epochs'))} epoch(s); {escape(info['path'])}")
    config = [(f"config.{k}", v) for k, v in (meta.get("config") or {}).items()]
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta name="generator" content="{format.REPORT_GENERATOR} {escape(__version__)}">',
        f"<title>varlen report: {escape(name)}</title><style>{STYLE}</style></head><body>",
        f'<h1>varlen report: {escape(name)}</h1><p class="sub">{sub}</p>',
        table([(k, stats[k]) for k in SUMMARY_KEYS if k in stats], "Summary", "summary", numbers_right=True),
        *(_figure(f) for f in figs),
        '<figure id="fig-config" class="tables"><h2>Config and provenance</h2><p class="caption">What made this '
        'plan: check the budget, the layout and the input before trusting the plots.</p>',
        table(_provenance_rows(info), None, "provenance"),
        table(_mixture_rows(meta), "Mixture sources", "mixture") if meta.get("mixture") else "",
        table(_dropped_rows(meta), "Dropped", "dropped"), table(config, "Plan config", "config"), "</figure>",
        f'<script type="application/json" id="varlen-inspect">{data_block(info)}</script>', "</body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"
