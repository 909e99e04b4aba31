"""Segment decoding inside Spark executors (``mapInArrow`` over segment URIs).

One pass over the segments yields a small "decoded" DataFrame of rows of a few kinds:

* ``rec``  — one per record (update or event): ``time``, ``position``, ``rhash`` (a hash of the
  record's content, so two different records claiming the same identity are caught);
* ``cnt``  — one per ``{time, count}`` of a progress record;
* ``seg``  — one per segment (``info`` = JSON ``{seq, lower, upper}``);
* ``evt``  — one per event (truncate), with ``info`` = JSON ``{kind, detail}``;
* ``data`` — one per (segment, table shape): ``payload`` is an Arrow IPC stream of that shape's
  updates in lake types plus ``_tm_*`` meta columns; ``info`` is the shape (`TableSchema.to_json`);
  ``time`` the newest record's time; ``count`` the number of ``+1`` with unchanged TOAST values.

`expand_payloads` then turns one table's ``data`` rows into a typed DataFrame of changes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator

META_TIME, META_POS, META_DIFF, META_FULL, META_UNKNOWN, META_XID, META_CTS = (
    "_tm_time", "_tm_pos", "_tm_diff", "_tm_full", "_tm_unknown", "_tm_xid", "_tm_cts")
META_COLUMNS = (META_TIME, META_POS, META_DIFF, META_FULL, META_UNKNOWN, META_XID, META_CTS)

DECODED_DDL = ("kind string, seg string, table string, time long, position int, rhash long, "
               "count long, payload binary, info string")


def meta_arrow_fields():
    import pyarrow as pa

    return [pa.field(META_TIME, pa.int64()), pa.field(META_POS, pa.int32()), pa.field(META_DIFF, pa.int64()),
            pa.field(META_FULL, pa.bool_()), pa.field(META_UNKNOWN, pa.list_(pa.string())),
            pa.field(META_XID, pa.int64()), pa.field(META_CTS, pa.int64())]


def _rhash(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _payload(seg_name: str, shape, updates: list) -> bytes:
    """Arrow IPC bytes of one table shape's updates (lake types + meta columns)."""
    import pyarrow as pa

    from tidemark.errors import SegmentError
    from tidemark.pgtypes import lake_array

    keys = set(shape.key_columns)
    arrays = [pa.array([u.time for u in updates], pa.int64()), pa.array([u.position for u in updates], pa.int32()),
              pa.array([u.diff for u in updates], pa.int64()), pa.array([u.image == "full" for u in updates]),
              pa.array([_unknown(u, keys) for u in updates], pa.list_(pa.string())),
              pa.array([u.xid for u in updates], pa.int64()), pa.array([u.commit_ts for u in updates], pa.int64())]
    fields = meta_arrow_fields()
    for col in shape.columns:
        try:
            arrays.append(lake_array(col, [u.row.get(col.name) for u in updates]))
        except (ValueError, TypeError, OverflowError, ArithmeticError) as exc:
            raise SegmentError(seg_name, f"table {shape.qualified} column {col.name}: {exc}") from exc
        fields.append(pa.field(col.name, arrays[-1].type))
    table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _unknown(u, keys: set[str]) -> list[str]:
    """Columns whose value this update does not carry (unchanged TOAST, or not in a key image)."""
    if u.image == "key":
        return [c.name for c in u.table.columns if c.name not in keys]
    return list(u.unchanged_toast)


def decode_segment(uri: str, data: bytes) -> dict[str, list]:
    """Decode one segment's bytes into columns of the decoded DataFrame (see module doc)."""
    from tidemark.landing.segments import read_segment

    name = uri.rsplit("/", 1)[-1]
    content = read_segment(data, name)
    out: dict[str, list] = {k: [] for k in ("kind", "seg", "table", "time", "position", "rhash", "count",
                                            "payload", "info")}

    def row(kind, table=None, time=None, position=None, rhash=None, count=None, payload=None, info=None):
        for k, v in (("kind", kind), ("seg", name), ("table", table), ("time", time), ("position", position),
                     ("rhash", rhash), ("count", count), ("payload", payload), ("info", info)):
            out[k].append(v)

    row("seg", info=json.dumps({"seq": content.seq, "lower": content.lower, "upper": content.upper,
                                "uri": uri}))
    for t, c in content.counts.items():
        row("cnt", time=t, count=c)
    by_shape: dict[str, list] = {}
    for u in content.updates:
        qualified = u.table.qualified
        row("rec", table=qualified, time=u.time, position=u.position,
            rhash=_rhash(qualified, u.diff, u.image, tuple(u.unchanged_toast), u.xid,
                         tuple(u.row.get(c.name) for c in u.table.columns)))
        by_shape.setdefault(u.table.record_name, []).append(u)
    for e in content.events:
        row("rec", table=e.table, time=e.time, position=e.position,
            rhash=_rhash(e.kind, e.table, e.xid, json.dumps(e.detail, sort_keys=True)))
        row("evt", table=e.table, time=e.time, position=e.position,
            info=json.dumps({"kind": e.kind, "detail": e.detail, "commit_ts": e.commit_ts}))
    for rname, updates in by_shape.items():
        shape = content.relations[rname]
        toasted = sum(1 for u in updates if u.diff > 0 and u.unchanged_toast)
        row("data", table=shape.qualified, time=max(u.time for u in updates), position=len(updates), count=toasted,
            payload=_payload(name, shape, updates), info=json.dumps(shape.to_json(), sort_keys=True))
    return out


def decode_partition(batches: Iterator, endpoint_url: str | None = None) -> Iterator:
    """``mapInArrow`` body: segment URIs in, decoded rows out."""
    import pyarrow as pa

    from tidemark.landing.store import read_uri

    schema = decoded_arrow_schema()
    for batch in batches:
        for uri in batch.column("uri").to_pylist():
            cols = decode_segment(uri, read_uri(uri, endpoint_url=endpoint_url))
            yield pa.RecordBatch.from_pydict(cols, schema=schema)


def decoded_arrow_schema():
    import pyarrow as pa

    return pa.schema([("kind", pa.string()), ("seg", pa.string()), ("table", pa.string()), ("time", pa.int64()),
                      ("position", pa.int32()), ("rhash", pa.int64()), ("count", pa.int64()),
                      ("payload", pa.binary()), ("info", pa.string())])


def expand_partition(batches: Iterator, target, table: str) -> Iterator:
    """``mapInArrow`` body: one table's ``data`` rows in, its changes (meta + target columns) out.

    Columns the target has and a payload lacks (added later) are null; columns a payload has and the
    target lacks (dropped since) are left out."""
    import pyarrow as pa

    from tidemark.errors import TidemarkError

    for batch in batches:
        for payload in batch.column("payload").to_pylist():
            part = pa.ipc.open_stream(payload).read_all()
            arrays = []
            for field in target:
                if field.name in part.column_names:
                    col = part.column(field.name)
                    if col.type != field.type:
                        try:
                            col = col.cast(field.type)
                        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                            raise TidemarkError(f"table {table} column {field.name}: type changed from {col.type} "
                                                f"to {field.type} ({exc}); re-snapshot the table (resend)") from exc
                    arrays.append(col)
                else:
                    arrays.append(pa.nulls(part.num_rows, field.type))
            out = pa.Table.from_arrays(arrays, schema=target)
            for b in out.to_batches():
                yield b
