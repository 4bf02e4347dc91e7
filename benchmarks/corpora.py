"""Real-text corpora for the benchmarks, built from Debian packages (nothing is committed).

    from benchmarks.corpora import build_corpus
    path = build_corpus("fortunes", "/tmp/varlen-corpora")   # -> /tmp/varlen-corpora/fortunes.parquet

Each corpus is one Parquet file with a ``text`` column (one sample per row) and a ``source``
column (the file inside the package the text came from), cached in the caller's folder:

* ``fortunes``: one sample per fortune cookie of Debian's ``fortunes`` package (short texts,
  ~15k samples);
* ``manpages``: one sample per manual page of Debian's ``manpages`` package, the roff source as
  it is (long texts, a few hundred samples);
* ``manpages-paragraphs``: the same pages cut at blank lines and paragraph macros (``.PP``,
  ``.SH``...): many medium-length samples.

The packages are fetched with ``apt-get download`` and unpacked with ``dpkg -x`` into a temporary
folder (no installation, no root needed beyond what ``apt-get download`` needs); ``apt-get update``
is run once if the package is unknown. Also usable from the command line:

    python benchmarks/corpora.py fortunes manpages --out /tmp/varlen-corpora
"""

from __future__ import annotations

import argparse
import glob
import gzip
import os
import re
import subprocess
import tempfile

CORPORA = {
    "fortunes": "fortunes",
    "manpages": "manpages",
    "manpages-paragraphs": "manpages",
}


def build_corpus(name: str, out_dir: str, repeat: int = 1) -> str:
    """Build (or reuse from ``out_dir``) the corpus ``name``; returns the Parquet path.

    ``repeat`` > 1 writes the samples that many times over (a bigger corpus with the same length
    distribution), as ``NAME-xREPEAT.parquet``.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose from {', '.join(CORPORA)}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.parquet" if repeat == 1 else f"{name}-x{repeat}.parquet")
    if os.path.exists(path):
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix="varlen-corpus-") as tmp:
        root = _unpack(CORPORA[name], tmp)
        texts, sources = _EXTRACT[name](root)
    table = pa.table({"text": pa.array(texts * repeat, pa.string()), "source": pa.array(sources * repeat, pa.string())})
    tmp_path = path + ".tmp"
    pq.write_table(table, tmp_path, row_group_size=8192)
    os.replace(tmp_path, path)
    return path


def _unpack(package: str, tmp: str) -> str:
    """``apt-get download PACKAGE`` and ``dpkg -x`` it into ``tmp``; returns the unpacked root."""
    def download() -> subprocess.CompletedProcess:
        return subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)

    proc = download()
    if proc.returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, text=True)
        proc = download()
    debs = glob.glob(os.path.join(tmp, f"{package}_*.deb"))
    if proc.returncode != 0 or not debs:
        raise RuntimeError(f"apt-get download {package} failed: {proc.stderr.strip()}")
    root = os.path.join(tmp, "root")
    subprocess.run(["dpkg", "-x", debs[0], root], check=True)
    return root


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _fortunes(root: str) -> tuple[list[str], list[str]]:
    texts, sources = [], []
    folder = os.path.join(root, "usr", "share", "games", "fortunes")
    for path in sorted(glob.glob(os.path.join(folder, "*"))):
        if path.endswith(".dat") or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as fh:
            body = _decode(fh.read())
        for cookie in re.split(r"^%\s*$", body, flags=re.M):
            cookie = cookie.strip("\n")
            if cookie.strip():
                texts.append(cookie)
                sources.append(os.path.relpath(path, root))
    return texts, sources


def _man_pages(root: str) -> list[tuple[str, str]]:
    pages = []
    for path in sorted(glob.glob(os.path.join(root, "usr", "share", "man", "man*", "*.gz"))):
        if os.path.islink(path):
            continue
        with gzip.open(path, "rb") as fh:
            text = _decode(fh.read())
        if text.startswith(".so "):  # a page that only points to another page
            continue
        pages.append((os.path.relpath(path, root), text))
    return pages


def _manpages(root: str) -> tuple[list[str], list[str]]:
    pages = _man_pages(root)
    return [t for _, t in pages], [p for p, _ in pages]


_PARAGRAPH = re.compile(r"\n(?:\s*\n|\.(?:PP|P|LP|SH|SS|TP|IP)\b[^\n]*\n)+")


def _manpages_paragraphs(root: str) -> tuple[list[str], list[str]]:
    texts, sources = [], []
    for path, page in _man_pages(root):
        for para in _PARAGRAPH.split(page):
            if para.strip():
                texts.append(para.strip("\n"))
                sources.append(path)
    return texts, sources


_EXTRACT = {"fortunes": _fortunes, "manpages": _manpages, "manpages-paragraphs": _manpages_paragraphs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", choices=sorted(CORPORA))
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "varlen-corpora"))
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    import pyarrow.parquet as pq

    for name in args.names:
        path = build_corpus(name, args.out, args.repeat)
        print(f"{name}: {path} ({pq.ParquetFile(path).metadata.num_rows:,} samples)")


if __name__ == "__main__":
    main()
