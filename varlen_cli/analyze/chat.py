"""Chat data: ``--length chat:COLUMN`` and ``--target-length assistant``.

A chat sample is a list of messages (``{"role": ..., "content": ...}``): a list-of-structs column
(Parquet, Arrow, JSONL, MDS/WebDataset JSON), or a string column holding that list as JSON. Its
length is the token count of ``tokenizer.apply_chat_template(messages, tokenize=True)``, and
``--target-length assistant`` adds the tokens that carry loss under assistant-only training: the
ones ``return_assistant_tokens_mask=True`` marks, which is what TRL's ``assistant_only_loss``
trains on. Both come from the same batched ``apply_chat_template`` call, so they are exactly what
transformers (and TRL) compute. The mask needs a template with ``{% generation %}`` markers around
the assistant turns; a template without them is refused.
"""

from __future__ import annotations

import json
import re

import numpy as np

from ..errors import InputError, UsageError

TARGETS = ("assistant",)
BATCH = 512  # conversations per apply_chat_template call
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_target(target: str | None) -> None:
    if target is not None and target not in TARGETS:
        raise UsageError(f"--target-length must be one of {', '.join(TARGETS)}; got {target!r}")


def check_tokenizer(hf, path: str, want_target: bool) -> None:
    """Refuse a tokenizer without a chat template, or (for the assistant mask) without generation markers."""
    template = getattr(hf, "chat_template", None)
    if not template:
        raise UsageError(f"--length chat:COLUMN needs a tokenizer with a chat template; {path} has none")
    texts = template.values() if isinstance(template, dict) else [template]
    if want_target and not any(GENERATION_TAG.search(t) for t in texts):
        raise UsageError(f"--target-length assistant needs a chat template with {{% generation %}} markers around "
                         f"the assistant turns; the template of {path} has none")


def conversations(column, name: str, where: str) -> list:
    """The column's conversations as Python lists of message dicts (JSON strings parsed)."""
    import pyarrow as pa

    values = column.to_pylist()
    t = column.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        try:
            values = [json.loads(v) for v in values]
        except ValueError as exc:
            raise InputError(f"chat column '{name}' holds invalid JSON in {where}: {exc}") from None
    for v in values:
        if not isinstance(v, list) or not all(isinstance(m, dict) for m in v):
            raise InputError(f"--length chat:{name} needs a list of messages per row, but '{name}' holds "
                             f"{type(v).__name__} values in {where}")
    return values


def chat_lengths(hf, column, name: str, where: str, want_target: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens after the chat template, assistant tokens or None) of every row."""
    if column.null_count:
        raise InputError(f"column '{name}' has {column.null_count} null values in {where}")
    convs = conversations(column, name, where)
    lengths = np.zeros(len(convs), np.int64)
    target = np.zeros(len(convs), np.int64) if want_target else None
    for i in range(0, len(convs), BATCH):
        batch = convs[i: i + BATCH]
        try:
            out = hf.apply_chat_template(batch, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=want_target)
        except Exception as exc:  # a template's own raise_exception(), a missing key...: the user's data
            text = str(exc).strip().splitlines()
            raise InputError(f"the chat template failed on a row of {where}: "
                             f"{text[0] if text else type(exc).__name__}") from None
        lengths[i: i + len(batch)] = [len(ids) for ids in out["input_ids"]]
        if want_target:
            target[i: i + len(batch)] = [sum(m) for m in out["assistant_masks"]]
    return lengths, target
