"""The decoded rows (`decoded_arrow_schema`, `DECODED_DDL`; their kinds: docs/internals/batch.md), the
meta columns of a decoded part, and the run's work area in the landing store that holds the parts
(`Work`, `put_parts`, `read_parts`, `SpilledParts`)."""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

from tidemark.lake.layout import ddl_schema
from tidemark.landing.store import open_store

META_TIME, META_POS, META_DIFF, META_FULL, META_UNKNOWN, META_XID, META_CTS = (
    "_tm_time", "_tm_pos", "_tm_diff", "_tm_full", "_tm_unknown", "_tm_xid", "_tm_cts")
META_COLUMNS = (META_TIME, META_POS, META_DIFF, META_FULL, META_UNKNOWN, META_XID, META_CTS)
# a re-snapshot's rows come as inserts at its LSN with this position (before any change committed at
# that LSN, after the truncate at RELOAD_POSITION - 1): synthetic records, each one kept (not deduped)
RELOAD_POSITION = -1

# the decoded rows' columns, as Spark's DDL names their types (Arrow: `decoded_arrow_schema`)
DECODED_DDL = ("kind string, seg string, table string, time long, position int, rhash long, count long, "
               "payload binary, info string, bucket int, offset long, size long")


def decoded_arrow_schema(columns: int | None = None):
    """The Arrow schema of the decoded rows (of their first ``columns`` columns)."""
    return pa.schema(list(ddl_schema(DECODED_DDL))[:columns])


def decoded_columns() -> dict[str, list]:
    """Empty columns of decoded rows (`decoded_arrow_schema`), filled by `add_rows`."""
    return {k: [] for k in decoded_arrow_schema().names}


def add_rows(out: dict[str, list], n: int, kind: str, seg: str, **values) -> None:
    """Append ``n`` decoded rows of ``kind`` from ``seg`` to the columns ``out`` (`decoded_columns`):
    each of ``values`` a list of ``n`` values or one for every row; the columns not given null."""
    values.update(kind=kind, seg=seg)
    for k, column in out.items():
        v = values.get(k)
        column.extend(v if isinstance(v, list) else [v] * n)


def meta_arrow_fields():
    return [pa.field(META_TIME, pa.int64()), pa.field(META_POS, pa.int32()), pa.field(META_DIFF, pa.int64()),
            pa.field(META_FULL, pa.bool_()), pa.field(META_UNKNOWN, pa.list_(pa.string())),
            pa.field(META_XID, pa.int64()), pa.field(META_CTS, pa.int64())]


@dataclass(frozen=True)
class Work:
    """One consolidation run's work area in the landing store (every node reaches it): an object per
    decoded segment (or cut source), ``<prefix><name>.parts``, holding its parts one after another,
    each an Arrow IPC stream. Deleted when the run ends, or by the next run (`discard`)."""

    store: tuple                 # (url, endpoint_url, region) of the landing store
    prefix: str                  # ``<stream>/_decoded/<run>-``

    def open(self):
        url, endpoint, region = self.store
        return open_store(url, endpoint_url=endpoint, region=region)

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}.parts"

    def discard(self, prefix: str | None = None) -> None:
        """Delete this run's objects (``prefix``: every object under it, e.g. the stream's area)."""
        store = self.open()
        for key in list(store.list(prefix or self.prefix.rsplit("/", 1)[0] + "/")):
            if prefix is not None or key.startswith(self.prefix):
                store.delete(key)


def _parts_out(cols: dict, write: Callable[[bytes], object], pos: int = 0) -> int:
    """Hand the ``data`` and ``ids`` rows' payloads of decoded columns to ``write`` one after another
    from byte ``pos``, each row then holding its part's ``offset`` and ``size``; the byte after them."""
    for i, kind in enumerate(cols["kind"]):
        if kind not in ("data", "ids"):
            continue
        blob = cols["payload"][i]
        cols["offset"][i], cols["size"][i], cols["payload"][i] = pos, len(blob), None
        write(blob)
        pos += len(blob)
    return pos


def put_parts(store, key: str, cols: dict) -> None:
    """Write the ``data`` and ``ids`` rows' payloads of decoded columns as the object ``key`` (`_parts_out`)."""
    blobs: list[bytes] = []
    _parts_out(cols, blobs.append)
    if blobs:
        store.put(key, b"".join(blobs), durable=False)     # the run's own: lost with a crash, decoded again


def read_parts(store, work: Work, parts: list) -> list[bytes]:
    """The bytes of ``parts`` (``(name, offset, size)``: a part of the object ``work.key(name)``), one
    ranged read each (from S3 a few at a time)."""
    if len(parts) < 2 or hasattr(store, "local_path"):
        return [store.get_range(work.key(n), o, z) for n, o, z in parts]
    with ThreadPoolExecutor(min(8, len(parts))) as pool:
        return list(pool.map(lambda p: store.get_range(work.key(p[0]), p[1], p[2]), parts))


class SpilledParts:
    """The parts of a segment decoded in several pieces, written one piece at a time to a local
    temporary file (``$TIDEMARK_SPILL_DIR`` or the system's), then put as the segment's object."""

    def __init__(self, store, key: str):
        self.store, self.key, self.pos = store, key, 0
        self.file = tempfile.NamedTemporaryFile(dir=os.environ.get("TIDEMARK_SPILL_DIR") or None,
                                                prefix="tidemark-parts-", delete=False)

    def add(self, cols: dict) -> None:
        """Write the ``data`` and ``ids`` rows' payloads of ``cols`` after the others (`_parts_out`)."""
        self.pos = _parts_out(cols, self.file.write, self.pos)

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        try:
            self.file.close()
            if kind is None and self.pos:
                self.store.put_file(self.key, self.file.name)
        finally:
            os.unlink(self.file.name)


def ipc(table) -> bytes:
    """``table`` as one Arrow IPC stream, its buffers LZ4-compressed (any IPC reader reads them)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()

