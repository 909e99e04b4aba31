"""The landing store: where segments and snapshot files land. A local directory or S3 (boto3).

Both implement the same small interface over *keys* (``/``-separated relative paths):
``put`` (atomic: a reader sees the whole object or nothing), ``get``, ``exists``, ``list``,
``delete`` and ``uri``. Objects are immutable by convention: `put_if_absent` refuses to replace
an object with different bytes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator, Protocol
from urllib.parse import unquote, urlsplit

from tidemark.errors import TidemarkError


class Store(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> str: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> Iterator[str]: ...
    def delete(self, key: str) -> None: ...
    def uri(self, key: str) -> str: ...


def put_if_absent(store: "Store", key: str, data: bytes) -> tuple[str, bool]:
    """Write ``key`` unless it exists. Returns (uri, written). An existing object with other bytes
    is an error: landed files are immutable."""
    if store.exists(key):
        if store.get(key) != data:
            raise TidemarkError(f"{store.uri(key)} already exists with different content; "
                                "landed files are immutable (move it aside to inspect it)")
        return store.uri(key), False
    return store.put(key, data), True


class LocalStore:
    """A directory. Writes go to a temporary file in the same directory, fsync'd, then renamed."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root not in p.parents and p != self.root:
            raise TidemarkError(f"key {key!r} escapes the landing directory {self.root}")
        return p

    def put(self, key: str, data: bytes) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix="-" + path.name)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return self.uri(key)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise TidemarkError(f"{self.uri(key)} does not exist") from None

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
    """An S3 bucket and prefix, through boto3. ``endpoint_url`` serves S3-compatible stores.

    Credentials come from the environment (AWS_ACCESS_KEY_ID, ...), boto3's usual chain, or the
    Airflow connection the plugin resolves; never from configuration files in the repository.
    """

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None, client=None):
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise TidemarkError(f"{url!r} is not an s3://bucket/prefix URL")
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.url = url.rstrip("/")
        self.endpoint_url = endpoint_url or os.environ.get("TIDEMARK_S3_ENDPOINT_URL")
        self.region = region
        if client is None:
            import boto3

            client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name=region)
        self.client = client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)  # one PUT: atomic
        return self.uri(key)

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise TidemarkError(f"{self.uri(key)} does not exist") from None

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def list(self, prefix: str) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        full = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
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
    return {"segments": f"{stream}/segments/", "snapshots": f"{stream}/snapshots/", "changelog": f"{stream}/changelog/"}
