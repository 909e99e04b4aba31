"""Helpers for consolidation tests: table shapes, segments built with SegmentBuilder and landed
(store + control manifest), and snapshot files written to the snapshot contract."""

from __future__ import annotations

import json
from collections import Counter

from tidemark.control import Control, Segment
from tidemark.pgtypes import Column, TableSchema, arrow_schema, lake_array
from tidemark.landing.segments import Event, SegmentBuilder, Update, checksum
from tidemark.landing.store import open_store, segment_key, stream_keys

TYPES = {"int16": ("int2", 21), "int32": ("int4", 23), "int64": ("int8", 20), "text": ("text", 25),
         "float64": ("float8", 701), "bool": ("bool", 16), "numeric": ("numeric", 1700), "date": ("date", 1082),
         "timestamp": ("timestamp", 1114), "timestamptz": ("timestamptz", 1184), "bytes": ("bytea", 17),
         "time": ("time", 1083)}


def shape(name: str, columns: list[tuple], *, schema: str = "public", oid: int = 16384,
          replica_identity: str = "d") -> TableSchema:
    """A table shape from ``(name, kind[, key[, typmod]])`` tuples."""
    cols = []
    for c in columns:
        cname, kind = c[0], c[1]
        key = c[2] if len(c) > 2 else False
        typmod = c[3] if len(c) > 3 else -1
        tname, toid = TYPES[kind]
        cols.append(Column(name=cname, kind=kind, type_name=tname, type_oid=toid, typmod=typmod, key=key,
                           nullable=not key))
    return TableSchema(schema=schema, name=name, oid=oid, columns=tuple(cols), replica_identity=replica_identity)


class Lander:
    """Build and land segments of one stream (store + manifest), the way the drain does."""

    def __init__(self, cfg, ctl: Control):
        self.cfg, self.ctl = cfg, ctl
        self.store = open_store(cfg.landing.url)
        self.next_seq = 0

    def build(self, lower: int, upper: int, txns: list, *, seq: int | None = None, extra_counts: dict | None = None) -> bytes:
        """Segment bytes for ``txns`` = list of (updates, events)."""
        b = SegmentBuilder(self.cfg.stream, self.next_seq if seq is None else seq, lower)
        for ups, evs in txns:
            b.add_transaction(list(ups), list(evs))
        for t, extra in (extra_counts or {}).items():
            b.counts[t] = b.counts.get(t, 0) + extra
        return b.build(upper)

    def land(self, lower: int, upper: int, txns: list, *, extra_counts: dict | None = None,
             data: bytes | None = None, origin: str = "drain") -> Segment:
        seq = self.next_seq
        self.next_seq += 1
        data = data if data is not None else self.build(lower, upper, txns, seq=seq, extra_counts=extra_counts)
        uri = self.store.put(segment_key(self.cfg.stream, seq, lower, upper), data)
        records = sum(len(u) + len(e) for u, e in txns)
        seg = Segment(stream=self.cfg.stream, seq=seq, lower=lower, upper=upper, uri=uri, record_count=records,
                      txn_count=len(txns), byte_size=len(data), checksum=checksum(data), origin=origin)
        self.ctl.register_segment(seg)
        return seg


def snapshot(cfg, ctl: Control, snapshot_id: str, lsn: int, tables: dict[str, tuple[TableSchema, list[dict]]],
             *, mode: str = "initial", rows_per_file: int = 1000) -> dict:
    """Write snapshot Parquet files + manifest for canonical rows, and record it 'complete'."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    store = open_store(cfg.landing.url)
    entries = {}
    for qualified, (schema, rows) in tables.items():
        files = []
        for n, i in enumerate(range(0, max(len(rows), 1), rows_per_file)):
            part = rows[i:i + rows_per_file]
            if not part and i:
                break
            t = pa.Table.from_arrays([lake_array(c, [r.get(c.name) for r in part]) for c in schema.columns],
                                     schema=arrow_schema(schema))
            buf = io.BytesIO()
            pq.write_table(t, buf)
            key = f"{stream_keys(cfg.stream)['snapshots']}{snapshot_id}/{qualified}/chunk-{n:06d}.parquet"
            store.put(key, buf.getvalue())
            files.append(key)
        entries[qualified] = {"rows": len(rows), "files": files, "table_schema": schema.to_json()}
    manifest = {"snapshot_id": snapshot_id, "stream": cfg.stream, "lsn": lsn, "mode": mode, "tables": entries}
    store.put(f"{stream_keys(cfg.stream)['snapshots']}{snapshot_id}/manifest.json", json.dumps(manifest).encode())
    with ctl.tx() as cur:
        cur.execute("""INSERT INTO tidemark.snapshots (stream, snapshot_id, lsn, mode, status, tables, finished_at)
                       VALUES (%s, %s, %s, %s, 'complete', %s, now())""",
                    (cfg.stream, snapshot_id, lsn, mode, json.dumps(entries)))
    ctl.update_stream(cfg.stream, consistent_lsn=lsn, landed_upper=lsn)
    return manifest


def up(table: TableSchema, row: dict, time: int, diff: int, position: int, *, xid: int | None = None,
       image: str = "full", toast: tuple = ()) -> Update:
    return Update(table=table, row=row, time=time, diff=diff, xid=xid if xid is not None else time,
                  position=position, commit_ts=1_700_000_000_000_000 + time, image=image, unchanged_toast=toast)


def truncate(table: TableSchema, time: int, position: int) -> Event:
    return Event(kind="truncate", table=table.qualified, time=time, xid=time, position=position,
                 commit_ts=1_700_000_000_000_000 + time, detail={"cascade": False, "restart_identity": False})


def rows_counter(arrow_table) -> Counter:
    return Counter(tuple(r.values()) for r in arrow_table.to_pylist())
