"""What a chart draws, as a list of shapes in pixels (:class:`Canvas`), and its SVG.

The charts of :mod:`.charts` draw on a :class:`Canvas`; :meth:`Canvas.svg` writes it as inline SVG
for the HTML page (no fonts, images or scripts to fetch: the browser draws the text with its own
sans-serif), and :mod:`.png` draws the same shapes with Pillow for ``--format png``. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape


@dataclass(frozen=True)
class Line:
    points: tuple  # ((x, y), ...)
    color: str
    width: float = 1.5
    dash: bool = False


@dataclass(frozen=True)
class Polygon:
    points: tuple
    color: str
    opacity: float = 1.0


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    color: str
    title: str | None = None  # a tooltip (SVG only)


@dataclass(frozen=True)
class Text:
    x: float
    y: float  # the baseline
    text: str
    size: float = 11.0
    anchor: str = "start"  # start, middle or end
    color: str = "#333333"
    bold: bool = False


@dataclass
class Canvas:
    """A chart: ``width`` x ``height`` pixels of shapes, drawn in order."""

    width: int
    height: int
    label: str = ""  # what the chart shows, for screen readers
    shapes: list = field(default_factory=list)

    def add(self, shape) -> None:
        self.shapes.append(shape)

    def svg(self) -> str:
        """The chart as an inline ``<svg>`` element (HTML5: no namespace declaration needed)."""
        body = "".join(_svg_shape(s) for s in self.shapes)
        return (f'<svg viewBox="0 0 {self.width} {self.height}" width="{self.width}" height="{self.height}" '
                f'role="img" aria-label="{escape(self.label)}" font-family="sans-serif">{body}</svg>')


def _xy(points) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in points)


def _svg_shape(s) -> str:
    if isinstance(s, Line):
        dash = ' stroke-dasharray="5 4"' if s.dash else ""
        return (f'<polyline points="{_xy(s.points)}" fill="none" stroke="{s.color}" stroke-width="{s.width:g}"'
                f' stroke-linejoin="round"{dash}/>')
    if isinstance(s, Polygon):
        return f'<polygon points="{_xy(s.points)}" fill="{s.color}" fill-opacity="{s.opacity:g}" stroke="none"/>'
    if isinstance(s, Rect):
        title = f"<title>{escape(s.title)}</title>" if s.title else ""
        return (f'<rect x="{s.x:.1f}" y="{s.y:.1f}" width="{max(s.w, 0):.1f}" height="{max(s.h, 0):.1f}" '
                f'fill="{s.color}">{title}</rect>')
    if isinstance(s, Text):
        weight = ' font-weight="bold"' if s.bold else ""
        return (f'<text x="{s.x:.1f}" y="{s.y:.1f}" font-size="{s.size:g}" text-anchor="{s.anchor}" '
                f'fill="{s.color}"{weight}>{escape(s.text)}</text>')
    raise TypeError(f"not a shape: {s!r}")
