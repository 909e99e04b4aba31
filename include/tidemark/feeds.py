"""External feeds: a stream without PostgreSQL, fed Materialize CDC files by another producer (the
manual: docs/segment-format.md, "External feeds"; one file on its own: `tidemark.feed_format`).

Producers write Avro files under ``STREAM/feed/TABLE/``, in any order, duplicated, late. `ingest`
(``tidemark feed ingest STREAM``) does, idempotently: **register** each new file in
``tidemark.feed_files``, quarantining one invalid in itself (`RULES`), of an unknown table or
contradicting an earlier file's counts (incident ``feed_file_bad``; never a reference for the others);
**dedup and complete** per table, each table with its own frontier, held at its first time whose count
is not met (``counts_unmet`` after ``consolidate.count_timeout_seconds``) unless given up with `forget`;
**land** each table's ``[its landed upper, its frontier)`` in one segment of origin ``feed`` (`_land`:
one transaction per time, a ``diff = n`` as ``n`` records), its landed upper in ``tidemark.table_frontiers``.
After a `forget`, a late update of the forgotten time is reported, not applied (``feed_forgotten_late``),
and a retraction of more copies than the table holds is clipped and recorded (``feed_update_skipped``).
"""

from __future__ import annotations

import datetime as _dt
import time as _time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from tidemark.config import StreamConfig
from tidemark.control import Segment, open_control
from tidemark.feed_format import (  # noqa: F401 - one file's names, re-exported
    RULES, FeedError, FeedFileBad, parse_feed_file, read_feed_file, stored_problem, table_shape)
from tidemark.gaps.common import move_aside
from tidemark.lake import LakeError, read_tables
from tidemark.landing.segments import SegmentBuilder, Update, checksum, read_segment_at
from tidemark.landing.store import landing_store, segment_key
from tidemark.pgtypes import arrow_schema
from tidemark.rowid import key_text, row_keys, rows_of


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
    skipped: list[dict] = field(default_factory=list)   # retractions of rows not held after a forget
    late: list[dict] = field(default_factory=list)      # forgotten updates that arrived after all
    held: list[dict] = field(default_factory=list)      # tables held at a time counted too low


# -- the stream -----------------------------------------------------------------------------------

def _require_feed(cfg: StreamConfig) -> None:
    if not cfg.source.is_feed:
        raise FeedError(f"stream {cfg.stream}: not a feed (source.kind is {cfg.source.kind})")


def register_feed_stream(cfg: StreamConfig) -> None:
    """Register a feed stream in the control database; its times start at 0."""
    _require_feed(cfg)
    with open_control(cfg) as ctl:
        ctl.migrate()
        state = ctl.upsert_stream(cfg)
        if state.consistent_lsn is None:
            ctl.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)


def _quarantine(ctl, store, cfg, key, table, reason, rule, result, *, data: bytes | None = None) -> None:
    """Set one file aside (moved to ``STREAM/quarantine/``, status ``quarantined``) with a
    ``feed_file_bad`` incident naming it and the rule; ``data``: a file not registered yet."""
    moved = move_aside(store, cfg.stream, key)
    if data is None or not ctl.register_feed_file(cfg.stream, key, table, checksum(data), len(data), 0, None, None,
                                                  [], status="quarantined", detail=reason):
        ctl.set_feed_file_status(cfg.stream, key, "quarantined", reason)      # registered before: now set aside
    ctl.open_incident(cfg.stream, "feed_file_bad", {"key": key, "moved_to": moved, "reason": reason, "rule": rule,
                                                    "action": "the producer resends a correct file"})
    result.quarantined.append(key)


def ingest(cfg: StreamConfig, *, now: _dt.datetime | None = None) -> IngestResult:
    """Register new feed files, then land the complete times as a segment (see the module doc)."""
    _require_feed(cfg)
    tables = [t.qualified for t in cfg.source.tables]
    store = landing_store(cfg)
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
        cache: dict[str, tuple] = {}
        for key in sorted(store.list(feed_prefix(cfg.stream))):
            if key in known or not key.endswith(".avro"):
                continue
            rel = key[len(feed_prefix(cfg.stream)):]
            table = rel.rsplit("/", 1)[0] if "/" in rel else ""
            data = store.get(key)
            if table not in tables:
                _quarantine(ctl, store, cfg, key, table, f"{table or '(none)'} is not a table of the stream "
                            f"({', '.join(tables)})", "table", result, data=data)
                continue
            try:
                columns, updates, prog, keys = read_feed_file(data, key)
            except FeedFileBad as exc:      # invalid in itself: set aside alone, never a reference
                _quarantine(ctl, store, cfg, key, table, str(exc), exc.rule, result, data=data)
                continue
            times = [u["time"] for u in updates]
            ctl.register_feed_file(cfg.stream, key, table, checksum(data), len(data), len(updates),
                                   min(times) if times else None, max(times) if times else None,
                                   [{**p, "columns": columns} for p in prog] or [{"columns": columns}])
            cache[key] = (columns, updates, prog, keys)
            result.registered.append(key)
            fresh.append(key)
        forgotten = {(r["table"], r["time"]) for r in ctl.feed_forgotten(cfg.stream)}

        def read(key: str):
            if key not in cache:
                cache[key] = read_feed_file(store.get(key), key)
            return cache[key]

        by_table: dict[str, list[dict]] = defaultdict(list)
        for f in ctl.feed_files(cfg.stream):
            if not store.exists(f["key"]):      # a registered file gone from the store: named, not fatal
                ctl.set_feed_file_status(cfg.stream, f["key"], "missing", "gone from the landing store")
                ctl.open_incident(cfg.stream, "feed_file_bad", {
                    "key": f["key"], "reason": "registered, then gone from the landing store", "rule": "present",
                    "action": "the producer resends the file (its updates that did not land yet are missing)"})
                continue
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
        for table, plan in moving.items():      # after a forget: retractions of rows the table does not hold
            _clip_retractions(ctl, cfg, table, plan, forgotten, result)
        if moving:
            lower = min(p["landed"] for p in moving.values())
            upper = max(p["frontier"] for p in moving.values())
            result.segment = _land(ctl, store, cfg, moving, lower, upper)
            result.lower = lower
        result.upper = max([*landed_at.values(), *(p["frontier"] for p in moving.values())] or [result.upper])
        for inc in ctl.incidents(cfg.stream):        # times met since (a late file): resolved
            d = inc["detail"] or {}
            if (inc["kind"] == "counts_unmet" and d.get("table") in plans
                    and d.get("time", plans[d["table"]]["frontier"]) < plans[d["table"]]["frontier"]):
                ctl.resolve_incident(inc["id"], f"met: the updates of time {d['time']} arrived")
    return result


def _plan_table(ctl, store, cfg, table, files, landed, forgotten, fresh, read, result) -> dict:
    """One table's frontier from its registered files, and its distinct updates in [landed, frontier)
    (``seen``: time -> {(row identity, diff): data}; rows are the same by value bits)."""
    counts: dict[int, tuple[int, str]] = {}
    intervals = []
    columns = None
    first_seen: dict[int, Any] = {}
    good = []
    for f in files:
        bad = stored_problem(f["progress"])
        if bad:     # registered before these checks: set aside, never a reference
            _quarantine(ctl, store, cfg, f["key"], table, f"{f['key']}: {bad[0]} (rule {bad[1]}: {RULES[bad[1]]})",
                        bad[1], result)
            continue
        cols = next((p["columns"] for p in f["progress"] if "columns" in p), None)
        if columns is None:
            columns = cols
        elif cols != columns:
            _quarantine(ctl, store, cfg, f["key"], table, f"its columns {cols} differ from the table's "
                        f"{columns} (first file)", "columns", result)
            continue
        clash = None
        for p in f["progress"]:
            for t, c in (p.get("counts") or {}).items():
                t = int(t)
                if t in counts and counts[t][0] != c:
                    clash = f"it counts {c} updates at time {t}, {counts[t][1]} counts {counts[t][0]}"
        if clash:
            _quarantine(ctl, store, cfg, f["key"], table, clash, "counts-agree", result)
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
    seen: dict[int, dict] = defaultdict(dict)
    older: dict[int, set] = defaultdict(set)     # forgotten times below the landed upper: what files known before hold
    late_lo = min([f["min_time"] for f in good if f["key"] in fresh and f["min_time"] is not None
                   and f["min_time"] < landed] or [landed])
    for f in good:
        if f["min_time"] is None or f["max_time"] < late_lo or f["min_time"] >= frontier:
            continue
        _, ups, _, keys = read(f["key"])
        for u, k in zip(ups, keys):
            if late_lo <= u["time"] < frontier:
                seen[u["time"]].setdefault((k, u["diff"]), u["data"])
                if f["key"] not in fresh and u["time"] < landed and (table, u["time"]) in forgotten:
                    older[u["time"]].add((k, u["diff"]))
    unmet, held = [], []
    for t in sorted(set(seen) | {t for t in counts if late_lo <= t < frontier}):
        n, expected = len(seen.get(t, ())), counts.get(t, (0, None))[0]
        if t >= frontier:
            break
        if n > expected:
            culprits = [f for f in good if f["key"] in fresh and f["min_time"] is not None
                        and f["min_time"] <= t <= f["max_time"] and any(u["time"] == t for u in read(f["key"])[1])]
            if culprits:    # a new file contradicts what is counted: set it aside, plan without it
                for f in culprits:
                    _quarantine(ctl, store, cfg, f["key"], table,
                                f"with it there are {n} distinct updates of {table} at time {t}, but the progress "
                                f"counts {expected}: not a duplicate", "counted", result)
                rest = [f for f in good if f not in culprits]
                return _plan_table(ctl, store, cfg, table, rest, landed, forgotten, fresh, read, result)
            # files registered earlier disagree with a count that came later: which one is wrong is the
            # producer's to say; this table waits at t (named), the others go on
            names = sorted(f["key"] for f in good if f["min_time"] is not None and f["min_time"] <= t <= f["max_time"])
            held.append({"table": table, "time": t, "expected": expected, "seen": n, "files": names})
            ctl.open_incident(cfg.stream, "feed_file_bad", {
                "table": table, "time": t, "files": names, "rule": "counted",
                "reason": f"{n} distinct updates of {table} at time {t} but the progress counts {expected}",
                "action": "the producer resends the table's updates of that time; the wrong file is set aside by hand"})
            frontier = t
            break
        if t < landed and (table, t) in forgotten and t in seen:
            _report_late(ctl, cfg, table, t, seen[t], older.get(t, set()), good, fresh, result)
        if n < expected and t >= landed and (table, t) not in forgotten:
            unmet.append({"table": table, "time": t, "expected": expected, "seen": n,
                          "since": first_seen.get(t)})
            frontier = t
            break
    result.held += held
    return {"frontier": frontier, "columns": columns, "seen": seen, "unmet": unmet}


def _report_late(ctl, cfg, table: str, t: int, seen: dict, older: set, good, fresh, result) -> None:
    """Forgotten updates of ``table`` at ``t`` that came after its time landed: not applied (the table
    has moved past ``t``; a forget is final), reported once, in the ingest that registers them."""
    late = [k for k in seen if k not in older]
    if not late:
        return
    files = sorted(f["key"] for f in good if f["key"] in fresh and f["min_time"] is not None
                   and f["min_time"] <= t <= f["max_time"])
    detail = {"table": table, "time": t, "updates": len(late), "files": files,
              "rows": sorted(f"{key_text(k)} diff {d}" for k, d in late),
              "action": f"not applied: time {t} of {table} was given up (tidemark feed forget) and the table has "
                        "moved past it; the lake keeps what landed then"}
    ctl.open_incident(cfg.stream, "feed_forgotten_late", detail)
    result.late.append(detail)


def _table_state(ctl, cfg, table: str, columns, landed: int):
    """The table's rows (identity -> count) at its landed upper: the lake at the table's frontier plus
    the landed segments' updates of it from there."""
    schema = arrow_schema(table_shape(table, [tuple(c) for c in columns]))
    state: Counter = Counter()
    below = (ctl.table_frontiers(cfg.stream).get(table) or {}).get("frontier") or 0
    if below > 0:
        try:
            lake = read_tables(cfg, [table], frontier=below)[table]
            state.update(row_keys(rows_of(lake.select(schema.names).to_pylist(), schema)))
        except LakeError:
            below = 0
    for s in ctl.segments(cfg.stream, status="landed", lower_from=below):
        if s.origin != "feed" or s.lower >= landed:
            continue
        content = read_segment_at(s.uri, cfg.landing.endpoint_url)
        ups = [u for u in content.updates if u.table.qualified == table and below <= u.time < landed]
        for u, k in zip(ups, row_keys(rows_of((u.row for u in ups), schema))):
            state[k] += u.diff
    return state


def _clip_retractions(ctl, cfg, table: str, plan: dict, forgotten: set, result) -> None:
    """After a forget of ``table``, a retraction of a row the table does not hold (its addition was
    among the forgotten updates) is taken only for the copies held; the rest is skipped and recorded
    (incident ``feed_update_skipped``) before the segment lands, so the consolidation never meets it."""
    lost = sorted(t for tb, t in forgotten if tb == table and t < plan["frontier"])
    times = sorted(t for t in plan["seen"] if plan["landed"] <= t < plan["frontier"])
    if not lost or plan["columns"] is None or not any(d < 0 for t in times for _, d in plan["seen"][t]):
        return
    state = _table_state(ctl, cfg, table, plan["columns"], plan["landed"])
    for t in times:
        ups = plan["seen"][t]
        for (k, diff), data in list(ups.items()):
            if diff < 0 and state[k] < -diff:
                skip = -diff - state[k]
                detail = {"table": table, "time": t, "row_id": key_text(k), "row": repr(data), "diff": diff,
                          "skipped": skip, "forgotten": [x for x in lost if x < t],
                          "action": f"recorded: {table} held {state[k]} of the {-diff} copies this retraction takes "
                                    "out (their addition was given up with tidemark feed forget); the rest is skipped"}
                ctl.open_incident(cfg.stream, "feed_update_skipped", detail)
                result.skipped.append(detail)
                del ups[(k, diff)]
                if state[k] > 0:
                    ups[(k, -state[k])] = data
        for (k, diff) in ups:
            state[k] += diff


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


def _land(ctl, store, cfg, moving: dict, lower: int, upper: int) -> int:
    """Write and register the segment [lower, upper) of the distinct updates of each moving table in
    ``[its landed upper, its frontier)``."""
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
                per_time[t].append((table, shape, sorted(ups.items(), key=lambda kv: repr(kv[0]))))
    for t in sorted(per_time):
        ups = []
        for table, shape, rows in per_time[t]:
            pos = index[table] << POSITION_BITS
            for (_, diff), row in rows:
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
    uri = store.put(segment_key(cfg.stream, seq, lower, upper), data)
    ctl.register_segment(Segment(stream=cfg.stream, seq=seq, lower=lower, upper=upper, uri=uri,
                                 record_count=b.records, txn_count=b.txns, byte_size=len(data),
                                 checksum=checksum(data), origin="feed", min_commit_ts=b.min_commit_ts,
                                 max_commit_ts=b.max_commit_ts),
                         table_uppers={t: p["frontier"] for t, p in moving.items()})
    return seq


def forget(cfg: StreamConfig, table: str, time: int, reason: str = "given up by the operator") -> dict:
    """Give up waiting for the rest of ``table``'s updates at ``time``: record it (expected and seen
    counts) and resolve its open ``counts_unmet`` incidents; the next `ingest` takes what arrived."""
    with open_control(cfg) as ctl:
        files = [f for f in ctl.feed_files(cfg.stream) if f["table"] == table]
        expected = None
        for f in files:
            for p in f["progress"]:
                c = (p.get("counts") or {}).get(str(time))
                if c is not None:
                    expected = c
        if expected is None:
            raise FeedError(f"stream {cfg.stream} table {table}: no progress counts time {time}")
        seen = set()
        store = landing_store(cfg)
        for f in files:
            if f["min_time"] is not None and f["min_time"] <= time <= f["max_time"]:
                _, ups, _, keys = read_feed_file(store.get(f["key"]), f["key"])
                seen |= {(k, u["diff"]) for u, k in zip(ups, keys) if u["time"] == time}
        ctl.forget_feed_time(cfg.stream, table, time, expected, len(seen), reason)
        for inc in ctl.incidents(cfg.stream):
            d = inc["detail"] or {}
            if inc["kind"] == "counts_unmet" and d.get("table") == table and d.get("time") == time:
                ctl.resolve_incident(inc["id"], f"forgotten: {len(seen)} of {expected} updates taken ({reason})")
    return {"table": table, "time": time, "expected": expected, "seen": len(seen), "reason": reason}
