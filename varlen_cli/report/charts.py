"""The report's chart types, drawn on a :class:`~.canvas.Canvas`: series over the steps with their
min-max band, bar charts (vertical and horizontal), a heat strip and stacked shares. Plain Python
(math only); every chart is :data:`WIDTH` pixels wide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .canvas import Canvas, Line, Polygon, Rect, Text

WIDTH, HEIGHT = 760, 250
LEFT, RIGHT, TOP, BOTTOM = 72, 24, 30, 40  # margins of the plot area
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
AXIS, GRID, INK, MUTED = "#777777", "#e8e8e8", "#222222", "#666666"


@dataclass(frozen=True)
class Series:
    """One line: the mean of each bucket (None: no value), and the min and max band around it."""

    label: str
    mean: list
    low: list | None = None
    high: list | None = None
    color: str = PALETTE[0]


@dataclass(frozen=True)
class Frame:
    """Data ranges mapped to the plot area of a canvas."""

    x0: float
    x1: float
    y0: float
    y1: float
    left: float = LEFT
    top: float = TOP
    right: float = WIDTH - RIGHT
    bottom: float = HEIGHT - BOTTOM

    def x(self, v: float) -> float:
        return self.left + (v - self.x0) / ((self.x1 - self.x0) or 1.0) * (self.right - self.left)

    def y(self, v: float) -> float:
        return self.bottom - (v - self.y0) / ((self.y1 - self.y0) or 1.0) * (self.bottom - self.top)


def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """About ``count`` round values (1, 2, 2.5, 5 x 10^k apart; whole numbers with ``integer``)
    covering ``lo .. hi``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1.0, float(round(step)) if step >= 1 else 1.0)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def tick_label(v: float) -> str:
    """A short number: 1.5k, 12M, 0.95."""
    a = abs(v)
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e4, "k")):
        if a >= scale:
            return f"{v / scale:.4g}{suffix}"
    return f"{v:.4g}"


def value_range(values, floor: float | None = None) -> tuple[float, float]:
    """The range a y axis shows for ``values`` (None and non-finite ignored), from ``floor`` when given."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    lo, hi = (min(kept), max(kept)) if kept else (0.0, 1.0)
    if floor is not None:
        lo = min(lo, floor)
    if hi - lo < 1e-12 * max(abs(hi), 1.0):  # a flat series: a band around it
        pad = abs(hi) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
        if floor is not None and lo < floor <= hi - pad:
            lo = floor
    return lo, hi


def axes(c: Canvas, f: Frame, y_label: str, x_label: str, x_ticks: list | None = None,
         y_integer: bool = False) -> None:
    """Grid lines, axes, tick labels and the axis titles of frame ``f`` (``y_integer``: counts)."""
    for v in nice_ticks(f.y0, f.y1, integer=y_integer):
        y = f.y(v)
        c.add(Line(((f.left, y), (f.right, y)), GRID, 1))
        c.add(Text(f.left - 6, y + 4, tick_label(v), 10, "end", MUTED))
    for v in nice_ticks(f.x0, f.x1, 8, integer=True) if x_ticks is None else x_ticks:
        x = f.x(v)
        c.add(Line(((x, f.bottom), (x, f.bottom + 4)), AXIS, 1))
        c.add(Text(x, f.bottom + 16, tick_label(v), 10, "middle", MUTED))
    c.add(Line(((f.left, f.top), (f.left, f.bottom), (f.right, f.bottom)), AXIS, 1))
    c.add(Text(f.left, f.top - 10, y_label, 11, "start", INK, bold=True))
    c.add(Text((f.left + f.right) / 2, f.bottom + 32, x_label, 11, "middle", MUTED))


def legend(c: Canvas, entries: list[tuple[str, str]]) -> None:
    """Colored squares and labels, right-aligned above the plot area."""
    x = c.width - RIGHT
    for label, color in reversed(entries):
        width = 7 * len(label) + 18
        x -= width
        c.add(Rect(x, TOP - 19, 10, 10, color))
        c.add(Text(x + 14, TOP - 10, label, 10, "start", INK))


def _runs(xs: list, *columns) -> list[list[int]]:
    """Index runs where every column has a value (a bucket without one breaks the line)."""
    runs, run = [], []
    for i in range(len(xs)):
        if all(col[i] is not None for col in columns):
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


def series_chart(label: str, edges: list, series: list[Series], y_label: str, x_label: str = "optimizer step",
                 refs: tuple = (), floor: float | None = None) -> Canvas:
    """Lines over the steps: each bucket's mean at the bucket's middle step, its min-max band shaded
    (where a bucket holds several steps); ``refs``: dashed ``(y, label)`` lines."""
    xs = [(edges[i] + edges[i + 1] - 1) / 2 for i in range(len(edges) - 1)]
    values = [v for s in series for col in (s.mean, s.low or [], s.high or []) for v in col]
    lo, hi = value_range(values + [y for y, _ in refs], floor)
    f = Frame(0, max(edges[-1] - 1, 1) if edges else 1, lo, hi)
    c = Canvas(WIDTH, HEIGHT, label)
    axes(c, f, y_label, x_label)
    for s in series:
        if s.low is not None and s.high is not None and any(a != b for a, b in zip(s.low, s.high)):
            for run in _runs(xs, s.low, s.high):
                top = [(f.x(xs[i]), f.y(s.high[i])) for i in run]
                bottom = [(f.x(xs[i]), f.y(s.low[i])) for i in reversed(run)]
                c.add(Polygon(tuple(top + bottom), s.color, 0.22))
        for run in _runs(xs, s.mean):
            points = [(f.x(xs[i]), f.y(s.mean[i])) for i in run]
            c.add(Line(tuple(points if len(points) > 1 else points * 2), s.color, 1.6))
    for y, text in refs:
        c.add(Line(((f.left, f.y(y)), (f.right, f.y(y))), INK, 1, dash=True))
        c.add(Text(f.right - 4, f.y(y) - 4, text, 10, "end", INK))
    if len(series) > 1 or any(s.low is not None for s in series):
        legend(c, [(s.label, s.color) for s in series] + ([("min-max", "#cfcfcf")] if any(
            s.low is not None for s in series) and len(xs) < edges[-1] else []))
    return c


def bar_chart(label: str, names: list[str], values: list[float], y_label: str, x_label: str,
              marker: tuple | None = None, color: str = PALETTE[0]) -> Canvas:
    """Vertical bars (a histogram); ``marker``: ``(position in bars, text)``, a dashed line there
    (0 = the left edge of the first bar)."""
    n = max(len(values), 1)
    f = Frame(0, n, 0, value_range(values, 0.0)[1])
    c = Canvas(WIDTH, HEIGHT, label)
    every = max(1, math.ceil(n / ((f.right - f.left) / 56)))
    axes(c, f, y_label, x_label, x_ticks=[], y_integer=True)
    for i, (name, v) in enumerate(zip(names, values)):
        x0, x1 = f.x(i) + 1, f.x(i + 1) - 1
        c.add(Rect(x0, f.y(v), x1 - x0, f.bottom - f.y(v), color, f"{name}: {v:,.0f}"))
        if i % every == 0:
            c.add(Text((x0 + x1) / 2, f.bottom + 16, name, 10, "middle", MUTED))
    if marker is not None:
        x = f.x(marker[0])
        c.add(Line(((x, f.top), (x, f.bottom)), PALETTE[3], 1.5, dash=True))
        c.add(Text(min(x + 4, f.right - 4), f.top + 12, marker[1], 10, "start" if x + 150 < f.right else "end",
                   PALETTE[3], bold=True))
    return c


def hbar_chart(label: str, names: list[str], values: list[float], x_label: str, color: str = PALETTE[0]) -> Canvas:
    """Horizontal bars, one row each, the value at the bar's end."""
    row = 18
    height = TOP + row * max(len(values), 1) + BOTTOM
    f = Frame(0, value_range(values, 0.0)[1], 0, 1, left=140, right=WIDTH - 80, bottom=height - BOTTOM)
    c = Canvas(WIDTH, height, label)
    for v in nice_ticks(f.x0, f.x1, 6, integer=True):
        c.add(Line(((f.x(v), f.top), (f.x(v), f.bottom)), GRID, 1))
        c.add(Text(f.x(v), f.bottom + 16, tick_label(v), 10, "middle", MUTED))
    c.add(Text((f.left + f.right) / 2, f.bottom + 32, x_label, 11, "middle", MUTED))
    for i, (name, v) in enumerate(zip(names, values)):
        y = f.top + i * row
        c.add(Rect(f.left, y + 3, f.x(v) - f.left, row - 6, color, f"{name}: {v:,.0f}"))
        c.add(Text(f.left - 6, y + row - 5, name, 10, "end", INK))
        c.add(Text(f.x(v) + 4, y + row - 5, f"{v:,.0f}", 10, "start", MUTED))
    c.add(Line(((f.left, f.top), (f.left, f.bottom)), AXIS, 1))
    return c


def heat_color(ratio: float, spread: float) -> str:
    """White at 1.0, blue below (idle ranks), red above (busy ranks), saturated at 1 -/+ ``spread``."""
    t = max(-1.0, min(1.0, (ratio - 1.0) / spread)) if math.isfinite(ratio) else 0.0
    target = (214, 39, 40) if t > 0 else (31, 119, 180)
    r, g, b = (round(255 + (channel - 255) * abs(t)) for channel in target)
    return f"#{r:02x}{g:02x}{b:02x}"


def heat_chart(label: str, edges: list, rows: list[list], row_names: list[str], spread: float) -> Canvas:
    """One row per rank (or group of ranks), one column per bucket of steps, colored by :func:`heat_color`."""
    cell = max(3.0, min(14.0, 180.0 / max(len(rows), 1)))
    height = int(TOP + cell * max(len(rows), 1) + BOTTOM)
    f = Frame(0, max(edges[-1], 1), 0, 1, left=LEFT, bottom=height - BOTTOM)
    c = Canvas(WIDTH, height, label)
    every = max(1, math.ceil(len(rows) * 12 / max(cell * len(rows), 1)))
    for r, (values, name) in enumerate(zip(rows, row_names)):
        y = f.top + r * cell
        for k, v in enumerate(values):
            x0, x1 = f.x(edges[k]), f.x(edges[k + 1])
            c.add(Rect(x0, y, x1 - x0 + 0.3, cell + 0.3, heat_color(v, spread),
                       f"{name}, steps {edges[k]}-{edges[k + 1] - 1}: {v:.3f}"))
        if r % every == 0:
            c.add(Text(f.left - 6, y + min(cell, 12) - 2, name, 9, "end", MUTED))
    for v in nice_ticks(0, max(edges[-1] - 1, 1), 8, integer=True):
        c.add(Text(f.x(v + 0.5), f.bottom + 16, tick_label(v), 10, "middle", MUTED))
    c.add(Text((f.left + f.right) / 2, f.bottom + 32, "optimizer step", 11, "middle", MUTED))
    c.add(Text(f.left, f.top - 10, "rank cost / step mean", 11, "start", INK, bold=True))
    scale = [(f"{1 - spread:.3g}", heat_color(1 - spread, spread)), ("1.0", heat_color(1.0, spread)),
             (f"{1 + spread:.3g}", heat_color(1 + spread, spread))]
    legend(c, scale)
    return c


def stacked_chart(label: str, edges: list, shares: list[list], names: list[str]) -> Canvas:
    """Shares (0..1 per bucket, one list per part) stacked over the steps."""
    xs = [(edges[i] + edges[i + 1] - 1) / 2 for i in range(len(edges) - 1)]
    f = Frame(0, max(edges[-1] - 1, 1), 0, 100)
    c = Canvas(WIDTH, HEIGHT, label)
    axes(c, f, "share of the step's samples (%)", "optimizer step")
    below = [0.0] * len(xs)
    for k, part in enumerate(shares):
        above = [b + 100.0 * v for b, v in zip(below, part)]
        if len(xs) == 1:
            points = [(f.left, f.y(above[0])), (f.right, f.y(above[0])), (f.right, f.y(below[0])),
                      (f.left, f.y(below[0]))]
        else:
            points = [(f.x(x), f.y(v)) for x, v in zip(xs, above)] + \
                     [(f.x(x), f.y(v)) for x, v in zip(reversed(xs), reversed(below))]
        c.add(Polygon(tuple(points), PALETTE[k % len(PALETTE)], 0.85))
        below = above
    legend(c, [(name, PALETTE[k % len(PALETTE)]) for k, name in enumerate(names)])
    return c


def note_chart(label: str, text: str) -> Canvas:
    """A chart that is a sentence (nothing to plot: no sample dropped)."""
    c = Canvas(WIDTH, 70, label)
    c.add(Rect(0, 0, WIDTH, 70, "#f7f7f7"))
    c.add(Text(WIDTH / 2, 40, text, 13, "middle", MUTED))
    return c
