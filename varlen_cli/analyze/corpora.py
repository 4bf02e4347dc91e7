"""Speech corpora's manifests: what a NeMo shard range and a Lhotse Shar directory name.

Their samples are JSON lines, read by the JSONL reader of :mod:`.sources` (nested fields through
:mod:`.paths`: ``supervisions[0].text``, ``recording.num_samples``); this module only says which
files a SOURCE names, in the order the library reads them (that order is ``sample_id``'s):

* **NeMo** (``manifest__OP_0..511_CL_.json``, ``audio_{0..7}.json``): NeMo's own rule
  (``expand_sharded_filepaths``): ``(``, ``[``, ``<`` and ``_OP_`` become ``{``; ``)``, ``]``, ``>``
  and ``_CL_`` become ``}``; then ``braceexpand`` (without backslash escapes). The files keep the
  expansion's order (``_0..511_`` is numeric: 0, 1, 2, ..., not 0, 1, 10, 100), every one must exist.
  A SOURCE is a range when it does not exist as a path and holds ``_OP_``, ``{``, or a ``(A..B)``,
  ``[A..B]`` or ``<A..B>`` group (``[0..7]`` is NeMo's range, never a glob's class).
* **Lhotse Shar** (a directory of ``cuts.000000.jsonl.gz``, ``recording.000000.tar``, ...): the cut
  shards (``cuts.*.jsonl*``), in sorted path order as ``CutSet.from_shar(in_dir=...)`` reads them;
  the fields' shards (audio, features) hold no samples of their own and are not read. A Lhotse CutSet
  manifest (``cuts.jsonl.gz``) is one JSONL file: a cut a line, in ``CutSet`` order.
"""

from __future__ import annotations

import os
import re

from .. import storage
from ..errors import InputError, UsageError

NEMO_OPEN = ("(", "[", "<", "_OP_")
NEMO_CLOSE = (")", "]", ">", "_CL_")
SHAR_CUTS = "cuts"
# NeMo's (0..7), [0..7] and <0..7>: a range, not a glob's class [0.7] nor a missing path
NEMO_BRACKET_RANGE = re.compile(r"[(\[<][^()\[\]<>/]*\.\.[^()\[\]<>/]*[)\]>]")


def is_nemo_range(source: str) -> bool:
    """Whether SOURCE is a brace-expanded shard range (see the module doc)."""
    return ("_OP_" in source or "{" in source or NEMO_BRACKET_RANGE.search(source) is not None) \
        and not storage.exists(source)


def expand_nemo(source: str) -> list[str]:
    """The files of a NeMo shard range, in NeMo's order; a missing one refused in one line."""
    try:
        from braceexpand import UnbalancedBracesError, braceexpand
    except ImportError:
        raise UsageError(f"{source} is a brace-expanded shard range (NeMo's), which needs the 'braceexpand' package: "
                         "pip install 'varlen-cli[nemo]'") from None
    pattern = source
    for key in NEMO_OPEN:
        pattern = pattern.replace(key, "{")
    for key in NEMO_CLOSE:
        pattern = pattern.replace(key, "}")
    try:
        paths = list(braceexpand(pattern, escape=False))
    except UnbalancedBracesError:
        raise InputError(f"{source}: unbalanced braces in the shard range ({pattern})") from None
    for k, path in enumerate(paths):
        if not storage.exists(path):
            raise InputError(f"{path} does not exist: file {k + 1} of the {len(paths)} that the shard range {source} "
                             f"names ({pattern})")
    if len(set(paths)) != len(paths):
        raise InputError(f"the shard range {source} names a file twice ({pattern})")
    return paths


def shar_cuts(directory: str) -> list[str] | None:
    """The cut shards of a Lhotse Shar directory, sorted; None when ``directory`` is not one (no cut
    shards beside field shards)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    cuts = [n for n in names if n.split(".")[0] == SHAR_CUTS and ".jsonl" in n]
    fields = [n for n in names if n.split(".")[0] != SHAR_CUTS and n.count(".") >= 2 and not n.startswith((".", "_"))]
    if not cuts or not fields:
        return None
    return [os.path.join(directory, n) for n in cuts]
