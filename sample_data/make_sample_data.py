"""Build the small datasets in sample_data/ (deterministic; no third-party text).

    python sample_data/make_sample_data.py

Writes:
  text.jsonl           2,000 samples {"id", "text"}: synthetic sentences, lognormal lengths
  text.parquet         the same rows as Parquet (4 row groups)
  tokenized.parquet    the same rows tokenised: {"id", "input_ids": list<int32>}
  audio_manifest.jsonl 1,000 utterances {"path", "duration" (seconds), "speaker"}
  tokenizer.json       a 2,000-token BPE tokenizer trained on text.jsonl (needs `tokenizers`)
  cuts.jsonl.gz        a Lhotse CutSet of 200 of the utterances, each with its recording and a supervision
                       whose text is a sentence of text.jsonl (written by lhotse: `pip install lhotse`)
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qui", "ren", "dal", "mor", "fen", "gu",
             "ha", "ix", "ju", "bo", "cen", "dra", "el", "on", "ur", "ast", "ber", "cor", "dun", "eth"]


def make_vocabulary(rng: np.random.Generator, size: int = 3000) -> list[str]:
    words = set()
    while len(words) < size:
        n = int(rng.integers(1, 4))
        words.add("".join(rng.choice(SYLLABLES, size=n)))
    return sorted(words)


def make_texts(rng: np.random.Generator, n: int) -> list[str]:
    vocab = make_vocabulary(rng)
    ranks = np.arange(1, len(vocab) + 1)
    p = 1.0 / ranks ** 1.1
    p /= p.sum()
    lengths = np.clip(rng.lognormal(mean=3.3, sigma=0.9, size=n).astype(int), 1, 600)
    texts = []
    for k in lengths:  # building the sample data, not a hot path
        words = rng.choice(len(vocab), size=k, p=p)
        sentence = " ".join(vocab[w] for w in words)
        texts.append(sentence[0].upper() + sentence[1:] + ".")
    return texts


def main() -> None:
    rng = np.random.default_rng(1234)
    texts = make_texts(rng, 2000)
    with open(os.path.join(HERE, "text.jsonl"), "w") as fh:
        for i, t in enumerate(texts):
            fh.write(json.dumps({"id": i, "text": t}) + "\n")
    table = pa.table({"id": pa.array(range(len(texts)), pa.int64()), "text": texts})
    pq.write_table(table, os.path.join(HERE, "text.parquet"), row_group_size=500)

    durations = np.round(np.clip(rng.gamma(shape=2.0, scale=3.0, size=1000), 0.3, 30.0), 3)
    with open(os.path.join(HERE, "audio_manifest.jsonl"), "w") as fh:
        for i, d in enumerate(durations):
            fh.write(json.dumps({"path": f"clips/{i:05d}.flac", "duration": float(d), "speaker": int(i % 37)}) + "\n")

    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    except ImportError:
        print("tokenizers is not installed: skipping tokenizer.json and tokenized.parquet")
        return
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["[UNK]", "[PAD]", "[BOS]", "[EOS]"])
    tok.train_from_iterator(texts, trainer=trainer)
    bos, eos = tok.token_to_id("[BOS]"), tok.token_to_id("[EOS]")
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]",
                                                       special_tokens=[("[BOS]", bos), ("[EOS]", eos)])
    # Like many shipped tokenizer.json files, fix truncation and padding: varlen must undo both.
    tok.enable_truncation(max_length=128)
    tok.enable_padding(length=128, pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    tok.save(os.path.join(HERE, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    ids = [e.ids for e in tok.encode_batch(texts)]
    pq.write_table(pa.table({"id": pa.array(range(len(texts)), pa.int64()),
                             "input_ids": pa.array(ids, pa.list_(pa.int32()))}),
                   os.path.join(HERE, "tokenized.parquet"), row_group_size=500)
    make_cuts(durations[:200], texts[:200])
    print("wrote", ", ".join(sorted(f for f in os.listdir(HERE) if not f.endswith(".py"))))


def make_cuts(durations, texts) -> None:
    """cuts.jsonl.gz: speech-recognition cuts (audio in, transcript out) as lhotse writes them."""
    try:
        from lhotse import AudioSource, CutSet, MonoCut, Recording, SupervisionSegment
    except ImportError:
        print("lhotse is not installed: skipping cuts.jsonl.gz")
        return
    cuts = []
    for i, (seconds, text) in enumerate(zip(durations, texts)):
        rec = Recording(id=f"utt{i:05d}", sources=[AudioSource(type="file", channels=[0],
                                                               source=f"clips/{i:05d}.flac")],
                        sampling_rate=16000, num_samples=int(round(seconds * 16000)), duration=float(seconds))
        sup = SupervisionSegment(id=f"utt{i:05d}-0", recording_id=rec.id, start=0.0, duration=float(seconds),
                                 text=text, speaker=f"spk{i % 37}")
        cuts.append(MonoCut(id=rec.id, start=0.0, duration=float(seconds), channel=0, recording=rec,
                            supervisions=[sup]))
    CutSet.from_cuts(cuts).to_file(os.path.join(HERE, "cuts.jsonl.gz"))


if __name__ == "__main__":
    main()
