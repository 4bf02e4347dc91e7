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
else strings). For ``s3://``, varlen sets short connect timeouts and few retries unless the options
say otherwise, so an unreachable endpoint fails in seconds (:data:`S3_DEFAULTS`).

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
``write_bytes(loc, data)``,             outputs (used by :mod:`varlen_cli.runtime.remote_output`)
``remove(loc, recursive)``
``fingerprint_fields(info)``            what freshness records for a file (size + etag/version or mtime)
======================================  ====================================================================

Every function raises :class:`~varlen_cli.errors.InputError` (exit 3) with one line for a missing
file, bucket or key, bad credentials, an unreachable endpoint or a missing client package
(:func:`translate_errors`); write failures are :class:`~varlen_cli.errors.OutputError` (exit 4).
"""

from __future__ import annotations

import json
import os
import stat as stat_mod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import InputError, OutputError, UsageError, VarlenError
from .files import check_regular, open_regular

# URL scheme -> (module to import, extra that installs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "hf": ("huggingface_hub", "hf"),
    "http": ("aiohttp", "http"), "https": ("aiohttp", "http"),
}
# Fail fast against an unreachable or misconfigured endpoint (the user's options win).
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2, "mode": "standard"}},
}
S3_CLIENT_RETRIES = 2  # s3fs's own retry loop (its default is 5, with back-off)
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

    if s in ("s3", "s3a"):
        merged = {**S3_DEFAULTS, **opts}
        merged["config_kwargs"] = {**S3_DEFAULTS["config_kwargs"], **opts.get("config_kwargs", {})}
        opts = merged
    try:
        fsspec.get_filesystem_class(s)
    except (ImportError, ValueError):
        return _arrow_fs_wrapper(loc, opts)
    try:
        fs = fsspec.filesystem(s, skip_instance_cache=True, **opts)
    except ImportError as exc:
        extra = EXTRAS.get(s, (None, None))[1]
        hint = f': pip install "varlen-cli[{extra}]"' if extra else ""
        raise InputError(f"reading {loc} needs a package that is not installed ({_first_line(exc)}){hint}") from None
    except TypeError as exc:
        raise UsageError(f"bad --storage-option for {s}://: {_first_line(exc)}") from None
    if s in ("s3", "s3a"):
        fs.retries = S3_CLIENT_RETRIES
    return fs


def _arrow_fs_wrapper(loc: str, opts: dict) -> Any:
    """A ``pyarrow.fs`` URI (``hdfs://``...) behind fsspec's interface."""
    import pyarrow.fs as pafs
    from fsspec.implementations.arrow import ArrowFSWrapper

    try:
        fs, _ = pafs.FileSystem.from_uri(loc)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError / NotImplementedError
        raise InputError(f"unsupported location {loc}: no fsspec or pyarrow filesystem ({_first_line(exc)})") from None
    if opts:
        raise UsageError(f"--storage-option is not supported for {scheme(loc)}:// (a pyarrow.fs URI)")
    return ArrowFSWrapper(fs)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- errors ------------------------------------------------------------------------------------------
_CREDENTIAL_WORDS = ("credential", "accessdenied", "access denied", "forbidden", "invalidaccesskeyid",
                     "signaturedoesnotmatch", "unauthorized", "401", "403")
_UNREACHABLE_WORDS = ("connect", "timeout", "timed out", "name or service not known", "unreachable",
                      "connection refused", "could not resolve", "nodename nor servname")


def describe_error(loc: str, exc: BaseException) -> str:
    """One line saying what went wrong reaching ``loc`` (missing, denied, unreachable...)."""
    text = _first_line(exc)
    low = f"{type(exc).__name__} {text}".lower()
    if isinstance(exc, FileNotFoundError) or "nosuchbucket" in low or "nosuchkey" in low or "404" in low:
        what = "bucket" if "nosuchbucket" in low or "bucket" in low and "not exist" in low else "object"
        return f"{loc} does not exist (no such {what})"
    if "nocredentials" in low or "unable to locate credentials" in low:
        return (f"no credentials for {loc}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the store's own "
                "variables), or pass --storage-option")
    if isinstance(exc, PermissionError) or any(w in low for w in _CREDENTIAL_WORDS):
        return f"access to {loc} was denied (check the credentials and permissions): {text}"
    if any(w in low for w in _UNREACHABLE_WORDS):
        return f"cannot reach {loc}: {text}"
    return f"cannot read {loc}: {text}"


@contextmanager
def translate_errors(loc: str, write: bool = False) -> Iterator[None]:
    """Turn a client's exception for ``loc`` into one InputError (OutputError when ``write``) line."""
    try:
        yield
    except VarlenError:
        raise
    except Exception as exc:  # noqa: BLE001 - clients raise botocore/aiohttp/OSError types; one line each
        message = describe_error(loc, exc)
        if write:
            raise OutputError(message.replace("cannot read", "cannot write")) from None
        raise InputError(message) from None


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
    fs, path = filesystem(loc, options)
    with translate_errors(loc):
        fs.invalidate_cache(path)  # what the store says now, not a listing cached earlier
        return _info_from_fsspec(loc, fs.info(path))


def exists(loc: str, options: Options = None) -> bool:
    if not is_remote(loc):
        return os.path.lexists(local_path(loc))
    fs, path = filesystem(loc, options)
    with translate_errors(loc):
        return bool(fs.exists(path)) or bool(fs.isdir(path))


def isdir(loc: str, options: Options = None) -> bool:
    if not is_remote(loc):
        return os.path.isdir(local_path(loc))
    fs, path = filesystem(loc, options)
    with translate_errors(loc):
        return bool(fs.isdir(path))


def isfile(loc: str, options: Options = None) -> bool:
    if not is_remote(loc):
        return os.path.isfile(local_path(loc))
    fs, path = filesystem(loc, options)
    with translate_errors(loc):
        return bool(fs.isfile(path))


def _as_loc(loc: str, fs: Any, path: str) -> str:
    """A path fsspec returned, as a URL with ``loc``'s scheme."""
    head = _split(loc)[0]
    return path if "://" in path else head + path.lstrip("/") if head != "file://" else path


def find(prefix: str, options: Options = None) -> list[str]:
    """Every file below ``prefix`` (a folder or key prefix ending in ``/``), recursively, sorted."""
    if not is_remote(prefix):
        root = local_path(prefix)
        return sorted(os.path.join(d, f) for d, _, files in os.walk(root, followlinks=True) for f in files)
    fs, path = filesystem(prefix, options)
    with translate_errors(prefix):
        found = fs.find(path.rstrip("/"), withdirs=False)
    return sorted(_as_loc(prefix, fs, p) for p in found)


def glob(pattern: str, options: Options = None) -> list[str]:
    """The locations matching ``pattern`` (``*``, ``?``, ``[..]``, ``**`` recursive), sorted."""
    if not is_remote(pattern):
        import glob as glob_mod

        return sorted(glob_mod.glob(local_path(pattern), recursive=True))
    fs, path = filesystem(pattern, options)
    with translate_errors(pattern):
        found = fs.glob(path)
    return sorted(_as_loc(pattern, fs, p) for p in found)


def open_input(loc: str, options: Options = None, block_size: int = 1 << 20):
    """A seekable binary file; remote reads are range requests of ``block_size`` (no download)."""
    if not is_remote(loc):
        try:
            return open_regular(local_path(loc), "rb")  # a FIFO or a device is refused, never read
        except OSError as exc:
            raise InputError(f"{loc} is not readable: {exc.strerror}") from None
    fs, path = filesystem(loc, options)
    with translate_errors(loc):
        return fs.open(path, "rb", block_size=block_size, cache_type="readahead")


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
    fs, path = filesystem(loc, options)
    with translate_errors(loc):
        return fs.cat_file(path, start=start, end=stop)


def read_bytes(loc: str, options: Options = None) -> bytes:
    """The whole object (manifests, ``state.json``: small files)."""
    if not is_remote(loc):
        try:
            with open_regular(local_path(loc), "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise InputError(f"{loc} is not readable: {exc.strerror}") from None
    fs, path = filesystem(loc, options)
    with translate_errors(loc):
        return fs.cat_file(path)


def arrow_filesystem(loc: str, options: Options = None) -> tuple[Any, str]:
    """``(pyarrow.fs.FileSystem, path)`` for Arrow/Parquet readers (local: ``LocalFileSystem``)."""
    import pyarrow.fs as pafs

    if not is_remote(loc):
        return pafs.LocalFileSystem(), os.path.abspath(local_path(loc))
    fs, path = filesystem(loc, options)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def parquet_file(loc: str, options: Options = None, size: int | None = None, metadata=None):
    """A ``pyarrow.parquet.ParquetFile``; remote: the footer and each row group by range requests.
    ``metadata`` (from :func:`parquet_footer`): the footer is not read again."""
    import pyarrow.parquet as pq

    if not is_remote(loc):
        check_regular(local_path(loc))
        return pq.ParquetFile(local_path(loc), metadata=metadata)
    fs, path = filesystem(loc, options)
    with translate_errors(loc):
        # No read-ahead cache: pyarrow asks for exactly the footer and the column chunks it needs,
        # each one range request (s3fs's default 50 MB read-ahead would fetch whole files).
        kwargs = {"size": size} if size is not None and scheme(loc) in ("s3", "s3a") else {}
        return pq.ParquetFile(fs.open(path, "rb", cache_type="none", **kwargs), metadata=metadata)


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
        raise InputError(f"cannot read Parquet file {loc}: {_first_line(exc)}") from None
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
    fs, path = filesystem(loc, options)
    with translate_errors(loc, write=True):
        fs.pipe_file(path, data)


def put_file(local: str, loc: str, options: Options = None) -> None:
    """Upload the local file ``local`` to ``loc``."""
    fs, path = filesystem(loc, options)
    with translate_errors(loc, write=True):
        fs.put_file(local, path)


def remove(loc: str, recursive: bool = False, options: Options = None) -> None:
    fs, path = filesystem(loc, options)
    with translate_errors(loc, write=True):
        if recursive:
            found = fs.find(path.rstrip("/"), withdirs=False)
            if found:
                fs.rm(found)
        else:
            fs.rm_file(path)
