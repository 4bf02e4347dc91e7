"""Reading files: only regular files, refused in one line otherwise.

A FIFO named as an input blocks ``open()`` until a writer appears (varlen would hang, deaf to
SIGINT and SIGTERM), a character device such as ``/dev/zero`` never ends, and a directory or a
socket is no file. Every reader of an input goes through this module:

* :func:`open_regular` where varlen opens the file itself (manifests, profiles, sampler states,
  configs, text and JSONL sources): the file is opened without blocking, checked with ``fstat`` on
  the open descriptor (no window between the check and the read), then read normally;
* :func:`check_regular` where a library opens the path (pyarrow's Parquet and Arrow readers,
  ``tokenizers``, ``importlib``): checked with ``stat`` just before.

A missing file is left to the caller (each says what it expected in its own words).
"""

from __future__ import annotations

import os
import stat

from ..errors import InputError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(path: str, mode: int, what: str, error: type[Exception]) -> Exception:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return error(f"{what} {path} is {kind}, not a regular file")


def check_regular(path: str, what: str = "input", error: type[Exception] = InputError) -> None:
    """Raise ``error`` ("WHAT PATH is a FIFO (named pipe), not a regular file") when ``path`` exists
    and is not a regular file (links are followed); a missing path passes."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode, what, error)


def open_regular(path: str, mode: str = "r", what: str = "input", error: type[Exception] = InputError, **kwargs):
    """``open(path, mode)`` for reading (``"r"`` or ``"rb"``), refusing anything but a regular file with
    ``error``; never blocks on a FIFO. ``OSError`` (a missing or unreadable file) propagates."""
    if mode not in ("r", "rb"):
        raise ValueError(f"open_regular reads only (mode 'r' or 'rb', got {mode!r})")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode, what, error)
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise
