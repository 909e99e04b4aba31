"""One external feed file on its own (`tidemark.feeds`): read (`read_feed_file`), checked against the
rules a file must keep whatever the other files say (`RULES`; `FeedFileBad` names the rule broken),
and its table's shape (`table_shape`) and its rows' identities (`update_keys`)."""

from __future__ import annotations

import hashlib
import io
from collections import defaultdict
from typing import Any

import fastavro

from tidemark.config import TableRef
from tidemark.errors import TidemarkError
from tidemark.pgtypes import arrow_schema, Column, TableSchema
from tidemark.rowid import row_keys, rows_of

FEED_TYPES = {"long": ("int64", "int8", 20), "int": ("int32", "int4", 23), "string": ("text", "text", 25),
              "double": ("float64", "float8", 701), "float": ("float32", "float4", 700),
              "boolean": ("bool", "bool", 16), "bytes": ("bytes", "bytea", 17)}


class FeedError(TidemarkError):
    """A feed file or the feed itself cannot be used; names the stream, table, file and reason."""


class FeedFileBad(FeedError):
    """A feed file that is invalid in itself; ``rule`` is the key of the rule it breaks (`RULES`)."""

    def __init__(self, where: str, what: str, rule: str):
        super().__init__(f"{where}: {what} (rule {rule}: {RULES[rule]})")
        self.rule = rule


# What a file must be on its own, whatever the other files say. A file breaking one is quarantined by
# itself (incident ``feed_file_bad`` naming the file and the rule): it never registers, so its counts
# never become the reference other files are judged against.
RULES = {
    "avro": "a readable Avro object container file",
    "shape": "the seed's schema: an array of com.materialize.cdc.update {data, time, diff} and the record "
             "com.materialize.cdc.progress {lower, upper, counts}",
    "column-type": f"columns of the Avro types {', '.join(FEED_TYPES)}, optionally in a union with null",
    "progress-interval": "a progress record is one interval [lower, upper) of one-dimensional times with "
                         "0 <= lower <= upper",
    "count": "a count is a non-negative integer",
    "count-time": "a counted time lies in its progress record's [lower, upper)",
    "progress-agree": "the file's progress records give every time they cover one count (not counted: 0)",
    "update-time": "an update's time is a non-negative integer",
    "diff": "an update's diff is a non-zero integer",
    "one-diff": "at most one diff per (data, time)",
    "own-count": "no more distinct (data, time, diff) at a time than the file's own progress counts there",
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _plain_type(t: Any) -> str | None:
    """The Avro primitive of a field type (a union with null allowed), None if unsupported."""
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        return _plain_type(rest[0]) if len(rest) == 1 else None
    if isinstance(t, dict):
        return None if t.get("logicalType") else _plain_type(t.get("type"))
    return t if t in FEED_TYPES else None


def parse_feed_file(data: bytes, where: str) -> tuple[list[tuple[str, str]], list[dict], list[dict]]:
    """(columns [(name, avro type)], updates, progress records) of one feed file, or `FeedFileBad`
    naming the file and the rule (`RULES`) it breaks."""
    columns, updates, prog, _ = read_feed_file(data, where)
    return columns, updates, prog


def read_feed_file(data: bytes, where: str):
    """`parse_feed_file` plus each update's row identity (`update_keys`)."""
    try:
        reader = fastavro.reader(io.BytesIO(data), return_record_name=True)
        schema = reader.writer_schema
        records = list(reader)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a bad file, named
        raise FeedFileBad(where, f"not a readable Avro file ({type(exc).__name__}: {exc})", "avro") from exc
    branches = schema if isinstance(schema, list) else [schema]
    update = next((b["items"] for b in branches if isinstance(b, dict) and b.get("type") == "array"
                   and isinstance(b.get("items"), dict) and b["items"].get("name") in
                   ("update", "com.materialize.cdc.update")), None)
    progress = next((b for b in branches if isinstance(b, dict) and b.get("name") in
                     ("progress", "com.materialize.cdc.progress")), None)
    if update is None or progress is None:
        raise FeedFileBad(where, "not a Materialize CDC file (its schema needs an array of "
                          "com.materialize.cdc.update and the record com.materialize.cdc.progress)", "shape")
    fields = {f["name"]: f["type"] for f in update["fields"]}
    if set(fields) != {"data", "time", "diff"} or not isinstance(fields["data"], dict):
        raise FeedFileBad(where, "an update must have exactly the fields data (a record), time, diff", "shape")
    columns = []
    for f in fields["data"]["fields"]:
        kind = _plain_type(f["type"])
        if kind is None:
            raise FeedFileBad(where, f"column {f['name']} has type {f['type']!r}; external feeds take "
                              f"{', '.join(FEED_TYPES)} (optionally with null)", "column-type")
        columns.append((f["name"], kind))
    updates, prog = [], []
    for r in records:
        if isinstance(r, list):
            updates.extend(r)
        elif isinstance(r, tuple):
            prog.append(_check_progress(r[1], where))
    for u in updates:
        if not _is_int(u["time"]) or u["time"] < 0:
            raise FeedFileBad(where, f"an update has time {u['time']!r}", "update-time")
        if not _is_int(u["diff"]) or u["diff"] == 0:
            raise FeedFileBad(where, f"an update at time {u['time']} has diff {u['diff']!r}", "diff")
    _check_agreement(prog, {u["time"] for u in updates}, where)
    keys = update_keys(columns, updates)
    distinct: dict[int, dict] = defaultdict(dict)
    for u, k in zip(updates, keys):
        d = distinct[u["time"]].setdefault(k, u["diff"])
        if d != u["diff"]:
            raise FeedFileBad(where, f"the row {u['data']} has diffs {d} and {u['diff']} at time {u['time']}",
                              "one-diff")
    for t, rows in distinct.items():
        for p in prog:
            if p["lower"] <= t < p["upper"] and len(rows) > p["counts"].get(str(t), 0):
                raise FeedFileBad(where, f"{len(rows)} distinct updates at time {t}, its own progress "
                                  f"[{p['lower']}, {p['upper']}) counts {p['counts'].get(str(t), 0)}", "own-count")
    return columns, updates, prog, keys


def _check_progress(p: dict, where: str) -> dict:
    """One progress record as ``{lower, upper, counts: {"time": count}}``, checked on its own."""
    lo, up = p["lower"], p["upper"]
    if len(lo) != 1 or len(up) != 1 or not all(_is_int(x) for x in (*lo, *up)) or not 0 <= lo[0] <= up[0]:
        raise FeedFileBad(where, f"progress {p} is not one interval [lower, upper) of one-dimensional times",
                          "progress-interval")
    counts: dict[str, int] = {}
    for c in p["counts"]:
        if not _is_int(c["count"]) or c["count"] < 0:
            raise FeedFileBad(where, f"progress [{lo[0]}, {up[0]}) counts {c['count']!r} updates at time "
                              f"{c['time']!r}", "count")
        if not _is_int(c["time"]) or not (lo[0] <= c["time"] < up[0]):
            raise FeedFileBad(where, f"progress [{lo[0]}, {up[0]}) counts time {c['time']} outside it", "count-time")
        counts[str(c["time"])] = counts.get(str(c["time"]), 0) + c["count"]
    return {"lower": lo[0], "upper": up[0], "counts": counts}


def _check_agreement(prog: list[dict], times: set, where: str) -> None:
    """Progress records of one file that cover a time must give it one count."""
    if len(prog) < 2:
        return
    for t in sorted({int(t) for p in prog for t in p["counts"]} | times):
        said = {(p["lower"], p["upper"]): p["counts"].get(str(t), 0) for p in prog if p["lower"] <= t < p["upper"]}
        if len(set(said.values())) > 1:
            raise FeedFileBad(where, f"its progress records count time {t} differently: "
                              + ", ".join(f"[{lo}, {up}): {c}" for (lo, up), c in sorted(said.items())),
                              "progress-agree")


def stored_problem(progress: list[dict]) -> tuple[str, str] | None:
    """(what, rule) if a registered file's recorded progress breaks a rule (a file registered before
    these checks existed): such a file is quarantined, never a reference."""
    for p in progress:
        if "lower" not in p:
            continue
        for t, c in (p.get("counts") or {}).items():
            if not _is_int(c) or c < 0:
                return f"progress [{p['lower']}, {p['upper']}) counts {c!r} updates at time {t}", "count"
        if not (_is_int(p["lower"]) and _is_int(p["upper"]) and 0 <= p["lower"] <= p["upper"]):
            return f"progress [{p['lower']}, {p['upper']}) is not an interval of times", "progress-interval"
    return None


def update_keys(columns: list[tuple[str, str]], updates: list[dict]) -> list[tuple]:
    """Each update's row identity by value bits (`tidemark.rowid`), as the lake's rows are keyed."""
    schema = arrow_schema(table_shape("feed.rows", columns))
    return row_keys(rows_of((u["data"] for u in updates), schema))


def table_shape(table: str, columns: list[tuple[str, str]]):
    """The `TableSchema` of a feed table: its columns, no key (a multiset, REPLICA IDENTITY FULL)."""
    ref = TableRef.parse(table)
    cols = tuple(Column(name=n, kind=FEED_TYPES[k][0], type_name=FEED_TYPES[k][1], type_oid=FEED_TYPES[k][2])
                 for n, k in columns)
    oid = int(hashlib.sha256(table.encode()).hexdigest()[:7], 16)
    return TableSchema(schema=ref.schema, name=ref.name, oid=oid, columns=cols, replica_identity="f")

