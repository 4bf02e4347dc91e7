"""Where files live: local paths and object storage behind one small API (torch-free; fsspec lazily).

This module is the contract every reader of sources codes against (``varlen analyze``'s formats,
``SourceDataset``) and the writer of remote outputs. It is stable: names here are only ever added.

**Locations.** A location is a local path or a URL:

* a local path (``data/x.parquet``, ``/abs/dir``; ``file://`` URLs are local paths too);
* any fsspec URL: ``s3://bucket/prefix/``, ``gs://``/``gcs://``, ``hf://datasets/org/name/...``,
  ``https://host/file.parquet``, ``memory://`` (tests), ...;
* a ``pyarrow.fs`` URI that fsspec does not know (``hdfs://``, ``abfs://``...): served by
  ``pyarrow.fs.FileSystem.from_uri`` behind fsspec's ``ArrowFSWrapper``.

Local paths go straight to ``os`` and ``open`` (no fsspec import); URLs through fsspec. A URL's
client package is optional: a missing one is one :class:`~varlen_cli.errors.InputError` line naming
the extra, e.g. ``reading s3://b/x needs s3fs: pip install "varlen-cli[s3]"`` (:data:`EXTRAS`).

**Options.** Credentials and endpoints come from each client's standard environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``HF_TOKEN``...). ``--storage-option key=value`` passes anything
else to the filesystem's constructor: :func:`parse_options` turns the pairs into a dict (values
are JSON when they parse as JSON: ``anon=true``, ``client_kwargs={"region_name": "eu-west-1"}``,
else strings), checked first (:mod:`varlen_cli.storage.options`: a bad value is one UsageError line
naming the option). For ``s3://`` and ``http(s)://`` every request has a connect and a read timeout
(``connect_timeout``/``read_timeout`` options, seconds; defaults 5 and 10) and few retries, so an
unreachable or silent endpoint fails in seconds, never hangs (docs/analyze.md, "Timeouts").

**API** (module functions; ``options`` is a dict from :func:`parse_options`, a sequence of
``key=value`` strings, or None for the process's defaults set by :func:`configure`, which
``varlen analyze`` calls in every worker with its ``--storage-option`` pairs; filesystems are
cached per scheme and options):

======================================  ====================================================================
``configure(options)``                  the options used where a call passes None
``clear_cache()``                       forget the filesystems built so far (the environment changed)
``is_remote(loc)``                      True for a URL that is not a local ``file://`` path
``local_path(loc)``                     a ``file://`` URL as a plain path (others unchanged)
``join(base, *names)``, ``parent(loc)``, URL-aware path arithmetic (``os.path`` for local paths);
``name(loc)``, ``relpath(loc, base)``,  ``common_root`` is the deepest folder holding all locations,
``common_root(locs)``, ``absolute(loc)`` ``absolute`` what artifacts record (an absolute path or the URL)
``stat(loc, options)``                  :class:`FileInfo` (size, etag, version, mtime_ns, is_dir);
                                        InputError when missing or unreachable
``exists(loc)``, ``isdir(loc)``,        cheap probes (errors other than "not found" still raise)
``isfile(loc)``
``find(prefix, options)``               every file below a folder/prefix, recursively, as sorted locations
``find_info(prefix, start, options)``   ``{location: FileInfo}`` below a remote prefix (names starting ``start``)
``glob(pattern, options)``              the matches of a glob (``**`` recursive), sorted
``open_input(loc, options)``            a seekable binary file; remote: HTTP range requests, no download
``read_range(loc, start, stop)``        bytes ``[start, stop)`` (one range request remotely)
``read_bytes(loc, options)``            the whole object (small files: manifests, ``state.json``)
``arrow_filesystem(loc, options)``      ``(pyarrow.fs.FileSystem, path)``: for ``pq.ParquetFile(path,
                                        filesystem=fs)``, ``pyarrow.dataset``...
``parquet_file(loc, options, size)``    a ``pyarrow.parquet.ParquetFile`` (footer and row groups by range;
                                        a known ``size`` saves the request that asks for it; a known
                                        ``metadata`` the footer's)
``parquet_footer(loc, size, options)``  ``(footer bytes, FileMetaData)`` from one tail read (64 KiB)
``filesystem(loc, options)``            ``(fsspec filesystem, path in it)``: anything not covered above
``write_bytes(loc, data)``,             outputs (used by :mod:`varlen_cli.runtime.remote_output`): every
``put_file(local, loc)``,               upload is read back (``check_written``: the object's size); deletes
``copy(src, dst)``, ``remove(loc,``      are by exact key, never a pattern
``recursive)``, ``remove_many(locs)``
``fingerprint_fields(info)``            what freshness records for a file (size + etag/version or mtime)
======================================  ====================================================================

Every function raises :class:`~varlen_cli.errors.InputError` (exit 3) with one line for a missing
file, bucket or key, bad credentials, an unreachable or silent endpoint or a missing client package
(:func:`translate_errors`), also from a file :func:`open_input` or :func:`parquet_file` returned, read
later (a store that dies under a reader); write failures, and any failure inside an output's checks
(``translate_errors(loc, write=True)``), are :class:`~varlen_cli.errors.OutputError` (exit 4).
"""

from __future__ import annotations

import json
import os
import re
import stat as stat_mod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ..errors import InputError, OutputError, UsageError, VarlenError, first_line
from .files import check_regular, open_regular

# URL scheme -> (module to import, extra that installs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "hf": ("huggingface_hub", "hf"),
    "http": ("aiohttp", "http"), "https": ("aiohttp", "http"),
}
Options = Mapping[str, Any] | Sequence[str] | None


@dataclass(frozen=True)
class FileInfo:
    """What :func:`stat` knows about a location. ``etag``/``version`` are None where the store has
    none (local files); ``mtime_ns`` is 0 where it is unknown."""

    path: str
    size: int
    is_dir: bool = False
    etag: str | None = None
    version: str | None = None
    mtime_ns: int = 0


# -- locations ---------------------------------------------------------------------------------------
def scheme(loc: str) -> str:
    """The URL scheme (``s3``, ``gs``...), ``""`` for a local path (``C:\\x`` is local too)."""
    head, sep, _ = str(loc).partition("://")
    return head.lower() if sep and len(head) > 1 and head.replace("+", "").replace("-", "").isalnum() else ""


def is_remote(loc: str) -> bool:
    return scheme(loc) not in ("", "file", "local")


def local_path(loc: str) -> str:
    """A ``file://`` URL as a plain path; anything else unchanged."""
    return str(loc).split("://", 1)[1] if scheme(loc) in ("file", "local") else str(loc)


def _split(loc: str) -> tuple[str, str]:
    """``("s3://", "bucket/key")`` for a URL."""
    s = scheme(loc)
    return loc[: len(s) + 3], loc[len(s) + 3:]


def join(base: str, *names: str) -> str:
    if not is_remote(base):
        return os.path.join(base, *names)
    out = base.rstrip("/")
    for n in names:
        out = f"{out}/{n.strip('/')}" if n else out
    return out


def parent(loc: str) -> str:
    if not is_remote(loc):
        return os.path.dirname(loc)
    head, rest = _split(loc.rstrip("/"))
    return head + rest.rsplit("/", 1)[0] if "/" in rest else head + rest


def name(loc: str) -> str:
    return os.path.basename(loc) if not is_remote(loc) else loc.rstrip("/").rsplit("/", 1)[-1]


def relpath(loc: str, base: str) -> str:
    if not is_remote(loc):
        return os.path.relpath(loc, base)
    base = base.rstrip("/") + "/"
    if not loc.startswith(base):
        raise ValueError(f"{loc} is not below {base}")
    return loc[len(base):]


def common_root(locs: Sequence[str]) -> str:
    """The deepest folder that holds every location (all local, or all remote with one scheme)."""
    if not locs:
        return ""
    if not any(is_remote(p) for p in locs):
        return os.path.commonpath([os.path.dirname(p) for p in locs])
    heads = {_split(p)[0] for p in locs}
    if len(heads) > 1 or not all(is_remote(p) for p in locs):
        return ""  # mixed stores: paths stay absolute
    head = heads.pop()
    dirs = [_split(p)[1].split("/")[:-1] for p in locs]
    common: list[str] = []
    for parts in zip(*dirs):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return head + "/".join(common)


def absolute(loc: str) -> str:
    """A location as artifacts record it: an absolute local path, or the URL without a trailing ``/``."""
    return str(loc).rstrip("/") if is_remote(loc) else os.path.abspath(local_path(loc))


def under(loc: str, root: str) -> str:
    """``root`` joined with a relative ``loc`` (as recorded in a manifest); absolute ``loc`` as is."""
    if is_remote(loc) or not root or os.path.isabs(loc):
        return loc
    return join(root, loc)


# -- options -----------------------------------------------------------------------------------------
def parse_options(pairs: Options) -> dict[str, Any]:
    """``["key=value", ...]`` (or a dict, returned as a dict) as filesystem keyword arguments."""
    if pairs is None:
        return {}
    if isinstance(pairs, Mapping):
        return dict(pairs)
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = str(pair).partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--storage-option expects key=value, got '{pair}'")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def redacted(pairs: Sequence[str]) -> list[str]:
    """``--storage-option`` pairs for a manifest: keys only (values may be secrets)."""
    return [f"{str(p).partition('=')[0]}=***" for p in pairs]


def configure(options: Options) -> None:
    """Set the options this process uses where a call passes ``options=None``."""
    global _DEFAULT_OPTIONS
    _DEFAULT_OPTIONS = parse_options(options)


# -- filesystems -------------------------------------------------------------------------------------
_FS_CACHE: dict[tuple, Any] = {}
_DEFAULT_OPTIONS: dict[str, Any] = {}


def clear_cache() -> None:
    """Forget the filesystems built so far (after the environment changed: endpoint, credentials)."""
    _FS_CACHE.clear()


def _need_client(loc: str) -> None:
    s = scheme(loc)
    if s in EXTRAS:
        module, extra = EXTRAS[s]
        import importlib.util

        if importlib.util.find_spec(module) is None:
            raise InputError(f'reading {loc} needs {module}: pip install "varlen-cli[{extra}]"')
    try:
        import fsspec  # noqa: F401
    except ImportError:
        extra = EXTRAS.get(s, ("", "s3"))[1]
        raise InputError(f'reading {loc} needs fsspec: pip install "varlen-cli[{extra}]"') from None


def filesystem(loc: str, options: Options = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for a remote location (cached per scheme + options)."""
    s = scheme(loc)
    opts = parse_options(options) if options is not None else _DEFAULT_OPTIONS
    # Per process: a client made before a fork (DataLoader workers) must not be used after it.
    key = (os.getpid(), s, json.dumps(opts, sort_keys=True, default=str))
    fs = _FS_CACHE.get(key)
    if fs is None:
        _need_client(loc)
        fs = _make_fs(loc, s, opts)
        _FS_CACHE[key] = fs
    return fs, fs._strip_protocol(loc)


def _make_fs(loc: str, s: str, opts: dict) -> Any:
    import fsspec

    from . import options as storage_options

    try:
        fsspec.get_filesystem_class(s)
    except (ImportError, ValueError):
        return _arrow_fs_wrapper(loc, opts)
    timeouts, opts = storage_options.split_timeouts(s, opts)
    if s in ("s3", "s3a"):
        opts = storage_options.s3_kwargs(opts, timeouts)
    elif s in ("http", "https"):
        opts = storage_options.http_kwargs(opts, timeouts)
    try:
        fs = fsspec.filesystem(s, skip_instance_cache=True, **opts)
        if s in ("s3", "s3a"):
            fs.retries = storage_options.S3_CLIENT_RETRIES
            fs.connect()  # the client now: a bad value in the options is refused here, not at the first request
    except ImportError as exc:
        extra = EXTRAS.get(s, (None, None))[1]
        hint = f': pip install "varlen-cli[{extra}]"' if extra else ""
        raise InputError(f"reading {loc} needs a package that is not installed ({first_line(exc)}){hint}") from None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad --storage-option for {s}://: {first_line(exc)}") from None
    return fs


def _arrow_fs_wrapper(loc: str, opts: dict) -> Any:
    """A ``pyarrow.fs`` URI (``hdfs://``...) behind fsspec's interface."""
    import pyarrow.fs as pafs
    from fsspec.implementations.arrow import ArrowFSWrapper

    try:
        fs, _ = pafs.FileSystem.from_uri(loc)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError / NotImplementedError
        raise InputError(f"unsupported location {loc}: no fsspec or pyarrow filesystem ({first_line(exc)})") from None
    if opts:
        raise UsageError(f"--storage-option is not supported for {scheme(loc)}:// (a pyarrow.fs URI)")
    return ArrowFSWrapper(fs)


# -- errors ------------------------------------------------------------------------------------------
_CREDENTIAL_WORDS = ("credential", "accessdenied", "access denied", "forbidden", "invalidaccesskeyid",
                     "signaturedoesnotmatch", "unauthorized")
# an HTTP status as a word of the message ("(403)"), never digits of a port or a key ("127.0.0.1:34011")
_STATUS = {code: re.compile(rf"(?:^|[\s(\[=]){code}(?=$|[\s)\],:;.])") for code in ("401", "403", "404")}
_UNREACHABLE_WORDS = ("connect", "timeout", "timed out", "name or service not known", "unreachable",
                      "connection refused", "could not resolve", "nodename nor servname")


_TIMEOUT_HINTS = {"connect": "no connection within the connect timeout; --storage-option connect_timeout=SECONDS "
                              "sets it", "read": "the store did not answer within the read timeout; --storage-option "
                                                 "read_timeout=SECONDS sets it"}
_OUTPUT_SIDE: ContextVar[bool] = ContextVar("varlen_storage_output_side", default=False)


def describe_error(loc: str, exc: BaseException, write: bool = False) -> str:
    """One line saying what went wrong reaching ``loc`` (missing, denied, unreachable...); ``write``:
    ``loc`` is (in) an output."""
    text = first_line(exc)
    low = f"{type(exc).__name__} {text}".lower()
    if isinstance(exc, FileNotFoundError) or "nosuchbucket" in low or "nosuchkey" in low or _STATUS["404"].search(low):
        what = "bucket" if "nosuchbucket" in low or "bucket" in low and "not exist" in low else "object"
        return f"cannot write {loc}: no such {what}" if write else f"{loc} does not exist (no such {what})"
    if "profilenotfound" in low:
        return f"no credentials for {loc}: {text}"
    if "nocredentials" in low or "unable to locate credentials" in low:
        return (f"no credentials for {loc}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the store's own "
                "variables), or pass --storage-option")
    if isinstance(exc, PermissionError) or any(w in low for w in _CREDENTIAL_WORDS) or \
            _STATUS["401"].search(low) or _STATUS["403"].search(low):
        return f"access to {loc} was denied (check the credentials and permissions): {text}"
    kind = _timeout_kind(exc, low)
    if kind:
        return f"cannot reach {loc}: {text} ({_TIMEOUT_HINTS[kind]})"
    if any(w in low for w in _UNREACHABLE_WORDS):
        return f"cannot reach {loc}: {text}"
    return f"cannot {'write' if write else 'read'} {loc}: {text}"


def _timeout_kind(exc: BaseException, low: str) -> str | None:
    """``connect`` or ``read`` for a client's timeout (botocore, aiohttp, asyncio), else None."""
    if "connecttimeout" in low or "connect timeout" in low or "serverconnectiontimeout" in low:
        return "connect"
    if "readtimeout" in low or "read timeout" in low or "timeout" in type(exc).__name__.lower():
        return "read"
    return None


@contextmanager
def translate_errors(loc: str, write: bool = False) -> Iterator[None]:
    """Turn a client's exception for ``loc`` into one InputError (OutputError when ``write``) line.
    Inside a block with ``write`` (an output's checks and uploads), every storage call is on the
    output side: its errors are OutputError (exit 4) too, whatever the call."""
    write = write or _OUTPUT_SIDE.get()
    token = _OUTPUT_SIDE.set(write)
    try:
        yield
    except VarlenError:
        raise
    except Exception as exc:  # noqa: BLE001 - clients raise botocore/aiohttp/OSError types; one line each
        message = describe_error(loc, exc, write)
        raise (OutputError if write else InputError)(message) from None
    finally:
        _OUTPUT_SIDE.reset(token)


class _Translated:
    """A remote file whose reads raise one InputError line (a store that dies while a reader, such as
    pyarrow or ``SourceDataset``, reads from it), not the client's exception."""

    def __init__(self, fh, loc: str):
        self._fh, self._loc = fh, loc

    def _call(self, name: str, *args, **kwargs):
        with translate_errors(self._loc):
            return getattr(self._fh, name)(*args, **kwargs)

    def read(self, *args, **kwargs):
        return self._call("read", *args, **kwargs)

    def readinto(self, *args, **kwargs):
        return self._call("readinto", *args, **kwargs)

    def read1(self, *args, **kwargs):
        return self._call("read1", *args, **kwargs)

    def readline(self, *args, **kwargs):
        return self._call("readline", *args, **kwargs)

    def seek(self, *args, **kwargs):
        return self._call("seek", *args, **kwargs)

    def __iter__(self):
        return iter(self.readline, b"")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        return getattr(self._fh, name)


# -- reading -----------------------------------------------------------------------------------------
def _info_from_fsspec(loc: str, d: Mapping[str, Any]) -> FileInfo:
    etag = d.get("ETag") or d.get("etag") or d.get("md5Hash") or d.get("blob_id") or d.get("sha")
    version = d.get("VersionId") or d.get("version_id") or d.get("generation") or d.get("last_commit")
    if version is not None and not isinstance(version, (str, int)):
        version = getattr(version, "oid", None) or str(version)
    mtime = d.get("LastModified") or d.get("mtime") or d.get("updated") or d.get("last_modified")
    return FileInfo(
        path=loc, size=int(d.get("size") or 0), is_dir=d.get("type") == "directory",
        etag=str(etag).strip('"') if etag else None, version=str(version) if version not in (None, "null") else None,
        mtime_ns=_mtime_ns(mtime),
    )


def _mtime_ns(value: Any) -> int:
    if value is None:
        return 0
    if hasattr(value, "timestamp"):
        return int(value.timestamp() * 1e9)
    try:
        return int(float(value) * 1e9)
    except (TypeError, ValueError):
        return 0


def stat(loc: str, options: Options = None) -> FileInfo:
    """Size, ETag/version (remote) or mtime (local) of ``loc``; InputError if missing or unreachable."""
    if not is_remote(loc):
        path = local_path(loc)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise InputError(f"{loc} does not exist") from None
        except OSError as exc:
            raise InputError(f"{loc} is not readable: {exc.strerror}") from None
        return FileInfo(loc, st.st_size, stat_mod.S_ISDIR(st.st_mode), mtime_ns=st.st_mtime_ns)
    with translate_errors(loc):
        fs, path = filesystem(loc, options)
        fs.invalidate_cache(path)  # what the store says now, not a listing cached earlier
        return _info_from_fsspec(loc, fs.info(path))


def _info_or_none(loc: str, options: Options) -> dict | None:
    """The store's entry for ``loc`` now (None when there is none); any other failure is raised (a
    store that does not answer is never taken for a missing object)."""
    with translate_errors(loc):
        fs, path = filesystem(loc, options)
        fs.invalidate_cache(path)
        try:
            return fs.info(path)
        except FileNotFoundError:
            return None


def exists(loc: str, options: Options = None) -> bool:
    if not is_remote(loc):
        return os.path.lexists(local_path(loc))
    return _info_or_none(loc, options) is not None


def isdir(loc: str, options: Options = None) -> bool:
    if not is_remote(loc):
        return os.path.isdir(local_path(loc))
    with translate_errors(loc):
        fs, path = filesystem(loc, options)
        fs.invalidate_cache(path)
        return bool(fs.isdir(path))


def isfile(loc: str, options: Options = None) -> bool:
    if not is_remote(loc):
        return os.path.isfile(local_path(loc))
    info = _info_or_none(loc, options)
    return info is not None and info.get("type") == "file"


def _as_loc(loc: str, fs: Any, path: str) -> str:
    """A path fsspec returned, as a URL with ``loc``'s scheme."""
    head = _split(loc)[0]
    return path if "://" in path else head + path.lstrip("/") if head != "file://" else path


def find(prefix: str, options: Options = None) -> list[str]:
    """Every file below ``prefix`` (a folder or key prefix ending in ``/``), recursively, sorted."""
    if not is_remote(prefix):
        root = local_path(prefix)
        return sorted(os.path.join(d, f) for d, _, files in os.walk(root, followlinks=True) for f in files)
    with translate_errors(prefix):
        fs, path = filesystem(prefix, options)
        fs.invalidate_cache(path.rstrip("/"))
        found = fs.find(path.rstrip("/"), withdirs=False)
    return sorted(_as_loc(prefix, fs, p) for p in found)


def find_info(prefix: str, start: str = "", options: Options = None) -> dict[str, FileInfo]:
    """``{location: FileInfo}`` of every object below the remote folder ``prefix`` (one listing);
    ``start``: only those whose path below it starts with ``start`` (``s3://`` lists just those)."""
    with translate_errors(prefix):
        fs, path = filesystem(prefix, options)
        path = path.rstrip("/")
        fs.invalidate_cache(path)
        if start and scheme(prefix) in ("s3", "s3a"):
            found = fs.find(path, withdirs=False, detail=True, prefix=start)
        else:
            found = fs.find(path, withdirs=False, detail=True)
    out = {_as_loc(prefix, fs, p): _info_from_fsspec(_as_loc(prefix, fs, p), d) for p, d in found.items()}
    return {loc: info for loc, info in out.items() if relpath(loc, prefix).startswith(start)}


def glob(pattern: str, options: Options = None) -> list[str]:
    """The locations matching ``pattern`` (``*``, ``?``, ``[..]``, ``**`` recursive), sorted."""
    if not is_remote(pattern):
        import glob as glob_mod

        return sorted(glob_mod.glob(local_path(pattern), recursive=True))
    with translate_errors(pattern):
        fs, path = filesystem(pattern, options)
        found = fs.glob(path)
    return sorted(_as_loc(pattern, fs, p) for p in found)


def open_input(loc: str, options: Options = None, block_size: int = 1 << 20):
    """A seekable binary file; remote reads are range requests of ``block_size`` (no download)."""
    if not is_remote(loc):
        try:
            return open_regular(local_path(loc), "rb")  # a FIFO or a device is refused, never read
        except OSError as exc:
            raise InputError(f"{loc} is not readable: {exc.strerror}") from None
    with translate_errors(loc):
        fs, path = filesystem(loc, options)
        return _Translated(fs.open(path, "rb", block_size=block_size, cache_type="readahead"), loc)


def read_range(loc: str, start: int, stop: int, options: Options = None) -> bytes:
    """Bytes ``[start, stop)`` of ``loc`` (one range request for a remote object)."""
    if stop <= start:
        return b""
    if not is_remote(loc):
        try:
            with open_regular(local_path(loc), "rb") as fh:
                fh.seek(start)
                return fh.read(stop - start)
        except OSError as exc:
            raise InputError(f"{loc} is not readable: {exc.strerror}") from None
    with translate_errors(loc):
        fs, path = filesystem(loc, options)
        return fs.cat_file(path, start=start, end=stop)


def read_bytes(loc: str, options: Options = None) -> bytes:
    """The whole object (manifests, ``state.json``: small files)."""
    if not is_remote(loc):
        try:
            with open_regular(local_path(loc), "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise InputError(f"{loc} is not readable: {exc.strerror}") from None
    with translate_errors(loc):
        fs, path = filesystem(loc, options)
        return fs.cat_file(path)


def arrow_filesystem(loc: str, options: Options = None) -> tuple[Any, str]:
    """``(pyarrow.fs.FileSystem, path)`` for Arrow/Parquet readers (local: ``LocalFileSystem``)."""
    import pyarrow.fs as pafs

    if not is_remote(loc):
        return pafs.LocalFileSystem(), os.path.abspath(local_path(loc))
    with translate_errors(loc):
        fs, path = filesystem(loc, options)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def parquet_file(loc: str, options: Options = None, size: int | None = None, metadata=None):
    """A ``pyarrow.parquet.ParquetFile``; remote: the footer and each row group by range requests.
    ``metadata`` (from :func:`parquet_footer`): the footer is not read again."""
    import pyarrow.parquet as pq

    if not is_remote(loc):
        check_regular(local_path(loc))
        return pq.ParquetFile(local_path(loc), metadata=metadata)
    with translate_errors(loc):
        fs, path = filesystem(loc, options)
        # No read-ahead cache: pyarrow asks for exactly the footer and the column chunks it needs,
        # each one range request (s3fs's default 50 MB read-ahead would fetch whole files). Reads
        # after this (row groups) go through _Translated: a store that dies then is one InputError.
        kwargs = {"size": size} if size is not None and scheme(loc) in ("s3", "s3a") else {}
        return pq.ParquetFile(_Translated(fs.open(path, "rb", cache_type="none", **kwargs), loc), metadata=metadata)


PARQUET_TAIL = 64 << 10  # bytes of a Parquet file's end read at once: the footer of almost every file


def parquet_footer(loc: str, size: int, options: Options = None) -> tuple[bytes, Any]:
    """``(footer bytes, pyarrow FileMetaData)`` of the Parquet file ``loc`` of ``size`` bytes from one
    read of its last 64 KiB (a second one only for a longer footer); InputError when it is no Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tail = read_range(loc, max(0, size - PARQUET_TAIL), size, options)
    n = int.from_bytes(tail[-8:-4], "little") if len(tail) >= 8 else -1
    if len(tail) < 12 or tail[-4:] != b"PAR1" or not 0 < n <= size - 12:
        raise InputError(f"cannot read Parquet file {loc}: not a Parquet file (no footer at its end)")
    footer = tail[-8 - n:-8] if n + 8 <= len(tail) else read_range(loc, size - 8 - n, size - 8, options)
    try:  # the footer alone, framed as a file: pyarrow parses the metadata without the data pages
        metadata = pq.read_metadata(pa.BufferReader(b"PAR1" + footer + tail[-8:]))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged footer
        raise InputError(f"cannot read Parquet file {loc}: {first_line(exc)}") from None
    return footer, metadata


def fingerprint_fields(info: FileInfo) -> dict[str, Any]:
    """What freshness records and compares for one source: the size, plus the ETag and version of
    an object, or the modification time of a local file."""
    if is_remote(info.path):
        out: dict[str, Any] = {}
        if info.etag:
            out["etag"] = info.etag
        if info.version:
            out["version"] = info.version
        return out
    return {"mtime_ns": int(info.mtime_ns)}


# -- writing (outputs) -------------------------------------------------------------------------------
def write_bytes(loc: str, data: bytes, options: Options = None) -> None:
    """Write ``data`` to the object ``loc``; it is read back (its size) before this returns."""
    with translate_errors(loc, write=True):
        fs, path = filesystem(loc, options)
        fs.pipe_file(path, data)
    check_written(loc, len(data), options)


def put_file(local: str, loc: str, options: Options = None) -> None:
    """Upload the local file ``local`` to ``loc``; the object is read back (its size) before this returns."""
    with translate_errors(loc, write=True):
        fs, path = filesystem(loc, options)
        fs.put_file(local, path)
    check_written(loc, os.path.getsize(local), options)


def copy(src: str, dst: str, options: Options = None) -> None:
    """A server-side copy of the object ``src`` to ``dst`` (in the same store)."""
    with translate_errors(dst, write=True):
        fs, src_path = filesystem(src, options)
        fs.copy(src_path, filesystem(dst, options)[1])


def check_written(loc: str, size: int, options: Options = None) -> None:
    """Refuse (OutputError) an object the store said it wrote but does not hold, or holds with another
    size: a store that answers 200 and keeps nothing (ETags are not compared: with server-side
    encryption such as SSE-KMS an ETag is no checksum of the bytes)."""
    with translate_errors(loc, write=True):
        info = _info_or_none(loc, options)
    have = None if info is None or info.get("type") != "file" else int(info.get("size") or 0)
    if have != size:
        found = "nothing there" if have is None else f"{have} bytes there"
        raise OutputError(f"the store did not keep {loc}: it accepted {size} bytes, reading it back finds {found}")


def remove(loc: str, recursive: bool = False, options: Options = None) -> None:
    """Delete the object ``loc`` (``recursive``: every object below the prefix ``loc``)."""
    with translate_errors(loc, write=True):
        remove_many(find(loc, options) if recursive else [loc], options)


def remove_many(locs: Sequence[str], options: Options = None) -> None:
    """Delete exactly the objects ``locs``, one by one: never a pattern (``fs.rm`` would expand a name
    holding ``*``, ``?`` or ``[`` as a glob, which could match objects varlen did not write)."""
    for loc in locs:
        with translate_errors(loc, write=True):
            fs, path = filesystem(loc, options)
            fs.rm_file(path)
