"""External feeds: a stream without PostgreSQL, fed Materialize CDC files by another producer.

A stream with ``source: {kind: feed, tables: [schema.table, ...]}`` has no connection, publication
or slot. Its landing prefix ``STREAM/feed/TABLE/`` (``TABLE`` as in ``source.tables``, e.g.
``public.prices``) receives Avro files in the seed's format from any producer: arrays of updates
``{data, time, diff}`` and progress records ``{lower, upper, counts}``, in any files, in any order,
duplicated, late. Every file of a table carries the same ``data`` record (column names = field
names; the Avro types ``long int string double float boolean bytes``, each optionally in a union
with ``null``).

`ingest` (``tidemark feed ingest STREAM``; the drain's place for a feed) does, idempotently:

1. **register** each new file in ``tidemark.feed_files`` (checksum, update count and time range,
   its progress records). A file that is not such a feed file (not Avro, another shape, an unknown
   table, a count contradicting another file's) is moved to ``STREAM/quarantine/`` and recorded
   with the reason, and an incident ``feed_file_bad`` names it; a key whose bytes change is an error.
2. **dedup and complete** per table, by the format's rules: distinct ``(data, time, diff)`` count
   once; a table's frontier is the end of the progress that covers ``[0, …)`` contiguously, held at
   its first time whose count is not met (a time given up with `forget` counts as met by what came).
   **Each table has its own frontier**: one table waiting at an unmet time holds back only itself.
3. **land** each table's ``[its landed upper, its frontier)`` in one internal segment (one
   transaction per time, a ``diff = n`` as ``n`` records; feed tables are multisets: no key, like
   REPLICA IDENTITY FULL; positions ``table index << 24`` onwards, so a table landing a time later
   than another never collides with it), registered in the manifest with origin ``feed``, and record
   the table's landed upper in ``tidemark.table_frontiers``. The segment's ``[lower, upper)`` spans
   the tables' ranges, so segments of a feed may overlap. `consolidate_stream` then brings each
   table to its own landed upper (Delta table, changelog, feed files out) and records its frontier
   there; the stream's frontier is the least of its tables' (`tidemark.lake.read_tables` at it is
   one consistent state of every table).

A time whose count stays unmet longer than ``consolidate.count_timeout_seconds`` (from the first
registration of a file counting it) opens a ``counts_unmet`` incident that asks the producer to
resend that table's updates at that time; nothing can be re-drained. ``tidemark feed forget STREAM
TABLE TIME`` gives the time up: it is recorded in ``tidemark.feed_forgotten`` (expected and seen
counts, reason) and the updates that did arrive are taken. A late file whose updates are below the
landed upper is checked against the counts: duplicates are harmless, more distinct updates than
counted quarantine the file.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import time as _time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tidemark.config import StreamConfig
from tidemark.errors import TidemarkError

FEED_TYPES = {"long": ("int64", "int8", 20), "int": ("int32", "int4", 23), "string": ("text", "text", 25),
              "double": ("float64", "float8", 701), "float": ("float32", "float4", 700),
              "boolean": ("bool", "bool", 16), "bytes": ("bytes", "bytea", 17)}


class FeedError(TidemarkError):
    """A feed file or the feed itself cannot be used; names the stream, table, file and reason."""


def feed_prefix(stream: str, table: str | None = None) -> str:
    return f"{stream}/feed/" + (f"{table}/" if table is not None else "")


@dataclass
class IngestResult:
    stream: str
    registered: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    lower: int = 0
    upper: int = 0
    segment: int | None = None
    frontiers: dict[str, int] = field(default_factory=dict)
    unmet: list[dict] = field(default_factory=list)
    incident: int | None = None


# -- reading one file -----------------------------------------------------------------------------

def _plain_type(t: Any) -> str | None:
    """The Avro primitive of a field type (a union with null allowed), None if unsupported."""
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        return _plain_type(rest[0]) if len(rest) == 1 else None
    if isinstance(t, dict):
        return None if t.get("logicalType") else _plain_type(t.get("type"))
    return t if t in FEED_TYPES else None


def parse_feed_file(data: bytes, where: str) -> tuple[list[tuple[str, str]], list[dict], list[dict]]:
    """(columns [(name, avro type)], updates, progress records) of one feed file, or `FeedError`."""
    import fastavro

    try:
        reader = fastavro.reader(io.BytesIO(data), return_record_name=True)
        schema = reader.writer_schema
        records = list(reader)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a bad file, named
        raise FeedError(f"{where}: not a readable Avro file ({type(exc).__name__}: {exc})") from exc
    branches = schema if isinstance(schema, list) else [schema]
    update = next((b["items"] for b in branches if isinstance(b, dict) and b.get("type") == "array"
                   and isinstance(b.get("items"), dict) and b["items"].get("name") in
                   ("update", "com.materialize.cdc.update")), None)
    progress = next((b for b in branches if isinstance(b, dict) and b.get("name") in
                     ("progress", "com.materialize.cdc.progress")), None)
    if update is None or progress is None:
        raise FeedError(f"{where}: not a Materialize CDC file (its schema needs an array of "
                        "com.materialize.cdc.update and the record com.materialize.cdc.progress)")
    fields = {f["name"]: f["type"] for f in update["fields"]}
    if set(fields) != {"data", "time", "diff"} or not isinstance(fields["data"], dict):
        raise FeedError(f"{where}: an update must have exactly the fields data (a record), time, diff")
    columns = []
    for f in fields["data"]["fields"]:
        kind = _plain_type(f["type"])
        if kind is None:
            raise FeedError(f"{where}: column {f['name']} has type {f['type']!r}; external feeds take "
                            f"{', '.join(FEED_TYPES)} (optionally with null)")
        columns.append((f["name"], kind))
    updates, prog = [], []
    for r in records:
        if isinstance(r, list):
            updates.extend(r)
        elif isinstance(r, tuple):
            p = r[1]
            if len(p["lower"]) != 1 or len(p["upper"]) != 1 or p["lower"][0] > p["upper"][0]:
                raise FeedError(f"{where}: progress {p} is not one interval [lower, upper) of one-dimensional times")
            counts: dict[str, int] = {}
            for c in p["counts"]:
                if not (p["lower"][0] <= c["time"] < p["upper"][0]):
                    raise FeedError(f"{where}: progress [{p['lower'][0]}, {p['upper'][0]}) counts time {c['time']} "
                                    "outside it")
                counts[str(c["time"])] = counts.get(str(c["time"]), 0) + c["count"]
            prog.append({"lower": p["lower"][0], "upper": p["upper"][0], "counts": counts})
    return columns, updates, prog


def table_shape(table: str, columns: list[tuple[str, str]]):
    """The `TableSchema` of a feed table: its columns, no key (a multiset, REPLICA IDENTITY FULL)."""
    from tidemark.config import TableRef
    from tidemark.pgtypes import Column, TableSchema

    ref = TableRef.parse(table)
    cols = tuple(Column(name=n, kind=FEED_TYPES[k][0], type_name=FEED_TYPES[k][1], type_oid=FEED_TYPES[k][2])
                 for n, k in columns)
    oid = int(hashlib.sha256(table.encode()).hexdigest()[:7], 16)
    return TableSchema(schema=ref.schema, name=ref.name, oid=oid, columns=cols, replica_identity="f")


def _row_key(data: dict) -> tuple:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in data.items())


# -- the stream -----------------------------------------------------------------------------------

def register_feed_stream(cfg: StreamConfig) -> None:
    """Register a feed stream in the control database; its times start at 0."""
    from tidemark.control import open_control

    if not cfg.source.is_feed:
        raise FeedError(f"stream {cfg.stream}: not a feed (source.kind is {cfg.source.kind})")
    with open_control(cfg) as ctl:
        ctl.migrate()
        state = ctl.upsert_stream(cfg)
        if state.consistent_lsn is None:
            ctl.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)


def _store(cfg: StreamConfig):
    from tidemark.landing.store import open_store

    return open_store(cfg.landing.url, endpoint_url=cfg.landing.endpoint_url, region=cfg.landing.region)


def _quarantine(ctl, store, cfg, key, table, data, reason, result) -> None:
    from tidemark.gaps.common import move_aside
    from tidemark.landing.segments import checksum

    moved = move_aside(store, cfg.stream, key)
    if not ctl.register_feed_file(cfg.stream, key, table, checksum(data), len(data), 0, None, None, [],
                                  status="quarantined", detail=reason):
        ctl.set_feed_file_status(cfg.stream, key, "quarantined", reason)      # registered before: now set aside
    ctl.open_incident(cfg.stream, "feed_file_bad", {"key": key, "moved_to": moved, "reason": reason,
                                                    "action": "the producer resends a correct file"})
    result.quarantined.append(key)


def ingest(cfg: StreamConfig, *, now: _dt.datetime | None = None) -> IngestResult:
    """Register new feed files, then land the complete times as a segment (see the module doc)."""
    from tidemark.control import open_control
    from tidemark.landing.segments import checksum

    if not cfg.source.is_feed:
        raise FeedError(f"stream {cfg.stream}: not a feed (source.kind is {cfg.source.kind})")
    tables = [t.qualified for t in cfg.source.tables]
    store = _store(cfg)
    result = IngestResult(cfg.stream)
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "feed-ingest"):
        state = ctl.stream(cfg.stream)
        positions = ctl.table_frontiers(cfg.stream)
        # before per-table positions existed every table was landed to the stream's landed upper
        legacy = 0 if positions else (state.landed_upper or 0)
        landed_at = {t: (positions.get(t) or {}).get("landed_upper") or legacy for t in tables}
        landed = min(landed_at.values()) if landed_at else (state.landed_upper or 0)
        result.lower = result.upper = landed
        known = {f["key"]: f for f in ctl.feed_files(cfg.stream, status=None)}
        fresh: list[str] = []
        for key in sorted(store.list(feed_prefix(cfg.stream))):
            if key in known or not key.endswith(".avro"):
                continue
            rel = key[len(feed_prefix(cfg.stream)):]
            table = rel.rsplit("/", 1)[0] if "/" in rel else ""
            data = store.get(key)
            if table not in tables:
                _quarantine(ctl, store, cfg, key, table, data, f"{table or '(none)'} is not a table of the stream "
                            f"({', '.join(tables)})", result)
                continue
            try:
                columns, updates, prog = parse_feed_file(data, key)
            except FeedError as exc:
                _quarantine(ctl, store, cfg, key, table, data, str(exc), result)
                continue
            times = [u["time"] for u in updates]
            ctl.register_feed_file(cfg.stream, key, table, checksum(data), len(data), len(updates),
                                   min(times) if times else None, max(times) if times else None,
                                   [{**p, "columns": columns} for p in prog] or [{"columns": columns}])
            result.registered.append(key)
            fresh.append(key)
        files = ctl.feed_files(cfg.stream)
        forgotten = {(r["table"], r["time"]) for r in ctl.feed_forgotten(cfg.stream)}
        cache: dict[str, tuple] = {}

        def read(key: str):
            if key not in cache:
                cache[key] = parse_feed_file(store.get(key), key)
            return cache[key]

        by_table: dict[str, list[dict]] = defaultdict(list)
        for f in files:
            by_table[f["table"]].append(f)
        plans: dict[str, dict] = {}
        for table in tables:
            plan = _plan_table(ctl, store, cfg, table, by_table.get(table, []), landed_at[table], forgotten, fresh,
                               read, result)
            plan["landed"] = landed_at[table]
            plan["frontier"] = max(plan["frontier"], landed_at[table])
            plans[table] = plan
            result.frontiers[table] = plan["frontier"]
        unmet = sorted((u for p in plans.values() for u in p["unmet"]), key=lambda u: u["time"])
        result.unmet = unmet
        for u in unmet:     # every table waiting past the timeout has its incident (one per table and time)
            inc = _report_unmet(ctl, cfg, u, now)
            result.incident = result.incident or inc
        moving = {t: p for t, p in plans.items() if p["frontier"] > p["landed"]}
        if moving:
            lower = min(p["landed"] for p in moving.values())
            upper = max(p["frontier"] for p in moving.values())
            result.segment = _land(ctl, store, cfg, plans, moving, lower, upper)
            result.lower = lower
        result.upper = max([*landed_at.values(), *(p["frontier"] for p in moving.values())] or [result.upper])
        for inc in ctl.incidents(cfg.stream):        # times met since (a late file): resolved
            d = inc["detail"] or {}
            if (inc["kind"] == "counts_unmet" and d.get("table") in plans
                    and d.get("time", plans[d["table"]]["frontier"]) < plans[d["table"]]["frontier"]):
                ctl.resolve_incident(inc["id"], f"met: the updates of time {d['time']} arrived")
    return result


def _plan_table(ctl, store, cfg, table, files, landed, forgotten, fresh, read, result) -> dict:
    """One table's frontier from its registered files, and its distinct updates in [landed, frontier)."""
    counts: dict[int, tuple[int, str]] = {}
    intervals = []
    columns = None
    first_seen: dict[int, Any] = {}
    good = []
    for f in files:
        cols = next((p["columns"] for p in f["progress"] if "columns" in p), None)
        if columns is None:
            columns = cols
        elif cols != columns:
            data = store.get(f["key"])
            _quarantine(ctl, store, cfg, f["key"], table, data, f"its columns {cols} differ from the table's "
                        f"{columns} (first file)", result)
            continue
        clash = None
        for p in f["progress"]:
            for t, c in (p.get("counts") or {}).items():
                t = int(t)
                if t in counts and counts[t][0] != c:
                    clash = f"it counts {c} updates at time {t}, {counts[t][1]} counts {counts[t][0]}"
        if clash:
            _quarantine(ctl, store, cfg, f["key"], table, store.get(f["key"]), clash, result)
            continue
        for p in f["progress"]:
            if "lower" in p:
                intervals.append((p["lower"], p["upper"]))
            for t, c in (p.get("counts") or {}).items():
                counts.setdefault(int(t), (c, f["key"]))
                first_seen[int(t)] = min(first_seen.get(int(t), f["registered_at"]), f["registered_at"])
        good.append(f)
    frontier = 0
    for lo, up in sorted(intervals):
        if lo > frontier:
            break
        frontier = max(frontier, up)
    # distinct updates of the times that can land now, and of late files' times below the landed upper
    seen: dict[int, set] = defaultdict(set)
    late_lo = min([f["min_time"] for f in good if f["key"] in fresh and f["min_time"] is not None
                   and f["min_time"] < landed] or [landed])
    for f in good:
        if f["min_time"] is None or f["max_time"] < late_lo or f["min_time"] >= frontier:
            continue
        for u in read(f["key"])[1]:
            if late_lo <= u["time"] < frontier:
                seen[u["time"]].add((_row_key(u["data"]), u["diff"]))
    unmet = []
    for t in sorted(set(seen) | {t for t in counts if late_lo <= t < frontier}):
        n, expected = len(seen.get(t, ())), counts.get(t, (0, None))[0]
        if t >= frontier:
            break
        if n > expected:
            culprits = [f for f in good if f["key"] in fresh and f["min_time"] is not None
                        and f["min_time"] <= t <= f["max_time"] and any(u["time"] == t for u in read(f["key"])[1])]
            if culprits:    # a new file contradicts what is counted: set it aside, plan without it
                for f in culprits:
                    _quarantine(ctl, store, cfg, f["key"], table, store.get(f["key"]),
                                f"with it there are {n} distinct updates of {table} at time {t}, but the progress "
                                f"counts {expected}: not a duplicate", result)
                rest = [f for f in files if f not in culprits]
                return _plan_table(ctl, store, cfg, table, rest, landed, forgotten, fresh, read, result)
            raise FeedError(f"stream {cfg.stream} table {table}: {n} distinct updates at time {t} but the progress "
                            f"counts {expected} (files {sorted(f['key'] for f in good if f['min_time'] is not None and f['min_time'] <= t <= f['max_time'])}); "
                            "bad input, not a duplicate")
        if n < expected and t >= landed and (table, t) not in forgotten:
            unmet.append({"table": table, "time": t, "expected": expected, "seen": n,
                          "since": first_seen.get(t)})
            frontier = t
            break
    return {"frontier": frontier, "columns": columns, "seen": seen, "unmet": unmet}


def _report_unmet(ctl, cfg, first: dict, now) -> int | None:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    since = first["since"]
    if since is None or (now - since).total_seconds() < cfg.consolidate.count_timeout_seconds:
        return None
    return ctl.open_incident(cfg.stream, "counts_unmet", {
        "table": first["table"], "time": first["time"], "expected": first["expected"], "seen": first["seen"],
        "action": f"ask the producer to resend {first['table']} at time {first['time']}, or give it up: "
                  f"tidemark feed forget {cfg.stream} {first['table']} {first['time']}"})


POSITION_BITS = 24      # a table's records at one time take positions [index << 24, (index + 1) << 24)


def _land(ctl, store, cfg, plans: dict, moving: dict, lower: int, upper: int) -> int:
    """Write and register the segment [lower, upper) of the distinct updates of each moving table in
    ``[its landed upper, its frontier)``."""
    from tidemark.control import Segment
    from tidemark.landing.segments import SegmentBuilder, Update, checksum, segment_name
    from tidemark.landing.store import stream_keys

    seq = ctl.stream(cfg.stream).next_seq
    b = SegmentBuilder(cfg.stream, seq, lower, codec=cfg.landing.codec)
    cts = int(_time.time() * 1_000_000)
    per_time: dict[int, list] = defaultdict(list)
    index = {t.qualified: i for i, t in enumerate(cfg.source.tables)}
    for table, plan in sorted(moving.items()):
        if plan["columns"] is None:
            continue
        shape = table_shape(table, [tuple(c) for c in plan["columns"]])
        for t, ups in plan["seen"].items():
            if plan["landed"] <= t < plan["frontier"]:
                per_time[t].append((table, shape, sorted(ups, key=repr)))
    for t in sorted(per_time):
        ups = []
        for table, shape, rows in per_time[t]:
            pos = index[table] << POSITION_BITS
            for row, diff in rows:
                for _ in range(abs(diff)):
                    if pos >= (index[table] + 1) << POSITION_BITS:
                        raise FeedError(f"stream {cfg.stream} table {table}: more than {1 << POSITION_BITS} "
                                        f"records at time {t}")
                    ups.append(Update(table=shape, row=dict(row), time=t, diff=1 if diff > 0 else -1,
                                      xid=t & 0x7FFFFFFF, position=pos, commit_ts=cts))
                    pos += 1
        if ups:
            b.add_transaction(ups)
    data = b.build(upper)
    uri = store.put(stream_keys(cfg.stream)["segments"] + segment_name(seq, lower, upper), data)
    ctl.register_segment(Segment(stream=cfg.stream, seq=seq, lower=lower, upper=upper, uri=uri,
                                 record_count=b.record_count, txn_count=b.txn_count, byte_size=len(data),
                                 checksum=checksum(data), origin="feed", min_commit_ts=b.min_commit_ts,
                                 max_commit_ts=b.max_commit_ts),
                         table_uppers={t: p["frontier"] for t, p in moving.items()})
    return seq


def forget(cfg: StreamConfig, table: str, time: int, reason: str = "given up by the operator") -> dict:
    """Give up waiting for the rest of ``table``'s updates at ``time``: record it (expected and seen
    counts) and resolve its open ``counts_unmet`` incidents; the next `ingest` takes what arrived."""
    from tidemark.control import open_control

    res = None
    with open_control(cfg) as ctl:
        expected = None
        for f in ctl.feed_files(cfg.stream):
            if f["table"] != table:
                continue
            for p in f["progress"]:
                c = (p.get("counts") or {}).get(str(time))
                if c is not None:
                    expected = c
        if expected is None:
            raise FeedError(f"stream {cfg.stream} table {table}: no progress counts time {time}")
        seen = set()
        store = _store(cfg)
        for f in ctl.feed_files(cfg.stream):
            if f["table"] == table and f["min_time"] is not None and f["min_time"] <= time <= f["max_time"]:
                seen |= {(_row_key(u["data"]), u["diff"]) for u in parse_feed_file(store.get(f["key"]), f["key"])[1]
                         if u["time"] == time}
        ctl.forget_feed_time(cfg.stream, table, time, expected, len(seen), reason)
        for inc in ctl.incidents(cfg.stream):
            d = inc["detail"] or {}
            if inc["kind"] == "counts_unmet" and d.get("table") == table and d.get("time") == time:
                ctl.resolve_incident(inc["id"], f"forgotten: {len(seen)} of {expected} updates taken ({reason})")
        res = {"table": table, "time": time, "expected": expected, "seen": len(seen), "reason": reason}
    return res


def detect_feed(cfg: StreamConfig):
    """The gap sensor's view of a feed (`tidemark.gaps.detect` for ``kind: feed``): there is no slot and
    nothing to re-drain, so the decision is ``ok`` (action ``consolidate`` when landed times wait, else
    ``wait``) or ``producer``: open ``counts_unmet`` / ``feed_file_bad`` incidents or holes in the
    manifest that only the producer can mend (action ``wait``; each reason says what to resend, and
    ``tidemark feed forget`` gives a time up)."""
    from tidemark.control import open_control
    from tidemark.gaps.common import GapReport
    from tidemark.gaps.detection import _Tiler

    with open_control(cfg) as ctl:
        state = ctl.stream(cfg.stream)
        tiler = _Tiler(state, ctl.segments(cfg.stream, status=None))
        tiler.walk()
        open_incidents = [i for i in ctl.incidents(cfg.stream) if i["kind"] in ("counts_unmet", "feed_file_bad")]
        positions = ctl.table_frontiers(cfg.stream)
    # a feed's segments overlap by design (a table landing a time later than another: `_land`)
    holes = [g for g in tiler.gaps if g.kind != "lsn_overlap"]
    reasons = [g.reason for g in holes]
    reasons += [f"incident {i['id']} ({i['kind']}): {(i['detail'] or {}).get('action', i['detail'])}"
                for i in open_incidents]
    if positions:       # some table landed past its own frontier
        pending = any((p["landed_upper"] or 0) > (p["frontier"] or 0) for p in positions.values())
    else:
        pending = state.landed_upper is not None and (state.frontier is None or state.landed_upper > state.frontier)
    decision = "producer" if reasons else "ok"
    action = "consolidate" if pending else "wait"
    return GapReport(stream=cfg.stream, decision=decision, action=action, reasons=tuple(reasons),
                     gaps=tuple(holes), consistent_lsn=state.consistent_lsn, landed_upper=state.landed_upper,
                     frontier=state.frontier, next_seq=state.next_seq, slot=None, checked_segments=0)
