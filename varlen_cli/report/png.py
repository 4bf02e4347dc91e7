"""``varlen report --format png``: every plot of the page in one image, drawn with Pillow (the
``varlen-cli[report]`` extra) from the same shapes as the SVG (:mod:`.canvas`), at twice the size
and then scaled down (smooth lines without an anti-aliasing renderer).
"""

from __future__ import annotations

import io
import textwrap

from .. import __version__, format
from ..errors import UsageError
from ..runtime.text import fmt
from .canvas import Canvas, Line, Polygon, Rect, Text

SCALE = 2  # drawn at twice the size, then scaled down
MARGIN = 20
CAPTION_CHARS = 118  # a caption line's width in characters


def pillow():
    """PIL's modules (``Image``, ``ImageDraw``, ``ImageFont``, ``PngImagePlugin``); a one-line error
    naming the extra when Pillow is missing."""
    try:
        from PIL import Image, ImageDraw, ImageFont, PngImagePlugin
    except ImportError:
        raise UsageError("--format png needs Pillow: pip install 'varlen-cli[report]' (the HTML report needs "
                         "nothing more)") from None
    return Image, ImageDraw, ImageFont, PngImagePlugin


def _rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


class _Painter:
    """Draws canvases onto one Pillow image at :data:`SCALE`."""

    def __init__(self, width: int, height: int):
        image, draw, self.font_module, _ = pillow()
        self.image = image.new("RGBA", (width * SCALE, height * SCALE), (255, 255, 255, 255))
        self.draw_module, self.image_module = draw, image
        self.draw = draw.Draw(self.image)
        self.fonts: dict = {}

    def font(self, size: float):
        key = round(size * SCALE)
        if key not in self.fonts:
            self.fonts[key] = self.font_module.load_default(size=key)
        return self.fonts[key]

    def text(self, x: float, y: float, text: str, size: float = 11, anchor: str = "start", color: str = "#222222",
             bold: bool = False) -> None:
        where = {"start": "ls", "middle": "ms", "end": "rs"}[anchor]
        self.draw.text((x * SCALE, y * SCALE), text, fill=_rgb(color), font=self.font(size), anchor=where,
                       stroke_width=1 if bold else 0, stroke_fill=_rgb(color))

    def canvas(self, c: Canvas, dx: float, dy: float) -> None:
        def at(x, y):
            return ((x + dx) * SCALE, (y + dy) * SCALE)

        for s in c.shapes:
            if isinstance(s, Rect):
                x0, y0 = at(s.x, s.y)
                self.draw.rectangle((x0, y0, x0 + max(s.w, 0) * SCALE, y0 + max(s.h, 0) * SCALE), fill=_rgb(s.color))
            elif isinstance(s, Polygon):
                self._polygon([at(x, y) for x, y in s.points], s.color, s.opacity)
            elif isinstance(s, Line):
                self._line([at(x, y) for x, y in s.points], s.color, s.width, s.dash)
            elif isinstance(s, Text):
                self.text(s.x + dx, s.y + dy, s.text, s.size, s.anchor, s.color, s.bold)

    def _polygon(self, points: list, color: str, opacity: float) -> None:
        """A translucent polygon: drawn on a layer of its bounding box, blended in."""
        x0, y0 = (max(0, int(min(p[i] for p in points))) for i in (0, 1))
        x1, y1 = (int(max(p[i] for p in points)) + 2 for i in (0, 1))
        layer = self.image_module.new("RGBA", (max(x1 - x0, 1), max(y1 - y0, 1)), (0, 0, 0, 0))
        self.draw_module.Draw(layer).polygon([(x - x0, y - y0) for x, y in points],
                                             fill=(*_rgb(color), round(255 * opacity)))
        self.image.alpha_composite(layer, dest=(x0, y0))

    def _line(self, points: list, color: str, width: float, dash: bool) -> None:
        w = max(1, round(width * SCALE))
        if not dash:
            self.draw.line(points, fill=_rgb(color), width=w, joint="curve")
            return
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            length = max(((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5, 1e-9)
            on, off = 5 * SCALE, 4 * SCALE
            t = 0.0
            while t < length:
                a, b = t / length, min(t + on, length) / length
                self.draw.line([(x0 + (x1 - x0) * a, y0 + (y1 - y0) * a), (x0 + (x1 - x0) * b, y0 + (y1 - y0) * b)],
                               fill=_rgb(color), width=w)
                t += on + off

    def png(self) -> bytes:
        _, _, _, png_plugin = pillow()
        info = png_plugin.PngInfo()
        info.add_text("Software", f"{format.REPORT_GENERATOR} {__version__}")
        small = self.image.convert("RGB").resize((self.image.width // SCALE, self.image.height // SCALE),
                                                 self.image_module.Resampling.LANCZOS)
        out = io.BytesIO()
        small.save(out, format="PNG", pnginfo=info)
        return out.getvalue()


def _header_lines(info: dict) -> list[str]:
    meta, stats = info["metadata"], info["metadata"].get("stats") or {}
    keys = ("steps", "samples", "tokens", "padding_pct", "straggler_mean", "straggler_max", "distinct_shapes",
            "dropped")
    return [f"{info['path']}: dp {meta.get('dp')} x grad_accum {meta.get('grad_accum')}, {meta.get('epochs')} "
            f"epoch(s), varlen {meta.get('varlen_version')}",
            "   ".join(f"{k} {fmt(stats[k])}" for k in keys if k in stats)]


def png_image(info: dict, figs: list) -> bytes:
    """The report's plots of ``info`` stacked in one PNG (title, caption, plot; the summary on top)."""
    header = _header_lines(info)
    blocks = [(f, textwrap.wrap(f.caption, CAPTION_CHARS)) for f in figs]
    width = max([f.canvas.width for f in figs] + [600]) + 2 * MARGIN
    height = MARGIN + 30 + 16 * len(header) + sum(24 + 15 * len(lines) + f.canvas.height + 16 for f, lines in blocks)
    p = _Painter(width, height)
    y = MARGIN + 20
    p.text(MARGIN, y, "varlen report", 18, bold=True)
    for line in header:
        y += 16
        p.text(MARGIN, y, line, 11, color="#555555")
    y += 16
    for f, lines in blocks:
        y += 22
        p.text(MARGIN, y, f.title, 14, bold=True)
        for line in lines:
            y += 15
            p.text(MARGIN, y, line, 11, color="#555555")
        y += 6
        p.canvas(f.canvas, MARGIN, y)
        y += f.canvas.height + 10
    return p.png()
