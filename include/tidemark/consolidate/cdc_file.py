"""The Materialize CDC file of a table's changelog feed (`changelog`): its Avro schema, its updates
encoded column by column (`avro_columns`; on the driver, the feed calls it from here alone), a whole
file in memory (`cdc_bytes`) or written to a landing-store key a block at a time (`write_feed_file`,
with what the executors wrote of it: `Written`) and reading one back. Field names are the source's
columns (`feed_field_names` for those Avro cannot hold; each field's ``doc`` is the real name); values
are in their lake form (dates ``int`` ``date``, timestamps ``long``
``timestamp-micros``/``local-timestamp-micros``, numerics ``bytes`` ``decimal``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa

from tidemark.consolidate import avro_columns as AC
from tidemark.consolidate.preconsolidate import consolidated_updates
from tidemark.lake.delta import conform
from tidemark.landing.segments import PROGRESS_SCHEMA
from tidemark.pgtypes import avro_name


def _avro_type(t) -> Any:
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


_AVRO_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def feed_field_names(names: list[str]) -> list[str]:
    """The Avro field name of each column in the feed: the column's own name when Avro can hold it
    (``[A-Za-z_][A-Za-z0-9_]*``); otherwise every other character replaced by ``_`` and a leading
    ``_`` before a digit (`avro_name`); a name that then collides with an earlier one gets ``_<i>``
    appended (``i`` = the column's position, from 0) until unique. Each field's ``doc`` is the
    column's real name."""
    out: list[str] = []
    taken = {n for n in names if _AVRO_FIELD.fullmatch(n)}
    for i, n in enumerate(names):
        if _AVRO_FIELD.fullmatch(n) and n not in out:
            out.append(n)
            continue
        cand = avro_name(n)
        while cand in out or (cand != n and cand in taken):
            cand = f"{cand}_{i}"
        out.append(cand)
    return out


def cdc_schema(table: str, schema) -> list:
    """The Avro writer schema of one table's changelog file (updates array + progress)."""
    names = feed_field_names(list(schema.names))
    fields = [{"name": n, "type": _avro_type(f.type), "doc": f.name} for n, f in zip(names, schema)]
    data = {"type": "record", "name": "data", "namespace": "com.materialize.cdc", "fields": fields,
            "doc": "columns: " + ", ".join(f.name for f in schema)}
    update = {"type": "record", "name": "update", "namespace": "com.materialize.cdc",
              "fields": [{"name": "data", "type": data}, {"name": "time", "type": "long"},
                         {"name": "diff", "type": "long"}]}
    return [{"type": "array", "items": update}, PROGRESS_SCHEMA]


def encode_updates(schema, rows, times, diffs, chunk: int = 10_000) -> list[bytes]:
    """The update-array datums (union branch 0, up to ``chunk`` updates each) of ``rows`` as they
    are (not consolidated), encoded column by column (`avro_columns`)."""
    data = conform(rows.select(schema.names), schema)
    encoded = AC.encode_rows([(data.column(i), True) for i in range(data.num_columns)]
                             + [(pa.array(int64s(times)), False), (pa.array(int64s(diffs)), False)])
    return AC.array_datums(encoded, chunk=chunk)


def int64s(v):
    """``v`` (an Arrow array, a list or a numpy array) as a numpy array of int64."""
    if isinstance(v, (pa.Array, pa.ChunkedArray)):
        return np.asarray(v.cast(pa.int64()).to_numpy(zero_copy_only=False), np.int64)
    return np.asarray(v, np.int64)


def cdc_bytes(table: str, schema, rows, times, diffs, lower: int, upper: int, chunk: int = 10_000,
              since: int | None = None, encoded: list[tuple[int, bytes]] | None = None,
              codec: str = "zstandard") -> bytes:
    """One changelog file: update arrays, pre-consolidated (`preconsolidate.consolidated_updates`: identical
    ``(data, time)`` summed into one update with ``diff = n``, zero sums dropped), in time order,
    then the progress record ``[lower, upper)`` whose counts per time are the distinct updates.
    ``since`` (not None) first writes the progress ``{lower: [since], upper: [lower], counts: []}``
    (a feed's first file: ``since = 0``). ``times``/``diffs``: one per row (lists or arrays).
    ``encoded``: the updates already encoded (``(number of datums, their bytes)`` groups of
    `encode_updates`), framed in the order given; only the progress counts come from ``times``.
    Blocks are compressed under ``codec``."""
    parsed = fastavro.parse_schema(cdc_schema(table, schema))
    datums = [progress_datum(parsed, since, lower)] if since is not None and since < lower else []
    if encoded is None:
        updates, t = consolidated_datums(schema, rows, times, diffs, chunk=chunk)
        datums += updates
    else:
        t = int64s(times)
        datums += [group for group in encoded if group[0]]
    datums.append(progress_datum(parsed, lower, upper, t))
    return AC.container(parsed, datums, metadata={"tidemark.table": table}, codec=codec)


def consolidated_datums(schema, rows, times, diffs, chunk: int = 10_000):
    """(the update-array datums of ``rows`` pre-consolidated: `preconsolidate.consolidated_updates`, in time
    order; the time of each update)."""
    data = conform(rows.select(schema.names), schema)
    t = int64s(times)
    keep, sums = consolidated_updates(data, t, int64s(diffs))
    return encode_updates(schema, data.take(pa.array(keep)), t[keep], sums, chunk=chunk), t[keep]


def progress_datum(parsed, lower: int, upper: int, times=(), counts=None) -> bytes:
    """The progress record ``[lower, upper)`` (union branch 1 of the parsed `cdc_schema`), counting
    the updates per time: ``counts[i]`` updates at ``times[i]`` (None: one each)."""
    t = int64s(times)
    c = np.ones(len(t), np.int64) if counts is None else int64s(counts)
    uniq, inv = np.unique(t, return_inverse=True)
    per_time = np.bincount(inv.reshape(-1), weights=c, minlength=len(uniq)).astype(np.int64) if len(uniq) else c
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, ("com.materialize.cdc.progress", {
        "lower": [lower], "upper": [upper],
        "counts": [{"time": int(a), "count": int(n)} for a, n in zip(uniq.tolist(), per_time.tolist())]}))
    return buf.getvalue()


@dataclass
class Written:
    """A batch's changelog as the executors wrote it (`merge.merge_group`), for `commit_changelog`:
    the Parquet files' add actions, the keys of the CDC parts (container blocks framed with
    ``sync``, compressed under ``codec``) in the landing store, and the number of updates per time
    (``times``, ``counts``)."""

    lo: int
    sync: bytes
    codec: str = "zstandard"
    files: list = field(default_factory=list)
    parts: list = field(default_factory=list)
    times: Any = None
    counts: Any = None


def write_feed_file(store, key: str, table: str, target, *, rows, written: Written | None, head, lower: int,
                     upper: int, since: int | None, metadata: dict, codec: str) -> None:
    """Write one changelog file to ``key``: the header, the ``since`` progress, the ``head`` rows (a
    snapshot base: `base_buckets`, consolidated and encoded here one bucket at a time) and either
    ``rows`` (encoded here) or the executors' parts (copied as they are, one at a time), then the
    progress record with every update's time counted. Its blocks are compressed under ``codec`` (the
    executors' parts were compressed with the same codec)."""
    parsed = fastavro.parse_schema(cdc_schema(table, target))
    sync = written.sync if written is not None else os.urandom(16)
    times = [np.zeros(0, np.int64)]
    counts = [np.zeros(0, np.int64)]
    fd, tmp = tempfile.mkstemp(prefix="tidemark-cdc-", suffix=".avro")
    store.delete(key)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(AC.header(parsed, metadata={"tidemark.table": table, **metadata}, sync=sync, codec=codec))
            if since is not None and since < lower:
                out.writelines(AC.blocks([progress_datum(parsed, since, lower)], sync, codec=codec))
            for t in [*(head or ()), rows]:     # the base one bucket at a time, then the rows
                if t is not None and t.num_rows:
                    datums, tt = consolidated_datums(target, t, t.column("_time"), t.column("_diff"))
                    out.writelines(AC.blocks(datums, sync, codec=codec))
                    times.append(tt)
                    counts.append(np.ones(len(tt), np.int64))
            if written is not None:
                for part in written.parts:
                    out.write(store.get(part))
                if written.times is not None:
                    times.append(np.asarray(written.times, np.int64))
                    counts.append(np.asarray(written.counts, np.int64))
            progress = progress_datum(parsed, lower, upper, np.concatenate(times), np.concatenate(counts))
            out.writelines(AC.blocks([progress], sync, codec=codec))
        store.put_file(key, tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_cdc(data: bytes) -> tuple[list[dict], dict]:
    """Decode a changelog file: (updates, its last progress record)."""
    updates, progress = read_cdc_all(data)
    return updates, progress[-1] if progress else None


def read_cdc_all(data: bytes) -> tuple[list[dict], list[dict]]:
    """Decode a changelog file: (updates, every progress record in order)."""
    updates, progress = [], []
    for datum in fastavro.reader(io.BytesIO(data), return_record_name=True):
        if isinstance(datum, list):
            updates.extend(datum)
        else:
            progress.append(datum[1])
    return updates, progress
