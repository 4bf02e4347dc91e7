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


def is_chat_target(target: str | None) -> bool:
    """``--target-length assistant`` (the chat mask), as opposed to ``KIND:PATH`` (:mod:`.lengths`)."""
    return target in TARGETS


def check_special_tokens(length: str, special_tokens: bool) -> None:
    """``--no-special-tokens`` has no meaning for chat: the template writes the special tokens."""
    if str(length).startswith("chat:") and not special_tokens:
        raise UsageError(f"--no-special-tokens does not apply to --length {length}: the chat template writes the "
                         f"special tokens (BOS, turn markers), so the lengths are the template's; edit the template "
                         f"to change them")


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
    return parse_conversations(column.to_pylist(), name, where)


def parse_conversations(values: list, name: str, where: str) -> list:
    """``values`` (lists of message dicts, or JSON strings of them) as lists of message dicts; an
    empty conversation is refused, as ``apply_chat_template`` refuses one on its own."""
    if any(isinstance(v, str) for v in values):
        try:
            values = [json.loads(v) if isinstance(v, str) else v for v in values]
        except ValueError as exc:
            raise InputError(f"chat column '{name}' holds invalid JSON in {where}: {exc}") from None
    for v in values:
        if not isinstance(v, list) or not all(isinstance(m, dict) for m in v):
            raise InputError(f"--length chat:{name} needs a list of messages per row, but '{name}' holds "
                             f"{type(v).__name__} values in {where}")
    empty = sum(1 for v in values if not v)
    if empty:
        raise InputError(f"chat column '{name}' holds {empty} empty conversation(s) (no messages) in {where}: "
                         f"transformers' apply_chat_template refuses one; drop those rows")
    return values


def encode(hf, convs: list, where: str, want_target: bool = False) -> dict:
    """``apply_chat_template`` of a batch of conversations: ``input_ids`` (and ``assistant_masks``
    when ``want_target``), one list per conversation. What analyze counts and what
    ``SourceDataset(tokenizer=...)`` hands out for chat metrics."""
    try:
        return hf.apply_chat_template(convs, tokenize=True, return_dict=True, return_assistant_tokens_mask=want_target)
    except Exception as exc:  # a template's own raise_exception(), a missing key...: the user's data
        text = str(exc).strip().splitlines()
        raise InputError(f"the chat template failed on a row of {where}: "
                         f"{text[0] if text else type(exc).__name__}") from None


def chat_lengths(hf, column, name: str, where: str, want_target: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens after the chat template, assistant tokens or None) of every row."""
    if column.null_count:
        raise InputError(f"column '{name}' has {column.null_count} null values in {where}")
    convs = conversations(column, name, where)
    lengths = np.zeros(len(convs), np.int64)
    target = np.zeros(len(convs), np.int64) if want_target else None
    for i in range(0, len(convs), BATCH):
        batch = convs[i: i + BATCH]
        out = encode(hf, batch, where, want_target)
        lengths[i: i + len(batch)] = [len(ids) for ids in out["input_ids"]]
        if want_target:
            target[i: i + len(batch)] = [sum(m) for m in out["assistant_masks"]]
    return lengths, target
