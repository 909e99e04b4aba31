"""Segment decoding inside Spark executors (``mapInArrow`` over segment URIs): each segment's changes
as Arrow parts per (table shape, bucket) into the run's work area (`Work`), and a few small rows of
the kinds ``ids``, ``idn``, ``cnt``, ``seg``, ``evt``, ``lnk``, ``bad``, ``data`` for the driver
(docs/internals/batch.md); a huge segment piece by piece (`decode_segment_pieces`)."""

from __future__ import annotations

import json
from typing import Iterator

import numpy as np
import pyarrow as pa

from tidemark.consolidate.bucket_parts import by_bucket, data_row, filled_from_old_rows
from tidemark.consolidate.identities import identity_tally, ids_schema, rhash
from tidemark.consolidate.work_area import (META_POS, META_TIME, SpilledParts, Work, add_rows, decoded_arrow_schema,
                                            decoded_columns, ipc, meta_arrow_fields, put_parts)
from tidemark.errors import SegmentError, UnstorableValue
from tidemark.landing import segments      # its PIECE_RECORDS read when called: tests make it small
from tidemark.landing.store import read_uri
from tidemark.lsn import format_lsn
from tidemark.pgtypes import lake_array, TableSchema


def _payload_table(seg_name: str, shape, cols: dict, bad: list | None = None):
    """One table shape's updates (`read_segment_columns` columns) as Arrow: meta + lake-typed columns.
    A value the column's lake type cannot hold is null; its facts (the `tidemark.errors.UnstorableValue`
    detail) are appended to ``bad`` as ``(time, facts)``, the first such value per column; without
    ``bad`` it raises `UnstorableValue`."""
    keys = set(shape.key_columns)
    not_key = [c.name for c in shape.columns if c.name not in keys]
    full = cols["image"] == "full"
    arrays = [pa.array(cols["time"], pa.int64()), pa.array(cols["position"], pa.int64()).cast(pa.int32()),
              pa.array(cols["diff"], pa.int64()), pa.array(full, pa.bool_()),
              _unknown(full, cols["unchanged_toast"], not_key), pa.array(cols["xid"], pa.int64()),
              pa.array(cols["commit_ts"], pa.int64())]
    fields = meta_arrow_fields()
    for col in shape.columns:
        errs: list = []
        try:
            arrays.append(lake_array(col, cols["row"][col.name], unstorable=errs))
        except (ValueError, TypeError, OverflowError, ArithmeticError) as exc:
            raise SegmentError(seg_name, f"table {shape.qualified} column {col.name}: {exc}") from exc
        if errs:
            err = errs[0]
            time = int(cols["time"][err.row])
            value = err.value if isinstance(err.value, str) else repr(err.value)
            facts = {"table": shape.qualified, "column": err.column, "type": err.type_name, "lake_type": err.lake_type,
                     "value": value[:200], "lsn": format_lsn(time), "why": err.why, "segment": seg_name,
                     **({"fallback": err.fallback} if getattr(err, "fallback", None) else {})}
            if bad is None:
                raise UnstorableValue(seg_name, facts)
            bad.append((time, facts))
        fields.append(pa.field(col.name, arrays[-1].type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _unknown(full, toast, not_key: list[str]):
    """Each update's unknown columns (``list<string>``): those it left unchanged TOASTed (``toast``)
    for a whole image (``full``), every column but the key (``not_key``) for a key-only one (a delete's)."""
    if full.all():
        return toast
    n, k = len(full), len(not_key)
    toast_off = toast.offsets.to_numpy()
    lengths = np.where(full, np.diff(toast_off), k)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    row = np.repeat(np.arange(n), lengths)
    within = np.arange(offsets[-1]) - offsets[row]
    names = toast.values
    src = np.where(full[row], toast_off[row] + within, len(names) + within)
    flat = pa.concat_arrays([names, pa.array(not_key, names.type)]).take(pa.array(src))
    return pa.ListArray.from_arrays(pa.array(offsets), flat)


def decode_segment(uri: str, data: bytes, buckets: dict[str, int] | None = None,
                   texts: dict[str, list[str]] | None = None) -> dict[str, list]:
    """`decode_segment_pieces`' pieces of one segment together, each part's bytes in its ``payload``."""
    out = decoded_columns()
    for piece in decode_segment_pieces(uri, data, buckets, 1 << 62, texts):
        for k, v in piece.items():
            out[k] += v
    return out


def decode_segment_pieces(uri: str, data: bytes, buckets: dict[str, int] | None = None,
                          max_records: int | None = None,
                          texts: dict[str, list[str]] | None = None) -> Iterator[dict[str, list]]:
    """Decode one segment's bytes into decoded columns (`decoded_columns`), piece by piece of about
    ``max_records`` updates (`segments.read_segment_pieces`): each piece's ``data``, ``ids``, ``idn``,
    ``bad`` and ``lnk`` rows; the ``seg``, ``cnt`` and ``evt`` rows with the last piece. A table in
    ``buckets`` has its ``data`` cut into that many buckets. ``texts``: {table: its array columns the
    lake holds as PostgreSQL's text} (`TableSchema.with_text`); another array column's value its lists
    cannot hold is a ``bad`` row whose facts say ``fallback: text``."""
    name = uri.rsplit("/", 1)[-1]
    for piece, content in enumerate(segments.read_segment_pieces(data, name, max_records or segments.PIECE_RECORDS)):
        out = decoded_columns()

        def rows(n, kind, **values):
            add_rows(out, n, kind, name, **values)

        if content.last:
            rows(1, "seg", info=json.dumps({"seq": content.seq, "lower": content.lower, "upper": content.upper,
                                            "uri": uri}))
            if content.counts:
                rows(len(content.counts), "cnt", time=list(content.counts), count=list(content.counts.values()))
        data_rows = []
        ids: list = []      # every record's identity (table, time, position), per table shape and the events
        for rname in list(content.shapes):
            cols = content.shapes.pop(rname)        # each shape's columns dropped once in Arrow
            shape = content.relations[rname]
            shape = shape.with_text((texts or {}).get(shape.qualified))
            bad: list = []
            table = _payload_table(name, shape, cols, bad)
            del cols
            for time, facts in bad:
                rows(1, "bad", table=shape.qualified, time=time, info=json.dumps(facts, sort_keys=True))
            if shape.replica_identity == "f":
                table = filled_from_old_rows(table)
            n = table.num_rows
            ids.append(pa.table({"table": pa.repeat(pa.scalar(shape.qualified, pa.string()), n),
                                 "time": table.column(META_TIME), "position": table.column(META_POS),
                                 # `content_hashes`, for an identity that occurs twice
                                 "rhash": pa.nulls(n, pa.int64())}, schema=ids_schema()))
            info = json.dumps(shape.to_json(), sort_keys=True)
            keys = [] if shape.replica_identity == "f" else list(shape.key_columns)
            cut, links = by_bucket(table, (buckets or {}).get(shape.qualified),
                                    keys or [c.name for c in shape.columns], keys)
            del table
            if links is not None:
                rows(1, "lnk", table=shape.qualified, payload=links.astype("<i4").tobytes())
            data_rows += [data_row(shape.qualified, part, info, bucket) for bucket, part in cut]
            del cut
        if content.events:
            ids.append(pa.table({"table": [e.table for e in content.events], "time": [e.time for e in content.events],
                                 "position": [e.position for e in content.events],
                                 "rhash": [rhash(e.kind, e.table, e.xid, json.dumps(e.detail, sort_keys=True))
                                           for e in content.events]}, schema=ids_schema()))
        for e in content.events:
            rows(1, "evt", table=e.table, time=e.time, position=e.position,
                 info=json.dumps({"kind": e.kind, "detail": e.detail, "commit_ts": e.commit_ts}))
        if ids:
            ids = pa.concat_tables(ids)
            # the identities themselves go to the work area with the parts; their tally to the driver
            rows(1, "ids", position=piece, payload=ipc(ids))
            rows(1, "idn", position=piece, payload=ipc(identity_tally(ids)))
        for d in data_rows:
            rows(1, "data", **d)
        yield out


def held_as_text(lake_tables: dict, snaps, end: int) -> dict[str, list[str]]:
    """{table: its array columns held as PostgreSQL's text (`TableSchema.held_as_text`)} as the batch
    that decodes up to ``end`` merges them: per the newest of ``snaps`` (pending snapshots) of the table
    at or below ``end``, else the lake table's shape (``lake_tables``: {table: Delta table or None})."""
    from tidemark.lake import table_info  # deferred: tidemark.lake loads deltalake, which executors do not need

    out = {}
    for table, dt in lake_tables.items():
        pending = [s for s in snaps if table in s.tables and s.lsn <= end]
        if pending:
            doc = max(pending, key=lambda s: s.lsn).tables[table].get("table_schema")
        else:
            doc = table_info(dt).get("table_schema") if dt is not None else None
        names = TableSchema.from_json(doc).held_as_text if doc else []
        if names:
            out[table] = names
    return out


def decode_partition(batches: Iterator, endpoint_url: str | None, uris: list[str], buckets: dict[str, int],
                     work: Work, max_records: int | None = None,
                     texts: dict[str, list[str]] | None = None) -> Iterator:
    """``mapInArrow`` body over a ``spark.range``: ids in (segment i is ``uris[i]``); each segment's
    parts into the work area (`decode_segment_pieces`' arguments), its decoded rows out."""
    schema = decoded_arrow_schema()
    store = work.open()
    for batch in batches:
        for uri in [uris[i] for i in batch.column("id").to_pylist()]:
            key = work.key(uri.rsplit("/", 1)[-1])
            pieces = decode_segment_pieces(uri, read_uri(uri, endpoint_url=endpoint_url), buckets, max_records, texts)
            first = next(pieces)
            second = next(pieces, None)
            if second is None:          # one piece (most segments): its parts in one object, as they are
                put_parts(store, key, first)
                yield pa.RecordBatch.from_pydict(first, schema=schema)
                continue
            pending, first, second = [first, second], None, None
            with SpilledParts(store, key) as spill:       # a huge segment: its pieces' parts via a local file
                while (piece := pending.pop(0) if pending else next(pieces, None)) is not None:
                    spill.add(piece)
                    yield pa.RecordBatch.from_pydict(piece, schema=schema)
                    piece = None

