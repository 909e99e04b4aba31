"""The landing store: where segments and snapshot files land. A local directory or S3 (boto3).

Both implement the same small interface over *keys* (``/``-separated relative paths):
``put`` (atomic: a reader sees the whole object or nothing), ``get``, ``exists``, ``list``,
``delete`` and ``uri``. Objects are immutable by convention: `put_if_absent` refuses to replace
an object with different bytes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Protocol
from urllib.parse import unquote, urlsplit

from tidemark.errors import NoSpace, TidemarkError, free_bytes
from tidemark.landing.segment_format import segment_name


class StoreFull(NoSpace):
    """The landing store (or the spill directory before an upload) has no space for a file: names
    where, the file and how many bytes it needed at least; nothing of it was published. Not retried
    as transient (`tidemark.failures.is_transient`): it fails the same way until space is freed."""

    remedy = "free space there or point landing.url elsewhere, then run again"


def _full(exc: OSError, where: str, key: str, needed: int | None) -> StoreFull | None:
    """A `StoreFull` for an ENOSPC/EDQUOT ``exc`` (else None)."""
    if exc.errno not in NoSpace.ERRNOS:
        return None
    free = free_bytes(where)
    need = f"at least {needed:,} bytes" if needed else "more space"
    return StoreFull(f"landing store {where}: no space left for {key} (it needs {need}"
                     + (f"; {free:,} bytes free" if free is not None else "") + f"); {StoreFull.remedy}: "
                     "nothing of it was published or registered")


class Store(Protocol):
    url: str

    def put(self, key: str, data: bytes, *, durable: bool = True) -> str: ...
    def create(self, key: str, data: bytes) -> bool: ...
    def put_file(self, key: str, path: str) -> str: ...
    def sha256(self, key: str) -> str: ...
    def get(self, key: str) -> bytes: ...
    def get_range(self, key: str, offset: int, size: int) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> Iterator[str]: ...
    def delete(self, key: str) -> None: ...
    def uri(self, key: str) -> str: ...


def put_if_absent(store: "Store", key: str, data: bytes) -> tuple[str, bool]:
    """Write ``key`` unless it exists, atomically (`Store.create`: of two writers exactly one writes,
    the other finds the winner's bytes). Returns (uri, written). An existing object with other bytes
    is an error: landed files are immutable."""
    if store.create(key, data):
        return store.uri(key), True
    if store.get(key) != data:
        raise _immutable(store, key)
    return store.uri(key), False


def _immutable(store: "Store", key: str) -> TidemarkError:
    return TidemarkError(f"{store.uri(key)} already exists with different content; "
                         "landed files are immutable (move it aside to inspect it)")


class _Hashing:
    """A write-only file object that counts and hashes what passes through it."""

    def __init__(self, fh: BinaryIO):
        self.fh = fh
        self.size = 0
        self.hash = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.size += len(data)
        self.hash.update(data)
        return self.fh.write(data)


def put_stream_if_absent(store: "Store", key: str, write: Callable[[BinaryIO], None]) -> tuple[str, bool, int, str]:
    """Write ``key`` from ``write(fileobj)`` unless it exists, through a temporary file (beside the
    target for a local store, to be linked; in ``$TIDEMARK_SPILL_DIR`` or the system's temporary
    directory for S3, to be uploaded with `S3Store.put_file`). Returns (uri, written, size, sha256). An
    existing object with other bytes is an error: landed files are immutable."""
    if isinstance(store, LocalStore):
        tmp_dir = store.local_path(key).parent
        tmp_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp_dir = os.environ.get("TIDEMARK_SPILL_DIR") or None
    out = None
    try:
        fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix=".tmp-", suffix="-" + key.rsplit("/", 1)[-1])
    except OSError as exc:
        raise _full(exc, str(tmp_dir or tempfile.gettempdir()), key, None) or exc
    try:
        try:
            with os.fdopen(fd, "wb") as raw:
                out = _Hashing(raw)
                write(out)
                raw.flush()
                os.fsync(raw.fileno())
        except OSError as exc:
            raise _full(exc, str(tmp_dir or tempfile.gettempdir()), key, out.size if out else None) or exc
        digest = out.hash.hexdigest()
        try:
            if not store.exists(key):
                return store.put_file(key, tmp), True, out.size, digest
        except FileExistsError:       # written meanwhile by someone else: the same bytes or an error
            pass
        if store.sha256(key) != digest:
            raise _immutable(store, key) from None
        return store.uri(key), False, out.size, digest
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _sha256_stream(read: Callable[[int], bytes]) -> str:
    h = hashlib.sha256()
    while chunk := read(8 << 20):
        h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_or_rename(tmp: str, target: Path) -> None:
    """Publish ``tmp`` as ``target``, never replacing it (`FileExistsError`): a hard link, or where
    there are none a rename once ``target`` is found absent."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise
    except OSError:          # no hard links here: refuse to replace, then rename
        if target.exists():
            raise FileExistsError(str(target)) from None
        os.replace(tmp, target)


class LocalStore:
    """A directory. Writes go to a temporary file in the same directory, fsync'd (unless the object is
    a run's intermediate one, ``durable=False``: lost with a crash, it is made again), then renamed."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root not in p.parents and p != self.root:
            raise TidemarkError(f"key {key!r} escapes the landing directory {self.root}")
        return p

    def _write(self, key: str, write: Callable, publish: Callable, *, durable: bool = True,
               size: int | None = None):
        """``publish(tmp, path)`` of a temporary file beside ``key``'s path written by ``write(fh)``
        (fsync'd unless not ``durable``), and what it returns; the temporary file never stays, and a
        full file system is `StoreFull`."""
        path = self._path(key)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix="-" + path.name)
            with os.fdopen(fd, "wb") as fh:
                write(fh)
                if durable:
                    fh.flush()
                    os.fsync(fh.fileno())
            return publish(tmp, path)
        except OSError as exc:
            full = _full(exc, str(self.root), key, size)
            if full is not None:
                raise full from exc
            raise
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def put(self, key: str, data: bytes, *, durable: bool = True) -> str:
        self._write(key, lambda fh: fh.write(data), os.replace, durable=durable, size=len(data))
        return self.uri(key)

    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` durably unless it exists, atomically (a hard link of a complete temporary
        file: no reader sees it half written, and of two writers exactly one wins); whether written."""
        def link(tmp: str, path: Path) -> bool:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            _fsync_dir(path.parent)
            return True

        return self._write(key, lambda fh: fh.write(data), link, size=len(data))

    def put_file(self, key: str, path: str) -> str:
        """Publish a complete local file under ``key`` (a hard link when on the same file system,
        else a copy): never replaces an existing object (`FileExistsError`)."""
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except FileExistsError:
            raise
        except OSError:             # another file system: a copy
            def copy(out: BinaryIO) -> None:
                with open(path, "rb") as src:
                    while chunk := src.read(8 << 20):
                        out.write(chunk)

            self._write(key, copy, _link_or_rename)
        _fsync_dir(target.parent)
        return self.uri(key)

    def _open(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            raise TidemarkError(f"{self.uri(key)} does not exist") from None

    def sha256(self, key: str) -> str:
        with self._open(key) as fh:
            return _sha256_stream(fh.read)

    def get(self, key: str) -> bytes:
        with self._open(key) as fh:
            return fh.read()

    def get_range(self, key: str, offset: int, size: int) -> bytes:
        """``size`` bytes of ``key`` from ``offset``."""
        with self._open(key) as fh:
            fh.seek(offset)
            data = fh.read(size)
        if len(data) != size:
            raise TidemarkError(f"{self.uri(key)} ends before byte {offset + size}")
        return data

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def list(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.exists():
            return
        for dirpath, _, files in os.walk(base):
            for f in sorted(files):
                if f.startswith(".tmp-"):
                    continue
                yield str(Path(dirpath, f).relative_to(self.root))

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()

    def local_path(self, key: str) -> Path:
        return self._path(key)


class S3Store:
    """An S3 bucket and prefix, through boto3 (credentials: boto3's usual chain, or the Airflow
    connection the plugin resolves). ``endpoint_url`` serves S3-compatible stores."""

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None):
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise TidemarkError(f"{url!r} is not an s3://bucket/prefix URL")
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.url = url.rstrip("/")
        self.endpoint_url = endpoint_url or os.environ.get("TIDEMARK_S3_ENDPOINT_URL")
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name=region)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes, *, durable: bool = True) -> str:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)  # one PUT: atomic
        return self.uri(key)

    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` unless it exists: one conditional PUT (``If-None-Match: *``; 412 when it
        exists, 409 while another PUT of it is in flight: asked again); whether written."""
        for attempt in range(20):
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
                return True
            except self.client.exceptions.ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code in ("PreconditionFailed", "412"):
                    return False
                if code != "ConditionalRequestConflict" or attempt == 19:
                    raise
                time.sleep(0.05 * (attempt + 1))

    TRANSFER_CHUNK = 64 << 20      # multipart above this size, in parts of this size

    def put_file(self, key: str, path: str) -> str:
        """Upload a local file with boto3's managed transfer (multipart for large files; S3 shows the
        object only once the upload completes, so a reader never sees part of it)."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=self.TRANSFER_CHUNK, multipart_chunksize=self.TRANSFER_CHUNK,
                                max_concurrency=4, use_threads=True)
        self.client.upload_file(path, self.bucket, self._key(key), Config=config)
        return self.uri(key)

    def _body(self, key: str, **kwargs):
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key), **kwargs)["Body"]
        except self.client.exceptions.NoSuchKey:
            raise TidemarkError(f"{self.uri(key)} does not exist") from None

    def sha256(self, key: str) -> str:
        return _sha256_stream(self._body(key).read)

    def get(self, key: str) -> bytes:
        return self._body(key).read()

    def get_range(self, key: str, offset: int, size: int) -> bytes:
        """``size`` bytes of ``key`` from ``offset`` (one ranged GET)."""
        body = self._body(key, Range=f"bytes={offset}-{offset + size - 1}").read()
        if len(body) != size:
            raise TidemarkError(f"{self.uri(key)} ends before byte {offset + size}")
        return body

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except self.client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def list(self, prefix: str) -> Iterator[str]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
            for obj in page.get("Contents", []):
                yield obj["Key"][strip:]

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"


def open_store(url: str, *, endpoint_url: str | None = None, region: str | None = None) -> Store:
    """Open the store for a landing URL: ``s3://...`` → `S3Store`; a path or ``file://`` → `LocalStore`."""
    if url.startswith("s3://"):
        return S3Store(url, endpoint_url=endpoint_url, region=region)
    if url.startswith("file://"):
        return LocalStore(file_uri_path(url))
    return LocalStore(url)


def landing_store(cfg) -> Store:
    """The landing store of a stream (``cfg``: its `tidemark.config.StreamConfig`): the one way every
    part of Tidemark opens it."""
    land = cfg.landing
    return open_store(land.url, endpoint_url=land.endpoint_url, region=land.region)


def probe_store(store: Store, stream: str) -> None:
    """Write a small probe object under the stream's prefix, read it back and delete it; raise
    `TidemarkError` naming the store and the reason if any step fails (a landing store that cannot be
    written is found when the stream is applied, not by the first snapshot or drain)."""
    # named like a temporary file: a probe a kill left behind is never listed as a segment
    key = f"{stream}/.tmp-probe-{os.getpid()}-{secrets.token_hex(4)}"
    data = b"tidemark landing store probe\n"
    step = "writing"
    try:
        store.put(key, data)
        step = "reading back"
        if store.get(key) != data:
            raise TidemarkError("the object read back differs from the one written")
        step = "deleting"
        store.delete(key)
    except Exception as exc:  # noqa: BLE001 - OSError, botocore's errors, ...: all mean "not usable"
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, TidemarkError):
            reason = f"{type(exc).__name__}: {reason}"
        raise TidemarkError(f"stream {stream}: the landing store {store.url} cannot be used: {step} a probe "
                            f"object ({key}) failed: {reason}; fix landing.url (and landing.endpoint_url, "
                            "credentials, permissions, free space) and apply again") from exc


def read_uri(uri: str, *, endpoint_url: str | None = None) -> bytes:
    """Read a whole object by URI (``file://`` or ``s3://``); used by executors reading segments."""
    if uri.startswith("s3://"):
        parts = urlsplit(uri)
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint_url or os.environ.get("TIDEMARK_S3_ENDPOINT_URL"))
        return client.get_object(Bucket=parts.netloc, Key=parts.path.lstrip("/"))["Body"].read()
    return Path(file_uri_path(uri)).read_bytes()


def file_uri_path(uri: str) -> str:
    """The local path of a ``file://`` URI (percent-decoded, as `Path.as_uri` encodes it), or ``uri``."""
    return unquote(urlsplit(uri).path) if uri.startswith("file://") else uri


def stream_keys(stream: str) -> dict[str, str]:
    """Key prefixes of one stream's landing area."""
    return {"segments": f"{stream}/segments/", "snapshots": f"{stream}/snapshots/", "changelog": f"{stream}/changelog/",
            "decoded": f"{stream}/_decoded/"}


def segment_key(stream: str, seq: int, lower: int, upper: int) -> str:
    """The landing key of a segment: ``{stream}/segments/{segment_name}``."""
    return stream_keys(stream)["segments"] + segment_name(seq, lower, upper)
