"""``varlen_cli.report``: a plan at a glance (``varlen report PLAN -o REPORT.html``).

One self-contained HTML page (inline SVG plots drawn by :mod:`.charts` on a :class:`~.canvas.Canvas`,
no network, no script) or one PNG (``--format png``, Pillow), each plot with a caption of what to
look for; the numbers are ``varlen inspect``'s. See docs/commands.md.

* :mod:`.core`: :class:`ReportConfig` and :func:`report`;
* :mod:`.figures`: which plots a plan gets, from ``varlen inspect``'s data;
* :mod:`.charts` and :mod:`.canvas`: the chart types and their shapes (SVG);
* :mod:`.page`: the HTML page; :mod:`.png`: the PNG image.
"""

from __future__ import annotations

from .core import ReportConfig, ReportResult, report

__all__ = ["ReportConfig", "ReportResult", "report"]
