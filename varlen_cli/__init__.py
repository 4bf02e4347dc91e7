"""varlen: length analysis, distributed sorting and batch planning for variable-length samples.

Every stage is a plain function over a frozen config dataclass::

    from varlen_cli.analyze import AnalyzeConfig, analyze
    analyze(AnalyzeConfig(sources=("data/",), output="metrics"))

The command line (``varlen``) is a thin adapter over these functions. Importing this package is
cheap: torch is imported only by the stages that need it.
"""

__version__ = "0.1.0"
