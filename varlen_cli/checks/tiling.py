"""The tiling of split samples (``--split-long``): the chunks of each sample back to back from 0,
copies alike, ending at the sample's length; checked a range of keys at a time (bounded temporaries)."""

from __future__ import annotations

import numpy as np

from .arrays import MAX_EXAMPLES, join_values

TILING_PART = 1 << 20  # split chunks whose tiling is checked together (a range of keys): bounded temporaries


def tiling_problems(c: dict, e: int, partial: bool) -> list[str]:
    """The chunks of every split sample of one epoch (``c``: their key, start, length and, when known,
    whole length): each distinct chunk (start, length) as often as the sample's first one (its copies),
    distinct chunks back to back from 0 (a replan's first epoch: no overlap only), and, with the
    samples' lengths, ending at the sample's length."""
    return tiling_messages(tiling_found(c, partial), e, partial)


def tiling_found(c: dict, partial: bool) -> list[dict]:
    """:func:`_tiling_part` of the chunks ``c`` (every chunk of their samples), a range of keys at a time
    (a sample's chunks share its key), in key order: bounded temporaries."""
    k = c["key"]
    with_full = "full" in c and len(c["full"]) == len(k)
    names = ("key", "start", "length") + (("full",) if with_full else ())
    parts = -(-len(k) // TILING_PART)
    if parts <= 1:
        return [_tiling_part({name: c[name] for name in names}, partial)]
    found = []
    edges = np.linspace(int(k.min()), int(k.max()) + 1, parts + 1).astype(np.int64)
    for lo, hi in zip(edges[:-1], edges[1:]):
        idx = np.flatnonzero((k >= lo) & (k < hi))
        found.append(_tiling_part({name: c[name][idx] for name in names}, partial))
    return found


def tiling_messages(found: list[dict], e: int, partial: bool) -> list[str]:
    """The problems of epoch ``e`` from its :func:`_tiling_part` findings, in key order."""
    problems = []
    if any(f["differ"] for f in found):
        problems.append(f"epoch {e}: copies of a chunk differ in length")
    if partial:
        if any(f["overlap"] for f in found):
            problems.append(f"epoch {e}: split chunks overlap")
    elif any(f["gaps"] for f in found):
        problems.append(f"epoch {e}: split chunks overlap or leave gaps (e.g. sample keys "
                        f"{join_values(sum((f['gaps'] for f in found), []))})")
    bad_ends = sum(f["bad_ends"] for f in found)
    if bad_ends:
        problems.append(f"epoch {e}: {bad_ends} split chunks do not end within, or at the end of, their sample")
    return problems


def _tiling_part(c: dict, partial: bool) -> dict:
    """What :func:`tiling_problems` reports, for the split samples whose keys are in ``c``."""
    found = {"differ": False, "overlap": False, "gaps": [], "bad_ends": 0}
    k, s, ln = c["key"], c["start"], c["length"]
    if not len(s) or not (s > 0).any():
        return found
    k, s, ln, order = sorted_chunks(k, s, ln, need_order="full" in c)
    new_key = np.r_[True, k[1:] != k[:-1]]
    keep = (s[np.r_[new_key[1:], True]] > 0)[np.cumsum(new_key) - 1]  # samples split: their largest start > 0
    full = c["full"][order] if "full" in c else None
    if not keep.all():
        k, s, ln, new_key = k[keep], s[keep], ln[keep], new_key[keep]
        full = full[keep] if full is not None else None
    same_chunk = ~new_key & np.r_[False, s[1:] == s[:-1]]
    found["differ"] = bool((same_chunk & np.r_[False, ln[1:] != ln[:-1]]).any())
    chunk_start = np.flatnonzero(~same_chunk)  # first entry of each distinct (key, start)
    ck, cs, cl = k[chunk_start], s[chunk_start].astype(np.int64), ln[chunk_start].astype(np.int64)
    copies = np.diff(np.append(chunk_start, len(k)))
    first = np.r_[True, ck[1:] != ck[:-1]]
    prev_end = np.r_[0, (cs + cl)[:-1]]
    if partial:
        found["overlap"] = bool((~first & (cs < prev_end)).any())
    else:
        gaps = (first & (cs != 0)) | (~first & (cs != prev_end))
        group = np.cumsum(first) - 1
        head_copies = copies[first][group]
        bad = gaps | (copies != head_copies)
        found["gaps"] = ck[np.flatnonzero(bad)[:MAX_EXAMPLES]].tolist()
    if full is not None:
        full = full[chunk_start].astype(np.int64)
        last = np.r_[ck[1:] != ck[:-1], True]
        over = cs + cl > full
        short = last & (cs + cl != full) & (not partial)
        found["bad_ends"] = int(over.sum() + short.sum())
    return found


def sorted_chunks(k: np.ndarray, s: np.ndarray, ln: np.ndarray, need_order: bool) -> tuple:
    """Chunks sorted by (key, start, length), and the order (when ``need_order``): one sort of the three
    packed in an int64 when their values fit (they do in any plan varlen writes), else a lexsort."""
    k, s, ln = (np.asarray(x, np.int64) for x in (k, s, ln))
    bits = [int(x.max()).bit_length() for x in (k, s, ln)]
    if min(int(k.min()), int(s.min()), int(ln.min())) < 0 or sum(bits) > 63:
        order = np.lexsort((ln, s, k))
        return k[order], s[order], ln[order], order
    packed = (k << (bits[1] + bits[2])) | (s << bits[2]) | ln
    order = None
    if need_order:  # ties are equal chunks of one sample (the same whole length): any order of them will do
        order = np.argsort(packed)
        packed = packed[order]
    else:
        packed.sort()
    low = (1 << bits[2]) - 1
    return packed >> (bits[1] + bits[2]), (packed >> bits[2]) & ((1 << bits[1]) - 1), packed & low, order
