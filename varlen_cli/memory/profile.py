"""The memory profile file (``varlen calibrate -o profile.json``): reading, checking, writing.

A JSON object with ``"format": "varlen-memory-profile"``; see docs/memory.md for every field. The
planner only needs ``fit`` (``c0``, ``c1``, ``c2`` in bytes); the rest is provenance.
"""

from __future__ import annotations

import json
import math
import os
import time

from .. import __version__
from ..errors import InputError, OutputError
from ..runtime.files import open_regular

PROFILE_FORMAT = "varlen-memory-profile"
PROFILE_FORMAT_VERSION = 1


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
    return profile


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


def check_output(path: str, overwrite: bool) -> None:
    if os.path.isdir(path):
        raise OutputError(f"output {path} is a directory; give a file name such as profile.json")
    if os.path.lexists(path) and not overwrite:
        raise OutputError(f"output {path} already exists; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OutputError(f"cannot write {path}: directory {parent} does not exist")


def write_profile(path: str, profile: dict, overwrite: bool) -> None:
    """Write atomically (temporary file beside it, then rename)."""
    from ..runtime.artifacts import atomic_write_json

    check_output(path, overwrite)
    try:
        atomic_write_json(os.path.abspath(path), profile)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
