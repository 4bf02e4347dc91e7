"""``varlen analyze``: each sample's length and difficulty, computed across workers.

    from varlen_cli.analyze import AnalyzeConfig, analyze
    result = analyze(AnalyzeConfig(sources=("data/",), output="metrics", length="tokens:text"))
    result = analyze_dataset(dataset, "metrics", length="tokens:text")  # an in-memory datasets.Dataset

Modules: ``sources`` (finding and reading the input files, sample ids), ``lengths`` (length
kinds), ``difficulty`` (difficulty functions), ``stats`` (distribution summaries), ``core`` (the
stage: :func:`check`, :func:`run_in_group`, :func:`analyze`).
"""

from __future__ import annotations

from .core import AnalyzeConfig, AnalyzeResult, analyze, analyze_dataset, check, count_units, run_in_group

__all__ = ["AnalyzeConfig", "AnalyzeResult", "analyze", "analyze_dataset", "check", "count_units", "run_in_group"]
