"""The memory profile file (``varlen calibrate -o profile.json``): reading, checking, writing.

A JSON object with ``"format": "varlen-memory-profile"``; see docs/memory.md for every field. The
planner only needs ``fit`` (``c0``, ``c1``, ``c2`` in bytes); the rest is provenance.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence

from .. import __version__, format
from ..errors import InputError
from ..storage.files import check_regular, open_regular

PROFILE_FORMAT = format.MEMORY_PROFILE_FORMAT
PROFILE_FORMAT_VERSION = format.MEMORY_PROFILE_FORMAT_VERSION
MIN_TOKEN_BYTES = 1.0  # a step grows by at least a byte per token (its id alone is 8): less is not a profile


def new_profile(mode: str, model: str, **fields) -> dict:
    """The common head of a profile; ``fields`` (device, dtype, points, fit, ...) are added as given."""
    out = {"format": PROFILE_FORMAT, "format_version": PROFILE_FORMAT_VERSION, "mode": mode, "model": model,
           "varlen_version": __version__, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.update(fields)
    return out


def coefficients(profile: dict) -> tuple[float, float, float]:
    fit = profile["fit"]
    return float(fit["c0"]), float(fit["c1"]), float(fit["c2"])


def check_profile(profile, where: str) -> dict:
    """``profile`` if it is a usable memory profile, else an :class:`InputError` naming ``where``."""
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise InputError(f"{where} is not a varlen memory profile (no \"format\": \"{PROFILE_FORMAT}\"); "
                         "create one with `varlen calibrate`")
    if int(profile.get("format_version", 0)) > PROFILE_FORMAT_VERSION:
        raise InputError(f"{where} has profile format version {profile.get('format_version')}; this varlen "
                         f"reads version {PROFILE_FORMAT_VERSION} (upgrade varlen)")
    fit = profile.get("fit")
    try:
        values = [float(fit[k]) for k in ("c0", "c1", "c2")]
    except (TypeError, KeyError, ValueError):
        raise InputError(f"{where} has no fit with numeric c0, c1, c2") from None
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise InputError(f"{where}: fit coefficients must be finite and >= 0 (got {values})")
    if values[1] == 0 and values[2] == 0:
        raise InputError(f"{where}: the fit does not grow with B x T (c1 = c2 = 0); re-run `varlen calibrate`")
    name, per_token = ("c1", values[1]) if values[1] > 0 else ("c2", values[2])
    if per_token < MIN_TOKEN_BYTES:
        raise InputError(f"{where}: fit coefficient {name} = {per_token:g} bytes per token is below "
                         f"{MIN_TOKEN_BYTES:g} (a training step holds more per token); re-run `varlen calibrate`")
    return profile


def require_regular_file(path: str, what: str) -> None:
    """An :class:`InputError` unless ``path`` is an existing regular file (a FIFO would block the reader forever)."""
    if not os.path.lexists(path):
        raise InputError(f"{what} {path} does not exist")
    check_regular(path, what)


def load_profile(path: str) -> dict:
    if not os.path.exists(path):
        raise InputError(f"memory profile {path} does not exist; create one with `varlen calibrate`")
    if os.path.isdir(path):
        raise InputError(f"memory profile {path} is a directory, not a profile file")
    try:
        with open_regular(path, what="memory profile") as fh:
            profile = json.load(fh)
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"{path} is not a varlen memory profile (not JSON); "
                         "create one with `varlen calibrate`") from None
    except OSError as exc:
        raise InputError(f"cannot read memory profile {path}: {exc.strerror or exc}") from None
    return check_profile(profile, path)


def check_output(path: str, overwrite: bool, inputs: Sequence[str] = ()) -> None:
    """Refuse, before measuring, an output that is an input or that ``--overwrite`` may not replace
    (the checks of every varlen output: :mod:`varlen_cli.runtime.safety`)."""
    from ..runtime import artifacts, safety

    safety.check_no_overlap(path, inputs)
    out = artifacts.AtomicFile(path, overwrite)
    out.json_format = PROFILE_FORMAT
    out.check()


def write_profile(path: str, profile: dict, overwrite: bool, inputs: Sequence[str] = ()) -> None:
    """Write atomically: a temporary file beside it, swapped in under the output lock."""
    from ..runtime import artifacts

    with artifacts.atomic_file(path, overwrite, inputs, json_format=PROFILE_FORMAT) as out:
        artifacts.atomic_write_json(out.tmp, profile)
