"""Builders for the shard formats of ``varlen analyze`` (Megatron, MDS, WebDataset), written by the
formats' own libraries where they are installed, and chat/tokenizer directories built offline."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet  # noqa: F401 - pa.parquet

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
MDS_FIXTURES = os.path.join(DATA, "mds")  # written by mosaicml-streaming's MDSWriter (make_mds_fixtures)
MDS_COLUMNS = {"text": "str", "tokens": "ndarray:int32", "n": "int32", "patch": "ndarray:int16:2,2",
               "blob": "bytes", "messages": "json", "score": "float64", "dyn": "ndarray", "sint": "str_int"}


def megatron_builder():
    """megatron-core's IndexedDatasetBuilder, or None where megatron-core cannot be imported."""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError:
        return None
    return IndexedDatasetBuilder


def write_megatron(prefix: str, docs: list[list[list[int]]], dtype=np.uint16) -> None:
    """``prefix.bin``/``prefix.idx`` of documents (lists of sequences of token ids): with megatron-core's
    builder when importable, else with varlen's writer of the same documented layout."""
    builder_cls = megatron_builder()
    if builder_cls is not None:
        import torch

        builder = builder_cls(prefix + ".bin", dtype=dtype)
        for doc in docs:
            for seq in doc:
                builder.add_item(torch.tensor(seq, dtype=torch.int64))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        return
    from varlen_cli.analyze.formats.megatron import write_index

    lengths = [len(s) for d in docs for s in d]
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    with open(prefix + ".bin", "wb") as fh:
        for d in docs:
            for s in d:
                fh.write(np.asarray(s, dtype).tobytes())
    write_index(prefix + ".idx", lengths, starts, dtype)


def random_docs(n_docs: int, seed: int = 0, max_len: int = 40) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 1000, int(rng.integers(0, max_len))).tolist() for _ in range(int(rng.integers(1, 4)))]
            for _ in range(n_docs)]


def mds_writer():
    """mosaicml-streaming's MDSWriter, or None. ``import streaming`` pulls torchvision for its vision
    datasets (not installable beside this project's CPU torch), so the package's ``__init__`` is
    skipped and the writer module imported directly: the real writer code runs."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            return None
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = pkg
    try:
        from streaming.base.format.mds.writer import MDSWriter
    except ImportError:
        return None
    return MDSWriter


def mds_samples(n: int = 40, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(1, 30))
        out.append({
            "text": " ".join(["word"] * int(rng.integers(0, 12))) + (" ünï" if i % 3 else ""),
            "tokens": rng.integers(0, 500, k).astype(np.int32),
            "n": np.int32(k * 3),
            "patch": np.arange(4, dtype=np.int16).reshape(2, 2) + i,
            "blob": bytes(range(i % 7)),
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * (i % 5)}],
            "score": float(i) / 4,
            "dyn": (np.ones((1 + i % 3, 2), np.float32) if i % 2 else np.arange(1 + i % 4, dtype=np.int64)),
            "sint": 10 * i,
        })
    return out


def make_mds_fixtures(root: str) -> None:
    """The committed fixtures under tests/data/mds: raw, zstd and gz shards of :func:`mds_samples`."""
    writer = mds_writer()
    for name, compression in (("raw", None), ("zstd", "zstd"), ("gz", "gz")):
        with writer(out=os.path.join(root, name), columns=MDS_COLUMNS, size_limit=1 << 11,
                    compression=compression) as w:
            for s in mds_samples():
                w.write(s)


def write_webdataset(path: str, samples: list[dict]) -> None:
    """A ``.tar`` shard written by the ``webdataset`` package's TarWriter (deterministic mtimes)."""
    import webdataset as wds

    with wds.TarWriter(path, mtime=0) as w:
        for s in samples:
            w.write(s)


def wds_samples(n: int, seed: int = 0, first: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(first, first + n):
        k = int(rng.integers(1, 50))
        out.append({"__key__": f"s{i:06d}", "json": {"num_tokens": k, "text": "x " * (i % 9),
                                                      "meta": {"frames": 2 * k}},
                    "npy": rng.standard_normal((k, 2)).astype(np.float32), "txt": "hello wörld " * (i % 4)})
    return out


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def write_json(path, obj) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh)


TEXTS = ["hello world this is a test", "the quick brown fox jumps over the lazy dog", "ünïcödé 日本語 text",
         "assistant user system"] * 30
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n"
                 "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
                 "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}{% endfor %}")


def sentencepiece_dir(tmp_path, tokenizer_class: str, chat_template: str | None = None) -> str:
    """A tokenizer directory with only a sentencepiece model (no tokenizer.json), trained here."""
    import io

    import pytest

    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_writer=model, vocab_size=40,
                                   model_type="unigram", character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=-1, minloglevel=2, hard_vocab_limit=False)
    folder = tmp_path / f"tok-{tokenizer_class}"
    folder.mkdir()
    (folder / "tokenizer.model" if tokenizer_class == "LlamaTokenizer" else folder / "spiece.model").write_bytes(
        model.getvalue())
    config = {"tokenizer_class": tokenizer_class, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if chat_template:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def chat_source(tmp_path, as_json: bool = False):
    """A Parquet file of 25 conversations (a list-of-structs column, or JSON strings), and them."""
    convs = [[{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello world " * i},
              {"role": "assistant", "content": "the lazy dog " * (i % 5)},
              {"role": "user", "content": "ünï"}, {"role": "assistant", "content": "fox " * (i % 3)}]
             for i in range(25)]
    column = [json.dumps(c) for c in convs] if as_json else convs
    path = tmp_path / ("chat_json.parquet" if as_json else "chat.parquet")
    pa.parquet.write_table(pa.table({"messages": column}), path, row_group_size=7)
    return str(path), convs
