"""``--tokenizer``: a ``tokenizer.json`` file, or any directory ``transformers.AutoTokenizer`` loads.

A directory is loaded by ``AutoTokenizer.from_pretrained`` (sentencepiece and tiktoken models
included: transformers converts them to a fast tokenizer where it can). When the result is a fast
tokenizer, its Rust backend (``tokenizer._tokenizer``, configured by transformers: BOS/EOS
post-processor, added tokens) is what counts tokens, through the batched ``encode_batch_fast``,
so the lengths are ``AutoTokenizer``'s exactly. A tokenizer with no fast form is called in batches
(``tokenizer(texts)``), the slow path.
"""

from __future__ import annotations

import os

from ..errors import InputError, UsageError

BATCH = 1024  # texts per call of a slow (Python) tokenizer


def is_directory(path: str) -> bool:
    return os.path.isdir(path)


def load_auto(path: str):
    """``AutoTokenizer.from_pretrained(path)`` (local files only), with one-line errors."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError("--tokenizer DIR needs the 'transformers' package: pip install 'varlen-cli[hf]'") from None
    if not os.path.isdir(path):
        raise InputError(f"tokenizer directory {path} does not exist")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)  # conversion notices are not varlen's output
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, ImportError...)
        text = str(exc).strip().splitlines()
        raise InputError(f"cannot load the tokenizer in {path}: {text[0] if text else type(exc).__name__}") from None


def counter(hf, copy: bool = False):
    """What counts tokens for ``hf`` (an AutoTokenizer): its Rust backend when it is fast (a copy with
    ``copy``), else a batched wrapper with the same two methods varlen calls."""
    backend = getattr(hf, "_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        return untruncated(backend, copy)
    return SlowCounter(hf)


def untruncated(tok, copy: bool = False):
    """``tok`` (a ``tokenizers.Tokenizer``) with truncation and padding switched off, so that it counts
    true lengths: the one place analyze and ``SourceDataset`` do it. ``copy``: on a copy, leaving a
    caller's tokenizer as it was (and unaffected by its later settings)."""
    if copy:
        tok = type(tok).from_str(tok.to_str())
    tok.no_truncation()
    tok.no_padding()
    return tok


def token_counter(tokenizer):
    """What counts tokens for a tokenizer object a caller passes (None if it is neither kind): a
    ``tokenizers.Tokenizer`` or a transformers tokenizer, on a copy without truncation and padding."""
    if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "no_truncation") and hasattr(tokenizer, "to_str"):
        return untruncated(tokenizer, copy=True)
    if callable(tokenizer) and hasattr(tokenizer, "convert_tokens_to_ids"):  # transformers' PreTrainedTokenizerBase
        return counter(tokenizer, copy=True)
    return None


class _Ids(list):
    """A token id list that also answers ``.ids``, as a ``tokenizers.Encoding`` does."""

    @property
    def ids(self) -> list:
        return self


class SlowCounter:
    """A tokenizer without a fast form, behind ``encode_batch``/``get_vocab_size``."""

    def __init__(self, hf):
        self.hf = hf

    def encode_batch(self, texts: list, add_special_tokens: bool = True) -> list:
        out = []
        for i in range(0, len(texts), BATCH):
            ids = self.hf(texts[i: i + BATCH], add_special_tokens=add_special_tokens, truncation=False,
                          padding=False)["input_ids"]
            out.extend(_Ids(x) for x in ids)
        return out

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.hf)
