"""``SourceDataset(tokenizer=...)``: each item's ``input_ids``, exactly what ``varlen analyze`` counted.

How analyze measured the metrics (``config.length`` in their manifest) decides how:

* ``tokens:COLUMN`` (or ``chars``/``words``/``bytes`` of a text column): the column's text through
  the tokenizer with truncation and padding off (:func:`varlen_cli.analyze.hf_tokenizer.token_counter`,
  the switch analyze's own loading uses) and analyze's special-token setting;
* ``chat:COLUMN``: the conversation through the tokenizer's chat template
  (:func:`varlen_cli.analyze.chat.encode`, analyze's own call), which needs a transformers tokenizer
  (or the tokenizer directory analyze was given);
* ``list:COLUMN`` and ``value:COLUMN``: refused, there is no text to tokenize (the items hold the
  column analyze measured).

``tokenizer`` is a ``tokenizer.json`` path or a tokenizer directory (loaded as analyze loads them), a
``tokenizers.Tokenizer`` or a transformers tokenizer (used on a copy: the caller's is left as it is).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import UsageError

TEXT = "text"  # the column when the manifest does not say (metrics of an older varlen)


class ItemTokenizer:
    """Adds ``input_ids`` to :class:`~varlen_cli.loader.SourceDataset` items (see the module doc)."""

    def __init__(self, tokenizer: Any, config: dict, where: str):
        kind, _, column = str(config.get("length") or "").partition(":")
        self.kind, self.column, self.where = kind or "tokens", column or TEXT, where
        self.special_tokens = bool(config.get("special_tokens", True))
        if self.kind in ("list", "value"):
            raise UsageError(f"SourceDataset(tokenizer=...) tokenizes the text analyze measured, but {where} was "
                             f"measured with --length {self.kind}:{self.column}, which holds no text: drop tokenizer= "
                             f"(the items hold '{self.column}' as analyze counted it)")
        self.hf = _chat_tokenizer(tokenizer, where) if self.kind == "chat" else None
        self.counter = None if self.kind == "chat" else _token_counter(tokenizer)

    def add_ids(self, items: list[dict]) -> None:
        """Put each item's token ids (an int64 array) under ``input_ids``."""
        if not items:
            return
        values = [_measured(item, self.column) for item in items]
        if self.kind == "chat":
            from ..analyze.chat import encode, parse_conversations

            out = encode(self.hf, parse_conversations(values, self.column, self.where), self.where)
            ids = [np.asarray(x, dtype=np.int64) for x in out["input_ids"]]
        else:
            import pyarrow as pa

            from ..analyze.lengths import token_lengths

            lengths, flat = token_lengths(self.counter, pa.array(values, pa.large_string()), self.special_tokens,
                                          with_ids=True)
            ids = np.split(flat, np.cumsum(lengths)[:-1])
        for item, tokens in zip(items, ids):
            item["input_ids"] = tokens


def _measured(item: dict, path: str):
    """The value analyze measured: the item's key ``path`` (``columns=[path]``), or the nested field the
    PATH names inside the column the item holds whole."""
    if path in item:
        return item[path]
    from ..analyze.paths import parse, value

    steps = parse(path).steps
    for k in range(len(steps), 0, -1):  # the longest dotted prefix the item holds
        if all(isinstance(x, str) for x in steps[:k]) and ".".join(steps[:k]) in item:
            return value(item[".".join(steps[:k])], steps[k:])
    return None


def _token_counter(tokenizer: Any):
    from ..analyze import hf_tokenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        from ..analyze.lengths import load_tokenizer

        return load_tokenizer(str(tokenizer))
    found = hf_tokenizer.token_counter(tokenizer)
    if found is None:
        raise UsageError(f"tokenizer must be a tokenizer.json path, a tokenizer directory, a tokenizers.Tokenizer or a "
                         f"transformers tokenizer, not {type(tokenizer).__name__}")
    return found


def _chat_tokenizer(tokenizer: Any, where: str):
    """A transformers tokenizer with a chat template (loaded from a directory as analyze loads it)."""
    from ..analyze import hf_tokenizer
    from ..analyze.chat import check_tokenizer

    name = str(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else type(tokenizer).__name__
    if isinstance(tokenizer, (str, os.PathLike)) and hf_tokenizer.is_directory(str(tokenizer)):
        tokenizer = hf_tokenizer.load_auto(str(tokenizer))
    if not hasattr(tokenizer, "apply_chat_template"):
        raise UsageError(f"{where} was measured with a chat template (--length chat:COLUMN): SourceDataset needs the "
                         f"same tokenizer, a transformers tokenizer or its directory, not {name}")
    check_tokenizer(tokenizer, name, want_target=False)
    return tokenizer
