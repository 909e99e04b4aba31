"""Segments: immutable Avro object container files in the Materialize CDC format.

Each datum of a segment file is one branch of the union (seed 000, plus one Tidemark extension):

* an **array of updates** — one array per transaction (a very large transaction may use several
  consecutive arrays). An update is ``{data, time, diff}`` as in the Materialize CDC format, where
  ``data`` is a record of the table's shape (a union over the table shapes in the segment), plus
  Tidemark's fields: ``table``, ``xid``, ``position`` (index of the record inside its transaction;
  ``(time, position)`` identifies an update), ``commit_ts`` (µs since the epoch, UTC), ``image``
  (``full`` when ``data`` is the whole row; ``key`` when only the replica-identity columns are
  known, the others null) and ``unchanged_toast`` (columns whose value did not change and was not
  sent: their ``data`` value is null and means "as before", never "null").
* a **progress** record ``{lower, upper, counts}`` exactly as in seed 000: every record (update or
  event) with ``lower <= time < upper`` is in this segment, and ``counts`` says how many distinct
  records there are at each time. The last datum of every segment.
* an **event** (Tidemark extension) for what is not a row change: ``truncate`` of a table, with the
  same ``time``/``position``/``xid``/``commit_ts`` so it is ordered among the updates.

The header metadata carries ``tidemark.format`` (``1``), ``tidemark.stream``, ``tidemark.seq`` and
``tidemark.relations``: a JSON map from Avro record name to the table shape (`TableSchema.to_json`),
which gives the original column names, PostgreSQL types and keys.

A segment's bytes are a function of its content: the sync marker is derived from (stream, lower),
so re-draining the same range writes the same bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import fastavro

from tidemark.errors import SegmentError
from tidemark.pgtypes import TableSchema, avro_field_names, avro_record_schema

FORMAT_VERSION = "1"

PROGRESS_SCHEMA = {
    "type": "record", "name": "progress", "namespace": "com.materialize.cdc",
    "fields": [
        {"name": "lower", "type": {"type": "array", "items": "long"}},
        {"name": "upper", "type": {"type": "array", "items": "long"}},
        {"name": "counts", "type": {"type": "array", "items": {
            "type": "record", "name": "counts", "namespace": "com.materialize.cdc",
            "fields": [{"name": "time", "type": "long"}, {"name": "count", "type": "long"}]}}},
    ],
}

EVENT_SCHEMA = {
    "type": "record", "name": "event", "namespace": "com.tidemark",
    "fields": [
        {"name": "kind", "type": "string"},          # truncate
        {"name": "table", "type": "string"},         # schema.name
        {"name": "time", "type": "long"},
        {"name": "xid", "type": "long"},
        {"name": "position", "type": "int"},
        {"name": "commit_ts", "type": "long"},
        {"name": "detail", "type": "string"},        # JSON (truncate: {"cascade": bool, "restart_identity": bool})
    ],
}

# Used as the only `data` branch of a segment that has no updates (Avro unions cannot be empty).
_EMPTY_DATA = {"type": "record", "name": "no_rows", "namespace": "tidemark.data", "fields": []}


def segment_schema(tables: list[TableSchema]) -> dict:
    """The writer schema of a segment holding updates of the given table shapes."""
    data_branches = [avro_record_schema(t) for t in tables] or [_EMPTY_DATA]
    update = {
        "type": "record", "name": "update", "namespace": "com.materialize.cdc",
        "fields": [
            {"name": "data", "type": data_branches},
            {"name": "time", "type": "long"},
            {"name": "diff", "type": "long"},
            {"name": "table", "type": "string"},
            {"name": "xid", "type": "long"},
            {"name": "position", "type": "int"},
            {"name": "commit_ts", "type": "long"},
            {"name": "image", "type": {"type": "enum", "name": "image", "namespace": "com.tidemark",
                                       "symbols": ["full", "key"]}},
            {"name": "unchanged_toast", "type": {"type": "array", "items": "string"}},
        ],
    }
    return [{"type": "array", "items": update}, PROGRESS_SCHEMA, EVENT_SCHEMA]


def segment_name(seq: int, lower: int, upper: int) -> str:
    """``00000000000000000042_000000000169A3B8_000000000169B000.avro``: sorts by seq, names the range."""
    return f"{seq:020d}_{lower:016X}_{upper:016X}.avro"


def parse_segment_name(name: str) -> tuple[int, int, int]:
    """Inverse of `segment_name`; raises ValueError for other names."""
    base = name.rsplit("/", 1)[-1]
    if not base.endswith(".avro"):
        raise ValueError(f"{name!r} is not a segment file name")
    seq, lower, upper = base[:-5].split("_")
    return int(seq), int(lower, 16), int(upper, 16)


def lsn_to_str(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def str_to_lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


@dataclass
class Update:
    """One row change. ``row`` is a dict column name -> canonical value (see `tidemark.pgtypes`)."""

    table: TableSchema
    row: dict[str, Any]
    time: int
    diff: int
    xid: int
    position: int
    commit_ts: int
    image: str = "full"
    unchanged_toast: tuple[str, ...] = ()


@dataclass
class Event:
    kind: str
    table: str
    time: int
    xid: int
    position: int
    commit_ts: int
    detail: dict = field(default_factory=dict)


@dataclass
class SegmentContent:
    """What a segment says, decoded: tables (by record name), records in file order, progress."""

    stream: str
    seq: int
    lower: int
    upper: int
    counts: dict[int, int]
    relations: dict[str, TableSchema]
    updates: list[Update]
    events: list[Event]


class SegmentBuilder:
    """Collect a segment's records (whole transactions), then `build` its bytes.

    Records are kept encoded as Avro-ready dicts; table shapes are registered as they appear.
    """

    def __init__(self, stream: str, seq: int, lower: int):
        self.stream = stream
        self.seq = seq
        self.lower = lower
        self.tables: dict[str, TableSchema] = {}   # record name -> shape, in first-use order
        self._field_names: dict[str, list[str]] = {}
        self.datums: list[Any] = []
        self.counts: dict[int, int] = {}
        self.record_count = 0
        self.txn_count = 0

    def add_table(self, table: TableSchema) -> str:
        name = table.record_name
        if name not in self.tables:
            self.tables[name] = table
            self._field_names[name] = avro_field_names(table.columns)
        return name

    def add_transaction(self, updates: list[Update], events: Iterable[Event] = ()) -> None:
        """Append one whole transaction (updates and events, any order: stored by position)."""
        items: list[tuple[int, Any]] = []
        for u in updates:
            items.append((u.position, u))
        for e in events:
            items.append((e.position, e))
        items.sort(key=lambda x: x[0])
        batch: list[dict] = []
        for _, item in items:
            if isinstance(item, Update):
                batch.append(self.encode_update(item))
            else:
                if batch:
                    self.datums.append(batch)
                    batch = []
                self.datums.append(("com.tidemark.event", {
                    "kind": item.kind, "table": item.table, "time": item.time, "xid": item.xid,
                    "position": item.position, "commit_ts": item.commit_ts,
                    "detail": json.dumps(item.detail, sort_keys=True)}))
            self.counts[item.time] = self.counts.get(item.time, 0) + 1
            self.record_count += 1
        if batch:
            self.datums.append(batch)
        self.txn_count += 1

    def encode_update(self, u: Update) -> dict:
        rname = self.add_table(u.table)
        fnames = self._field_names[rname]
        data = {f: u.row.get(c.name) for f, c in zip(fnames, u.table.columns)}
        return {"data": (rname if "." in rname else f"tidemark.data.{rname}", data), "time": u.time, "diff": u.diff,
                "table": u.table.qualified, "xid": u.xid, "position": u.position, "commit_ts": u.commit_ts,
                "image": u.image, "unchanged_toast": list(u.unchanged_toast)}

    def add_encoded(self, datum: Any, times: Iterable[int]) -> None:
        """Append an already encoded datum (fast path for the drain); ``times`` lists each record's time."""
        self.datums.append(datum)
        for t in times:
            self.counts[t] = self.counts.get(t, 0) + 1
            self.record_count += 1

    def build(self, upper: int) -> bytes:
        """Return the segment file's bytes for ``[lower, upper)``."""
        if upper < self.lower:
            raise SegmentError(segment_name(self.seq, self.lower, upper), f"upper {upper} < lower {self.lower}")
        for t in self.counts:
            if not (self.lower <= t < upper):
                raise SegmentError(segment_name(self.seq, self.lower, upper),
                                   f"record at time {t} is outside [{self.lower}, {upper})")
        progress = ("com.materialize.cdc.progress", {
            "lower": [self.lower], "upper": [upper],
            "counts": [{"time": t, "count": c} for t, c in sorted(self.counts.items())]})
        schema = fastavro.parse_schema(segment_schema(list(self.tables.values())))
        metadata = {
            "tidemark.format": FORMAT_VERSION,
            "tidemark.stream": self.stream,
            "tidemark.seq": str(self.seq),
            "tidemark.relations": json.dumps({k: v.to_json() for k, v in self.tables.items()}, sort_keys=True),
        }
        marker = hashlib.sha256(f"{self.stream}/{self.lower}".encode()).digest()[:16]
        buf = io.BytesIO()
        fastavro.writer(buf, schema, self._all_datums(progress), metadata=metadata, sync_marker=marker)
        return buf.getvalue()

    def _all_datums(self, progress) -> Iterator[Any]:
        yield from self.datums
        yield progress


def read_segment(data: bytes, name: str = "<segment>") -> SegmentContent:
    """Decode a segment's bytes, checking the invariants a consumer relies on.

    Raises `SegmentError` naming the segment, the record number and the reason.
    """
    try:
        reader = fastavro.reader(io.BytesIO(data), return_record_name=True)
    except Exception as exc:  # fastavro raises ValueError/EOFError/SchemaParseException variants
        raise SegmentError(name, f"not an Avro object container file: {exc}") from exc
    meta = reader.metadata
    if meta.get("tidemark.format") != FORMAT_VERSION:
        raise SegmentError(name, f"unknown tidemark.format {meta.get('tidemark.format')!r}")
    try:
        relations = {k: TableSchema.from_json(v) for k, v in json.loads(meta["tidemark.relations"]).items()}
    except (KeyError, ValueError, TypeError) as exc:
        raise SegmentError(name, f"bad tidemark.relations header: {exc}") from exc
    field_maps = {k: list(zip(avro_field_names(t.columns), (c.name for c in t.columns))) for k, t in relations.items()}
    updates: list[Update] = []
    events: list[Event] = []
    progress = None
    idx = -1
    try:
        for datum in reader:
            idx += 1
            if progress is not None:
                raise SegmentError(name, "a record follows the progress record", record=idx)
            if isinstance(datum, list):
                for u in datum:
                    rname, data = u["data"]
                    rname = rname.rsplit(".", 1)[-1]
                    table = relations.get(rname)
                    if table is None:
                        raise SegmentError(name, f"update for unknown table shape {rname}", record=idx)
                    row = {col: data[f] for f, col in field_maps[rname]}
                    updates.append(Update(table=table, row=row, time=u["time"], diff=u["diff"], xid=u["xid"],
                                          position=u["position"], commit_ts=u["commit_ts"], image=u["image"],
                                          unchanged_toast=tuple(u["unchanged_toast"])))
            else:
                rname, rec = datum
                if rname == "com.materialize.cdc.progress":
                    progress = rec
                elif rname == "com.tidemark.event":
                    events.append(Event(kind=rec["kind"], table=rec["table"], time=rec["time"], xid=rec["xid"],
                                        position=rec["position"], commit_ts=rec["commit_ts"],
                                        detail=json.loads(rec["detail"])))
                else:
                    raise SegmentError(name, f"unexpected record type {rname}", record=idx)
    except SegmentError:
        raise
    except Exception as exc:
        raise SegmentError(name, f"cannot decode: {exc}", record=idx + 1) from exc
    if progress is None:
        raise SegmentError(name, "no progress record (truncated file?)")
    if len(progress["lower"]) != 1 or len(progress["upper"]) != 1:
        raise SegmentError(name, "progress lower/upper must have exactly one element")
    lower, upper = progress["lower"][0], progress["upper"][0]
    counts = {c["time"]: c["count"] for c in progress["counts"]}
    seen: dict[int, int] = {}
    for r in [*updates, *events]:
        if not (lower <= r.time < upper):
            raise SegmentError(name, f"record at time {r.time} outside [{lower}, {upper})")
        seen[r.time] = seen.get(r.time, 0) + 1
    for t, c in seen.items():
        if counts.get(t, 0) < c:
            raise SegmentError(name, f"{c} records at time {t} but progress counts say {counts.get(t, 0)}")
    return SegmentContent(stream=meta.get("tidemark.stream", ""), seq=int(meta.get("tidemark.seq", "-1")),
                          lower=lower, upper=upper, counts=counts, relations=relations, updates=updates,
                          events=events)


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
