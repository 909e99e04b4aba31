"""The consolidated changelog in the Materialize CDC format (seed 000).

Per table and batch, one Avro object container file in the landing store at
``{stream}/changelog/{schema}.{table}/{seq-free range name}.avro`` holding arrays of
``{data, time, diff}`` updates — pre-consolidated: at most one diff per ``(data, time)``, zero
diffs suppressed — followed by the progress record ``{lower, upper, counts}``. A consumer such as
Materialize's ``ENVELOPE MATERIALIZE`` reads it as is. Values are in their lake form: dates as
``int`` ``date``, timestamps as ``long`` ``timestamp-micros``/``local-timestamp-micros``, numerics as
``bytes`` ``decimal`` when declared with a precision.
"""

from __future__ import annotations

import io
from typing import Any

from tidemark.pgtypes import avro_name
from tidemark.segments import PROGRESS_SCHEMA


def _avro_type(t) -> Any:
    import pyarrow as pa

    if pa.types.is_boolean(t):
        base: Any = "boolean"
    elif pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_int32(t):
        base = "int"
    elif pa.types.is_integer(t):
        base = "long"
    elif pa.types.is_float32(t):
        base = "float"
    elif pa.types.is_floating(t):
        base = "double"
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        base = "string"
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        base = "bytes"
    elif pa.types.is_decimal(t):
        base = {"type": "bytes", "logicalType": "decimal", "precision": t.precision, "scale": t.scale}
    elif pa.types.is_date32(t):
        base = {"type": "int", "logicalType": "date"}
    elif pa.types.is_timestamp(t):
        base = {"type": "long", "logicalType": "timestamp-micros" if t.tz else "local-timestamp-micros"}
    elif pa.types.is_list(t):
        base = {"type": "array", "items": _avro_type(t.value_type)}
    else:
        base = "string"
    return ["null", base]


def cdc_schema(table: str, schema) -> list:
    """The Avro writer schema of one table's changelog file (updates array + progress)."""
    fields = [{"name": f"c{i}_{avro_name(f.name)}", "type": _avro_type(f.type)} for i, f in enumerate(schema)]
    data = {"type": "record", "name": "data", "namespace": "com.materialize.cdc", "fields": fields,
            "doc": "columns: " + ", ".join(f.name for f in schema)}
    update = {"type": "record", "name": "update", "namespace": "com.materialize.cdc",
              "fields": [{"name": "data", "type": data}, {"name": "time", "type": "long"},
                         {"name": "diff", "type": "long"}]}
    return [{"type": "array", "items": update}, PROGRESS_SCHEMA]


def _plain_columns(rows, schema) -> list[list]:
    """Columns as Python values fastavro can write (dates/timestamps as their integer encodings)."""
    from tidemark.consolidate.layout import plain

    view = plain(rows.select(schema.names))
    return [view.column(f.name).to_pylist() for f in schema]


def cdc_bytes(table: str, schema, rows, times: list[int], diffs: list[int], lower: int, upper: int,
              chunk: int = 10_000) -> bytes:
    """One changelog file: update arrays then the progress record with per-time counts."""
    import fastavro

    names = [f"c{i}_{avro_name(f.name)}" for i, f in enumerate(schema)]
    cols = _plain_columns(rows, schema)
    counts: dict[int, int] = {}
    for t in times:
        counts[t] = counts.get(t, 0) + 1

    def records():
        batch = []
        for i in range(rows.num_rows):
            batch.append({"data": {n: c[i] for n, c in zip(names, cols)}, "time": times[i], "diff": diffs[i]})
            if len(batch) >= chunk:
                yield batch
                batch = []
        if batch:
            yield batch
        yield ("com.materialize.cdc.progress", {"lower": [lower], "upper": [upper],
                                                "counts": [{"time": t, "count": c} for t, c in sorted(counts.items())]})

    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(cdc_schema(table, schema)), records(),
                    metadata={"tidemark.table": table})
    return buf.getvalue()


def changelog_key(stream: str, table: str, lower: int, upper: int) -> str:
    from tidemark.store import stream_keys

    return f"{stream_keys(stream)['changelog']}{table}/{lower:016X}_{upper:016X}.avro"


def read_cdc(data: bytes) -> tuple[list[dict], dict]:
    """Decode a changelog file: (updates, progress)."""
    import fastavro

    updates, progress = [], None
    for datum in fastavro.reader(io.BytesIO(data), return_record_name=True):
        if isinstance(datum, list):
            updates.extend(datum)
        else:
            progress = datum[1]
    return updates, progress


def interval_key(stream: str, table: str, start, end) -> str:
    from tidemark.store import stream_keys

    fmt = "%Y%m%dT%H%M%SZ"
    return f"{stream_keys(stream)['changelog']}{table}/intervals/{start.strftime(fmt)}_{end.strftime(fmt)}.parquet"


def write_changelog(cfg, *, start, end) -> dict:
    """Write each table's consolidated changes committed in ``[start, end)`` (source commit time,
    UTC) as one Parquet file per table in the landing store; re-running an interval rewrites the
    same file with what is consolidated by then (a backfill). Reads only the Delta changelog's
    ``_commit_date`` partitions that overlap the interval. Returns ``{"tables": {table: rows},
    "uris": [...]}``."""
    import datetime as _dt

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from tidemark.lake import LakeError, read_changelog
    from tidemark.store import open_store

    def utc(t):
        return t.replace(tzinfo=_dt.timezone.utc) if t.tzinfo is None else t.astimezone(_dt.timezone.utc)

    start, end = utc(start), utc(end)
    store = open_store(cfg.landing.url, endpoint_url=cfg.landing.endpoint_url, region=cfg.landing.region)
    out: dict = {"tables": {}, "uris": []}
    for ref in cfg.source.tables:
        table = ref.qualified
        try:
            log = read_changelog(cfg, table, days=(start.date(), end.date()))
        except LakeError:
            continue
        ts = log.column("_commit_ts")
        mask = pc.and_(pc.greater_equal(ts, pa.scalar(start, ts.type)), pc.less(ts, pa.scalar(end, ts.type)))
        part = log.filter(mask).sort_by([("_time", "ascending")])
        buf = pa.BufferOutputStream()
        pq.write_table(part, buf)
        out["uris"].append(store.put(interval_key(cfg.stream, table, start, end), buf.getvalue().to_pybytes()))
        out["tables"][table] = part.num_rows
    return out
