"""``--storage-option`` values checked before a store client sees them, and the timeouts each client gets.

A value of the wrong kind (``config_kwargs=notadict``, ``read_timeout=soon``, an unknown s3 option) is one
:class:`~varlen_cli.errors.UsageError` line naming the option, where the client would fail later, at its
first request, with its own internals. Used by :mod:`varlen_cli.storage` (``_make_fs``) for the CLI's
``--storage-option`` pairs and ``SourceDataset(storage_options=...)`` alike.

**Timeouts** (docs/analyze.md, "Timeouts"): ``connect_timeout`` and ``read_timeout`` (seconds) are
varlen's own options, given to the clients of ``s3://`` (botocore's connect and read timeouts, on every
request) and ``http(s)://`` (aiohttp's ``sock_connect`` and ``sock_read``); defaults :data:`TIMEOUTS`.
s3 uploads are sent without ``Expect: 100-continue``: aiohttp does not time the wait for the server's
``100 Continue``, so an upload to a store that never answers would wait forever.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..errors import UsageError

TIMEOUTS: dict[str, float] = {"connect_timeout": 5.0, "read_timeout": 10.0}
TIMEOUT_SCHEMES = ("s3", "s3a", "http", "https")  # the clients varlen gives the timeouts to
# s3: botocore sends a request at most twice (one retry of a 5xx, a throttle, a timeout) and s3fs's own
# loop (which also retries a body cut in the middle) at most twice: a store that accepts connections
# and never answers fails after at most 4 read timeouts.
S3_ATTEMPTS = {"total_max_attempts": 2, "mode": "standard"}
S3_CLIENT_RETRIES = 2  # s3fs's own retry loop (its default is 5, with back-off)
# S3FileSystem passes keywords it does not know to aiobotocore's AioSession; these the base class takes
_FSSPEC_KEYS = ("use_listings_cache", "listings_expiry_time", "max_paths")
_RETRY_MODES = ("legacy", "standard", "adaptive")


def bad(key: str, want: str, value: Any) -> UsageError:
    return UsageError(f"--storage-option {key} must be {want}, got {_shown(value)}")


def _shown(value: Any) -> str:
    import json

    try:
        return f"'{value}'" if isinstance(value, str) else json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        raise bad(key, "a number of seconds > 0 (such as 30)", value)
    return float(value)


def split_timeouts(scheme: str, opts: dict) -> tuple[dict[str, float], dict]:
    """``(timeouts, the other options)``: :data:`TIMEOUTS` updated by the ``connect_timeout`` and
    ``read_timeout`` options (refused for a store whose client varlen gives no timeouts)."""
    timeouts = dict(TIMEOUTS)
    rest = dict(opts)
    for key in TIMEOUTS:
        if key in rest:
            if scheme not in TIMEOUT_SCHEMES:
                raise UsageError(f"--storage-option {key} applies to s3:// and http(s):// only, not {scheme}://")
            timeouts[key] = _seconds(key, rest.pop(key))
    return timeouts, rest


def s3_kwargs(opts: dict, timeouts: dict[str, float]) -> dict:
    """The ``S3FileSystem`` keywords for ``opts``: checked, with varlen's timeouts and retries where
    the options say nothing, and a session whose uploads do not wait for ``100 Continue``."""
    import s3fs
    from aiobotocore.session import AioSession

    session_keys = _params(AioSession.__init__)
    known = _params(s3fs.S3FileSystem.__init__) | session_keys | set(_FSSPEC_KEYS)
    for key, value in opts.items():
        if key not in known:
            raise UsageError(f"unknown --storage-option {key} for s3:// (the keywords of s3fs.S3FileSystem: "
                             "endpoint_url, anon, key, secret, token, profile, client_kwargs, config_kwargs...)")
        if key.endswith("_kwargs") and not isinstance(value, dict):
            raise bad(key, 'a JSON object such as {"region_name": "eu-west-1"}', value)
        default = _default(s3fs.S3FileSystem.__init__, key)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise bad(key, "true or false", value)
        if type(default) is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise bad(key, "an integer >= 1", value)
        if key == "session" and not isinstance(value, AioSession):
            raise bad(key, "an aiobotocore AioSession (given from Python)", value)
        if key == "asynchronous" and value or key == "loop":  # varlen calls the store synchronously
            raise UsageError(f"--storage-option {key} is not for varlen: it calls the store synchronously, with "
                             "s3fs's own event loop")
    config = dict(opts.get("config_kwargs") or {})
    _check_config(config)
    config = {**timeouts, "retries": dict(S3_ATTEMPTS), **config}  # the user's config_kwargs win
    out = {k: v for k, v in opts.items() if k not in session_keys}
    if "session" not in opts:
        out["session"] = _session({k: v for k, v in opts.items() if k in session_keys})
    return {**out, "config_kwargs": config}


def _params(fn) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items()
            if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _default(fn, key: str) -> Any:
    param = inspect.signature(fn).parameters.get(key)
    return None if param is None else param.default


def _check_config(config: dict) -> None:
    """``config_kwargs``: keys botocore's ``Config`` takes, timeouts in seconds, a well-formed ``retries``."""
    from botocore.config import Config

    for key, value in config.items():
        if key not in Config.OPTION_DEFAULTS:
            raise UsageError(f"unknown key {key} in --storage-option config_kwargs (the keywords of botocore's "
                             "Config: connect_timeout, read_timeout, retries, region_name, max_pool_connections...)")
        if key in TIMEOUTS:
            _seconds(f"config_kwargs.{key}", value)
    pool = config.get("max_pool_connections", 10)
    if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
        raise bad("config_kwargs.max_pool_connections", "an integer >= 1", pool)
    retries = config.get("retries", {})
    if not isinstance(retries, dict):
        raise bad("config_kwargs.retries", 'a JSON object such as {"total_max_attempts": 3}', retries)
    for key, value in retries.items():
        if key in ("max_attempts", "total_max_attempts"):
            if isinstance(value, bool) or not isinstance(value, int) or value < (key == "total_max_attempts"):
                raise bad(f"config_kwargs.retries.{key}", "a whole number of attempts", value)
        elif key != "mode" or value not in _RETRY_MODES:
            raise bad(f"config_kwargs.retries.{key}", "one of max_attempts, total_max_attempts, mode ("
                      + ", ".join(_RETRY_MODES) + ")", value)


def _session(kwargs: dict):
    """An aiobotocore session (``profile=...`` is its option) whose s3 requests carry no ``Expect`` header."""
    from aiobotocore.session import AioSession

    try:
        session = AioSession(**kwargs)
    except TypeError as exc:
        raise UsageError(f"bad --storage-option for s3://: {exc}") from None
    session.register("before-call.s3", _no_expect_continue)
    return session


def _no_expect_continue(params, **kwargs) -> None:  # noqa: ARG001 - botocore's handler signature
    headers = params.get("headers")
    if isinstance(headers, dict):
        headers.pop("Expect", None)


def http_kwargs(opts: dict, timeouts: dict[str, float]) -> dict:
    """``HTTPFileSystem`` keywords: aiohttp's socket timeouts, unless ``client_kwargs`` gives a timeout."""
    import aiohttp

    client = opts.get("client_kwargs", {})
    if not isinstance(client, dict):
        raise bad("client_kwargs", 'a JSON object such as {"trust_env": true}', client)
    timeout = aiohttp.ClientTimeout(sock_connect=timeouts["connect_timeout"], sock_read=timeouts["read_timeout"])
    return {**opts, "client_kwargs": {"timeout": timeout, **client}}
