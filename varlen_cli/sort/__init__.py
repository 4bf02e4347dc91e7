"""``varlen sort``: a distributed sample sort of a metrics directory.

    from varlen_cli.sort import SortConfig, sort
    result = sort(SortConfig(metrics_dir="metrics", output="sorted"))

Modules: ``keys`` (order-preserving integer keys, splitters, exchange counts), ``core`` (the
stage: :func:`check`, :func:`check_input`, :func:`run_in_group`, :func:`sort`).
"""

from __future__ import annotations

from .core import SortConfig, SortResult, check, check_input, parse_by, run_in_group, sort

__all__ = ["SortConfig", "SortResult", "check", "check_input", "parse_by", "run_in_group", "sort"]
