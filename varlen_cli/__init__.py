"""varlen: length analysis, distributed sorting and batch planning for variable-length samples.

Every stage is a plain function over a frozen config dataclass::

    from varlen_cli.analyze import AnalyzeConfig, analyze
    analyze(AnalyzeConfig(sources=("data/",), output="metrics"))

The command line (``varlen``) is a thin adapter over these functions. Importing this package is
cheap: torch is imported only by the stages that need it. A varlen error that a script lets escape
prints one line, ``varlen: error: [rank R] MESSAGE``, instead of a traceback (also in torchrun's
summary; ``VARLEN_DEBUG=1`` shows the traceback): :mod:`varlen_cli.errors.entry`.
"""

from .errors.entry import install_excepthook

__version__ = "0.1.0"

install_excepthook()
