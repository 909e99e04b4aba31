"""Helpers for the gap, sweep and status tests: a stream over a real source with a real slot, and
segments built with `SegmentBuilder` and registered by hand (or drained, where the drain exists)."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg2

from tidemark.control import Control, Segment
from tidemark.gaps import landing_store, segment_key
from tidemark.pgtypes import TableSchema, table_schema_from_catalog
from tidemark.landing.segments import SegmentBuilder, Update, checksum
from tidemark.control import control_dsn
from tidemark.capture.source import apply_stream, connect_source


def create_items(conn) -> None:
    """Create ``public.items(id int primary key, v text)`` in the source."""
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")


def start_stream(cfg) -> int:
    """Register the stream, create its slot with SQL, and set the consistent point; return it."""
    apply_stream(cfg)
    conn = connect_source(cfg)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT (lsn - '0/0'::pg_lsn)::numeric::bigint "
                        "FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (cfg.source.slot,))
            lsn = cur.fetchone()[0]
    finally:
        conn.close()
    with Control(control_dsn(cfg)) as ctl:
        ctl.update_stream(cfg.stream, consistent_lsn=lsn, landed_upper=lsn, state="streaming")
    return lsn


def items_schema(cfg) -> TableSchema:
    conn = connect_source(cfg)
    try:
        return table_schema_from_catalog(conn, "public", "items")
    finally:
        conn.close()


@dataclass
class Built:
    seq: int
    lower: int
    upper: int
    key: str
    data: bytes
    segment: Segment


def build_segment(cfg, table: TableSchema, seq: int, lower: int, upper: int, ids: list[int]) -> Built:
    """Build a segment with one transaction per id (commit times spread inside ``[lower, upper)``)."""
    b = SegmentBuilder(cfg.stream, seq, lower)
    for i, ident in enumerate(ids):
        t = lower + i
        b.add_transaction([Update(table=table, row={"id": ident, "v": f"v{ident}"}, time=t, diff=1, xid=1000 + ident,
                                  position=0, commit_ts=1_700_000_000_000_000 + t)])
    data = b.build(upper)
    key = segment_key(cfg.stream, seq, lower, upper)
    uri = landing_store(cfg).uri(key)
    seg = Segment(cfg.stream, seq, lower, upper, uri, b.records, b.txns, len(data), checksum(data))
    return Built(seq, lower, upper, key, data, seg)


def land(cfg, built: Built, *, register: bool = True) -> None:
    """Write a built segment to the landing store and (optionally) register it."""
    landing_store(cfg).put(built.key, built.data)
    if register:
        with Control(control_dsn(cfg)) as ctl:
            ctl.register_segment(built.segment)


def land_chain(cfg, table: TableSchema, start: int, n: int, *, width: int = 100) -> list[Built]:
    """Land and register ``n`` contiguous segments from ``start``, 2 rows each."""
    out = []
    for seq in range(n):
        lower = start + seq * width
        built = build_segment(cfg, table, seq, lower, lower + width, [seq * 10 + 1, seq * 10 + 2])
        land(cfg, built)
        out.append(built)
    return out


def delete_row(cfg, seq: int) -> None:
    """Remove one segment from the manifest (simulates a lost registration)."""
    conn = psycopg2.connect(control_dsn(cfg))
    try:
        with conn, conn.cursor() as cur:
            cur.execute("DELETE FROM tidemark.segments WHERE stream = %s AND seq = %s", (cfg.stream, seq))
    finally:
        conn.close()


def manifest_state(cfg) -> tuple:
    """Everything gap handling may change, for "a second run changes nothing" checks."""
    conn = psycopg2.connect(control_dsn(cfg))
    try:
        with conn.cursor() as cur:
            cur.execute("""SELECT seq, lower_lsn, upper_lsn, uri, checksum, status, origin FROM tidemark.segments
                            WHERE stream = %s ORDER BY seq""", (cfg.stream,))
            segs = cur.fetchall()
            cur.execute("""SELECT id, kind, detail::text, resolved_at IS NULL FROM tidemark.incidents
                            WHERE stream = %s ORDER BY id""", (cfg.stream,))
            incidents = cur.fetchall()
            cur.execute("""SELECT consistent_lsn, landed_upper, frontier, next_seq, state FROM tidemark.streams
                            WHERE name = %s""", (cfg.stream,))
            stream = cur.fetchone()
    finally:
        conn.close()
    return segs, incidents, stream


def landing_files(cfg) -> dict[str, str]:
    """key -> sha256 of every file in the stream's landing area."""
    store = landing_store(cfg)
    return {k: checksum(store.get(k)) for k in sorted(store.list(f"{cfg.stream}/"))}
