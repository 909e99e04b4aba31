"""Segment decoding inside Spark executors (``mapInArrow`` over segment URIs).

One pass over the segments yields, per segment, its changes as Arrow parts per (table, bucket),
written into one object of the run's work area in the landing store (`Work`: every node reaches
it; the merge reads the parts it needs by offset, `read_parts`), and a few small rows for the driver,
of these kinds:

* ``ids``  — one per segment (per piece of a huge one, see below; ``position`` is the piece's
  number): its identities, an Arrow IPC stream with one row per record (update or event):
  ``table``, ``time``, ``position``, ``rhash`` (a hash of an event's content; null for an update:
  most identities occur once, and hashing every record cost a third of the decoding, so only the
  updates whose identity occurs again are hashed, by `content_hashes`, when the driver finds one),
  put in the work area like a ``data`` part (``offset``, ``size``);
* ``idn``  — beside each ``ids`` row (same ``seg`` and ``position``): its `identity_tally`, per time
  the distinct positions, records and lowest and highest position. The driver checks completeness
  from the tallies (`identities`: memory per distinct time, not per record) and reads back only
  the identities of times where pieces' positions meet (segments overlap), as ``rec`` rows
  (`identity_rows`);
* ``cnt``  — one per ``{time, count}`` of a progress record;
* ``seg``  — one per segment (``info`` = JSON ``{seq, lower, upper}``);
* ``evt``  — one per event (truncate), with ``info`` = JSON ``{kind, detail}``;
* ``lnk``  — one per (segment, table) whose updates include a ``+1`` with unchanged TOAST values
  whose own ``-1`` (the record just before it) is in another bucket (an update that changed the key,
  or any update of a table without a key): ``payload`` is the bucket pairs as int32 (old, new), or
  ``(-1, -1)`` when the updates were not cut by bucket; the merge puts linked buckets in one group;
* ``bad``  — one per (segment, table shape, column) holding a value the column's lake type cannot hold
  (null in ``data``): ``time`` is the first such value's, ``info`` its `unstorable_facts` (JSON);
* ``data`` — one per (segment, table shape, bucket): the part, an Arrow IPC stream of that shape's
  updates in lake types plus ``_tm_*`` meta columns, is at ``offset`` (``size`` bytes) of the
  segment's object in the work area; ``info`` is the shape (`TableSchema.to_json`); ``time`` the
  newest record's time; ``position`` the number of updates; ``count`` the number of ``+1`` with
  unchanged TOAST values. ``bucket`` is Spark's bucket of each update's key under the shape (every
  column of a table without one), computed in Arrow by `sparkhash`, with the lake table's number of
  buckets; a table the decoding is given no bucket count for is not cut (``bucket`` null).

A segment of more than `segments.PIECE_RECORDS` updates (or the run's ``max_batch_records``, if fewer:
one huge transaction) is decoded piece by piece (`decode_segment_pieces`), so a task holds one piece's
updates, not the segment's: each piece gives its own ``data``, ``ids``, ``bad`` and ``lnk`` rows (a
segment's (shape, bucket) may then have several parts), and its parts are spilled to a local file
and put as the segment's one object of the work area (`_SpilledParts`).

A table whose parts were cut otherwise than its lake table cuts rows now (a table without a key
whose columns changed in the batch), and a re-snapshot's rows, are cut again by `cut_partition`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterator

META_TIME, META_POS, META_DIFF, META_FULL, META_UNKNOWN, META_XID, META_CTS = (
    "_tm_time", "_tm_pos", "_tm_diff", "_tm_full", "_tm_unknown", "_tm_xid", "_tm_cts")
META_COLUMNS = (META_TIME, META_POS, META_DIFF, META_FULL, META_UNKNOWN, META_XID, META_CTS)
# a re-snapshot's rows come as inserts at its LSN with this position (before any change committed at
# that LSN, after the truncate at RELOAD_POSITION - 1): synthetic records, each one kept (not deduped)
RELOAD_POSITION = -1

DECODED_DDL = ("kind string, seg string, table string, time long, position int, rhash long, "
               "count long, payload binary, info string, bucket int, offset long, size long")


@dataclass(frozen=True)
class Work:
    """One consolidation run's work area in the landing store (every node reaches it): an object per
    decoded segment (or cut source), ``<prefix><name>.parts``, holding its parts one after another,
    each an Arrow IPC stream (`put_parts`, `read_parts`). Deleted when the run ends (`discard`);
    what a stopped run left is deleted by the next (`discard` of the stream's whole area)."""

    store: tuple                 # (url, endpoint_url, region) of the landing store
    prefix: str                  # ``<stream>/_decoded/<run>-``

    def open(self):
        from tidemark.landing.store import open_store

        url, endpoint, region = self.store
        return open_store(url, endpoint_url=endpoint, region=region)

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}.parts"

    def discard(self, prefix: str | None = None) -> None:
        """Delete this run's objects (``prefix``: every object under it, e.g. the stream's area)."""
        store = self.open()
        for key in list(store.list(prefix or self.prefix.rsplit("/", 1)[0] + "/")):
            if prefix is not None or key.startswith(self.prefix):
                store.delete(key)


PARTS_KINDS = ("data", "ids")       # the decoded rows whose payloads go to the work area (`put_parts`)


def put_parts(store, key: str, cols: dict) -> None:
    """Write the ``data`` and ``ids`` rows' payloads of decoded columns (`decode_segment`) one after another as
    the object ``key``; each row then holds its part's ``offset`` and ``size`` instead."""
    blobs, pos = [], 0
    for i, kind in enumerate(cols["kind"]):
        if kind not in PARTS_KINDS:
            continue
        blob = cols["payload"][i]
        cols["offset"][i], cols["size"][i], cols["payload"][i] = pos, len(blob), None
        blobs.append(blob)
        pos += len(blob)
    if blobs:
        store.put(key, b"".join(blobs), durable=False)     # the run's own: lost with a crash, decoded again


def read_parts(store, work: Work, parts: list) -> list[bytes]:
    """The bytes of ``parts`` (``(name, offset, size)``: a part of the object ``work.key(name)``): one
    ranged read each, from a local directory one after another, from S3 (a GET each) a few at a time."""
    if len(parts) < 2 or hasattr(store, "local_path"):
        return [store.get_range(work.key(n), o, z) for n, o, z in parts]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(8, len(parts))) as pool:
        return list(pool.map(lambda p: store.get_range(work.key(p[0]), p[1], p[2]), parts))


def meta_arrow_fields():
    import pyarrow as pa

    return [pa.field(META_TIME, pa.int64()), pa.field(META_POS, pa.int32()), pa.field(META_DIFF, pa.int64()),
            pa.field(META_FULL, pa.bool_()), pa.field(META_UNKNOWN, pa.list_(pa.string())),
            pa.field(META_XID, pa.int64()), pa.field(META_CTS, pa.int64())]


def _rhash(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def unstorable_facts(seg_name: str, shape, err, time: int) -> dict:
    """What `tidemark.errors.UnstorableValue` says about a value `lake_array` could not store
    (``err``, a `tidemark.pgtypes.LakeValueError`) of the update at ``time``."""
    from tidemark.lsn import format_lsn

    return {"table": shape.qualified, "column": err.column, "type": err.type_name, "lake_type": err.lake_type,
            "value": (err.value if isinstance(err.value, str) else repr(err.value))[:200],
            "lsn": format_lsn(time), "why": err.why, "segment": seg_name,
            **({"fallback": err.fallback} if getattr(err, "fallback", None) else {})}


def _payload_table(seg_name: str, shape, cols: dict, bad: list | None = None):
    """One table shape's updates (`read_segment_columns` columns) as Arrow: meta + lake-typed columns.

    A value the column's lake type cannot hold is null in the table and its `unstorable_facts` are
    appended to ``bad`` (the first such value per column; the driver stops the consolidation with
    them unless a pending snapshot of the table supersedes the value); without ``bad`` it raises
    `tidemark.errors.UnstorableValue`."""
    import pyarrow as pa

    from tidemark.errors import SegmentError, UnstorableValue
    from tidemark.pgtypes import lake_array

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
            time = int(cols["time"][errs[0].row])
            facts = unstorable_facts(seg_name, shape, errs[0], time)
            if bad is None:
                raise UnstorableValue(seg_name, facts)
            bad.append((time, facts))
        fields.append(pa.field(col.name, arrays[-1].type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _unknown(full, toast, not_key: list[str]):
    """Each update's unknown columns (``list<string>``): those it left unchanged TOASTed (``toast``)
    for a whole image (``full``), every column but the key (``not_key``) for a key-only one (a delete's)."""
    import numpy as np
    import pyarrow as pa

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


def _filled_from_old_rows(table):
    """A table without a key (REPLICA IDENTITY FULL): an update's ``+1`` that left TOAST values
    unchanged takes them from its own ``-1`` (the whole old row, the record just before it), so the
    row is whole before it is hashed into its bucket (a multiset's bucket is a hash of every
    column). A ``+1`` without such a ``-1`` is left as it is (the merge names it)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = table.num_rows
    unknown = table.column(META_UNKNOWN)
    i = _toasted_after_own_minus(table)
    i = i[pc.fill_null(pc.list_value_length(unknown), 0).to_numpy()[i - 1] == 0]    # a whole old row
    if not len(i):
        return table
    flat = pc.list_flatten(unknown).to_numpy(zero_copy_only=False)
    parent = pc.list_parent_indices(unknown).to_numpy()
    filled = np.zeros(n, bool)
    filled[i] = True
    cols = []
    for f in table.schema:
        rows = parent[(flat == f.name) & filled[parent]] if f.name not in META_COLUMNS else []
        if not len(rows):
            cols.append(table.column(f.name))
            continue
        idx = np.arange(n)
        idx[rows] = rows - 1
        cols.append(table.column(f.name).take(pa.array(idx, pa.int64())))
    out = pa.Table.from_arrays(cols, schema=table.schema)
    empty = pa.array([[] if filled[k] else v for k, v in enumerate(unknown.to_pylist())], unknown.type)
    return out.set_column(out.schema.get_field_index(META_UNKNOWN), META_UNKNOWN, empty)


def _ipc(table) -> bytes:
    """``table`` as one Arrow IPC stream, its buffers LZ4-compressed (any IPC reader reads them): a
    decoded part crosses the JVM four times (into the cache, out of it, through the shuffle, to
    the merge), and compressed it is about a quarter of the bytes."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def record_hashes(qualified: str, table) -> list[int]:
    """A 64-bit hash of each update's content (table, diff, image, unknown columns, xid, values; not
    its time, position or commit time), so two different records claiming one identity are caught:
    XXH64 of the record's Avro encoding (`avro_columns`, built column by column from the lake-typed
    ``table``), seeded with the XXH64 of the table's name."""
    import numpy as np
    import xxhash

    from tidemark.consolidate.avro_columns import encode_rows

    content = [META_DIFF, META_FULL, META_UNKNOWN, META_XID] + [c for c in table.column_names
                                                                if c not in META_COLUMNS]
    off, data = encode_rows([(table.column(c), True) for c in content])
    seed = xxhash.xxh64_intdigest(qualified.encode())
    view = memoryview(data)
    h = xxhash.xxh64_intdigest
    bounds = off.tolist()
    out = np.fromiter((h(view[a:b], seed) for a, b in zip(bounds[:-1], bounds[1:])), dtype=np.uint64,
                      count=len(bounds) - 1)
    return out.view(np.int64).tolist()


def decode_segment(uri: str, data: bytes, buckets: dict[str, int] | None = None,
                   texts: dict[str, list[str]] | None = None) -> dict[str, list]:
    """Decode one segment's bytes into columns of the decoded DataFrame (see module doc), each part's
    bytes in its ``payload``; a table in ``buckets`` has its ``data`` cut into that many buckets. The
    whole segment at once (`decode_segment_pieces`' pieces together): for small segments and tests."""
    out: dict[str, list] = {k: [] for k in decoded_arrow_schema().names}
    for piece in decode_segment_pieces(uri, data, buckets, 1 << 62, texts):
        for k, v in piece.items():
            out[k] += v
    return out


def decode_segment_pieces(uri: str, data: bytes, buckets: dict[str, int] | None = None,
                          max_records: int | None = None,
                          texts: dict[str, list[str]] | None = None) -> Iterator[dict[str, list]]:
    """Decode one segment's bytes into columns of the decoded DataFrame (see module doc), piece by piece
    (`segments.read_segment_pieces`: at most about ``max_records`` updates at a time, so one huge
    segment never is held decoded whole): each piece's ``data`` rows (its parts per (table shape,
    bucket): a segment's (shape, bucket) may have several), ``ids``, ``bad`` and ``lnk`` rows; the
    segment's ``seg``, ``cnt``, ``evt`` rows and the events' ``ids`` with the last piece. An update's
    ``-1`` and ``+1`` are never in two pieces (a piece ends between container blocks, which hold whole
    arrays of whole messages).

    ``texts``: {table: its array columns the lake holds as PostgreSQL's text} (`TableSchema.with_text`):
    their values stay the text the segment carries, the ``data`` rows' shape says so; every other
    array column's text is parsed into lists (`pgtypes.lake_array`), a value they cannot hold is a
    ``bad`` row whose facts say ``fallback: text``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tidemark.landing.segments import PIECE_RECORDS, read_segment_pieces

    name = uri.rsplit("/", 1)[-1]
    for piece, content in enumerate(read_segment_pieces(data, name, max_records or PIECE_RECORDS)):
        out: dict[str, list] = {k: [] for k in decoded_arrow_schema().names}

        def rows(n, kind, table=None, time=None, position=None, rhash=None, count=None, payload=None, info=None,
                 bucket=None):
            for k, v in (("kind", kind), ("seg", name), ("table", table), ("time", time), ("position", position),
                         ("rhash", rhash), ("count", count), ("payload", payload), ("info", info), ("bucket", bucket),
                         ("offset", None), ("size", None)):
                out[k].extend(v if isinstance(v, list) else [v] * n)

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
                table = _filled_from_old_rows(table)
            n = table.num_rows
            ids.append(pa.table({"table": pa.repeat(pa.scalar(shape.qualified, pa.string()), n),
                                 "time": table.column(META_TIME), "position": table.column(META_POS),
                                 # `content_hashes`, for an identity that occurs twice
                                 "rhash": pa.nulls(n, pa.int64())}, schema=ids_schema()))
            info = json.dumps(shape.to_json(), sort_keys=True)
            keys = [] if shape.replica_identity == "f" else list(shape.key_columns)
            cut, links = _by_bucket(table, (buckets or {}).get(shape.qualified),
                                    keys or [c.name for c in shape.columns], keys)
            del table
            if links is not None:
                rows(1, "lnk", table=shape.qualified, payload=links.astype("<i4").tobytes())
            for bucket, part in cut:
                toasted = pc.sum(pc.and_(pc.greater(part.column(META_DIFF), 0),
                                         pc.greater(pc.fill_null(pc.list_value_length(part.column(META_UNKNOWN)), 0),
                                                    0)))
                data_rows.append(dict(table=shape.qualified, time=pc.max(part.column(META_TIME)).as_py(),
                                      position=part.num_rows, count=toasted.as_py() or 0, payload=_ipc(part),
                                      info=info, bucket=bucket))
            del cut
        if content.events:
            ids.append(pa.table({"table": [e.table for e in content.events], "time": [e.time for e in content.events],
                                 "position": [e.position for e in content.events],
                                 "rhash": [_rhash(e.kind, e.table, e.xid, json.dumps(e.detail, sort_keys=True))
                                           for e in content.events]}, schema=ids_schema()))
        for e in content.events:
            rows(1, "evt", table=e.table, time=e.time, position=e.position,
                 info=json.dumps({"kind": e.kind, "detail": e.detail, "commit_ts": e.commit_ts}))
        if ids:
            ids = pa.concat_tables(ids)
            # the identities themselves go to the work area with the parts; their tally to the driver
            rows(1, "ids", position=piece, payload=_ipc(ids))
            rows(1, "idn", position=piece, payload=_ipc(identity_tally(ids)))
        for d in data_rows:
            rows(1, "data", **d)
        yield out


def _by_bucket(table, n: int | None, hashed: list[str], keys: list[str]):
    """(``[(bucket, rows)]``, links): one table shape's updates cut into ``n`` buckets by the
    ``hashed`` columns (in their order within one), or ``[(None, table)]`` without ``n``; and the
    ``lnk`` pairs (`_links`), None when there are none."""
    import numpy as np

    from tidemark.consolidate import sparkhash

    if n is None:
        return [(None, table)], _links(table, None, keys)
    b = sparkhash.buckets(table, hashed, n)
    links = _links(table, b, keys)
    order = np.argsort(b, kind="stable")
    b = b[order]
    table = table.take(order)
    starts = np.r_[0, np.nonzero(np.diff(b))[0] + 1]
    ends = np.r_[starts[1:], len(b)]
    return [(int(b[a]), table.slice(a, e - a)) for a, e in zip(starts.tolist(), ends.tolist())], links


def _toasted_after_own_minus(table):
    """Indices of the ``+1`` records that leave TOAST values unchanged and follow their own update's
    ``-1`` (the record just before them, at ``(time, position - 1)``, in segment order)."""
    import numpy as np
    import pyarrow.compute as pc

    if table.num_rows < 2:
        return np.zeros(0, np.int64)
    diff = table.column(META_DIFF).to_numpy()
    toasted = (diff > 0) & (pc.fill_null(pc.list_value_length(table.column(META_UNKNOWN)), 0).to_numpy() > 0)
    toasted[0] = False
    i = np.nonzero(toasted)[0]
    t = table.column(META_TIME).to_numpy()
    p = table.column(META_POS).to_numpy()
    return i[(diff[i - 1] < 0) & (t[i - 1] == t[i]) & (p[i - 1] == p[i] - 1)]


def _links(table, buckets, keys: list[str]):
    """The distinct (bucket of the ``-1``, bucket of the ``+1``) pairs of the updates whose ``+1``
    leaves TOAST values unchanged and whose ``-1`` (at ``(time, position - 1)``, the record before
    it in segment order) is in another bucket; when ``buckets`` is None (not cut), ``[(-1, -1)]``
    if such an update changed its key (``keys``; a table without one: any such update); None when
    there are none. Such a ``+1`` takes its unchanged values from that ``-1``'s image, so the
    merge must see both."""
    import numpy as np
    import pyarrow.compute as pc

    i = _toasted_after_own_minus(table)
    if not len(i):
        return None
    if buckets is None:
        if keys and len(i):
            same = np.ones(len(i), bool)
            for k in keys:
                c = table.column(k).take(i)
                prev = table.column(k).take(i - 1)
                same &= pc.fill_null(pc.equal(c, prev), False).to_numpy(zero_copy_only=False)
            i = i[~same]
        return np.array([[-1, -1]], np.int32) if len(i) else None
    pairs = np.stack([buckets[i - 1], buckets[i]], axis=1).astype(np.int32)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    return np.unique(pairs, axis=0) if len(pairs) else None


def _ident(time, position):
    """One int64 per identity ``(time, position)``, for set lookups that pick which records to hash
    (`with_content_hashes`): times 2^32 apart wrap to one value, so a few more may be picked; the
    check itself (`plan.completeness_rows`) compares time and position apart."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.add(pc.multiply(time.cast(pa.int64()), 1 << 32), position.cast(pa.int64()))


def content_hashes(batches: Iterator, wanted: list[int], work: Work) -> Iterator:
    """``mapInArrow`` body: decoded ``data`` rows (seg, table, offset, size) in; one `identity_rows`
    ``rec`` row out for each update whose identity (`_ident`) is in ``wanted``, with its
    `record_hashes` value as ``rhash``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    want = pa.array(wanted, pa.int64())
    store = work.open()
    for batch in batches:
        segs, tables = batch.column("seg").to_pylist(), batch.column("table").to_pylist()
        payloads = read_parts(store, work, list(zip(segs, batch.column("offset").to_pylist(),
                                                    batch.column("size").to_pylist())))
        for seg, table, payload in zip(segs, tables, payloads):
            part = pa.ipc.open_stream(payload).read_all()
            part = part.filter(pc.is_in(_ident(part.column(META_TIME), part.column(META_POS)), value_set=want))
            n = part.num_rows
            if n:
                yield pa.RecordBatch.from_pydict(
                    {"kind": ["rec"] * n, "seg": [seg] * n, "table": [table] * n,
                     "time": part.column(META_TIME).combine_chunks(), "position": part.column(META_POS).combine_chunks(),
                     "rhash": pa.array(record_hashes(table, part), pa.int64()), "count": pa.nulls(n, pa.int64())},
                    schema=identity_schema())


def identity_schema():
    """The schema of `identity_rows`."""
    import pyarrow as pa

    return pa.schema([("kind", pa.string()), ("seg", pa.string()), ("table", pa.string()), ("time", pa.int64()),
                      ("position", pa.int32()), ("rhash", pa.int64()), ("count", pa.int64())])


def with_content_hashes(ids, rehash):
    """The collected identity rows (`identity_rows`) made ready for `plan.completeness_rows`. An
    update whose identity ``(time, position)`` occurs once gets rhash 0 (there is nothing to tell it
    from); the updates of an identity that occurs again (in two segments, or twice in one) are
    replaced by the rows ``rehash(wanted, segs)`` returns (`content_hashes` over the decoded
    ``data`` of the segments ``segs``, called only then, with those identities as `_ident` values):
    the same records, with their content hash, so two different records claiming one identity are
    caught."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if ids.num_rows == 0:
        return ids
    is_rec = pc.equal(ids.column("kind"), "rec").to_numpy(zero_copy_only=False)
    # `_ident` in numpy (the same wrapping int64 arithmetic), without copying the rows
    ident = (pc.fill_null(ids.column("time"), 0).to_numpy(zero_copy_only=False).astype(np.int64) * (1 << 32)
             + pc.fill_null(ids.column("position"), 0).to_numpy(zero_copy_only=False).astype(np.int64))
    idents = np.sort(ident[is_rec])
    twice = np.unique(idents[1:][idents[1:] == idents[:-1]])
    rhash = ids.column("rhash")
    update = pa.array(is_rec & (rhash.is_null().to_numpy(zero_copy_only=False) if rhash.null_count
                                else np.zeros(ids.num_rows, bool)))
    if len(twice):
        update = pc.and_(pc.equal(ids.column("kind"), "rec"), pc.is_null(ids.column("rhash")))
        wanted = pa.array(twice, pa.int64())
        again = pc.and_(update, pc.is_in(_ident(ids.column("time"), ids.column("position")), value_set=wanted))
        hashed = rehash(wanted.to_pylist(), sorted(set(ids.filter(again).column("seg").to_pylist())))
        ids = pa.concat_tables([ids.filter(pc.invert(again)), hashed.cast(ids.schema)])
        update = pc.and_(pc.equal(ids.column("kind"), "rec"), pc.is_null(ids.column("rhash")))
    return ids.set_column(ids.column_names.index("rhash"), "rhash",
                          pc.if_else(update, pa.scalar(0, pa.int64()), ids.column("rhash")))


def ids_schema():
    import pyarrow as pa

    return pa.schema([("table", pa.string()), ("time", pa.int64()), ("position", pa.int32()), ("rhash", pa.int64())])


def identity_rows(small):
    """The collected ``ids`` and ``cnt`` rows (kind, seg, payload, time, count) as the rows
    `plan.completeness_rows` reads: one ``rec`` row per record (kind, seg, table, time, position,
    rhash, count) and the ``cnt`` rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kinds = small.column("kind")
    parts = []
    ids = small.filter(pc.equal(kinds, "ids"))
    for seg, payload in zip(ids.column("seg").to_pylist(), ids.column("payload").to_pylist()):
        t = pa.ipc.open_stream(payload).read_all()
        parts.append(pa.table({"kind": pa.repeat(pa.scalar("rec", pa.string()), t.num_rows),
                               "seg": pa.repeat(pa.scalar(seg, pa.string()), t.num_rows), "table": t.column("table"),
                               "time": t.column("time"), "position": t.column("position"),
                               "rhash": t.column("rhash"), "count": pa.nulls(t.num_rows, pa.int64())}))
    cnt = small.filter(pc.equal(kinds, "cnt")).select(["kind", "seg", "table", "time", "position", "rhash", "count"])
    schema = identity_schema()
    return pa.concat_tables([*(p.cast(schema) for p in parts), cnt.cast(schema)])


def tally_schema():
    """The schema of `identity_tally`."""
    import pyarrow as pa

    return pa.schema([("time", pa.int64()), ("n", pa.int64()), ("rows", pa.int64()), ("lo", pa.int64()),
                      ("hi", pa.int64())])


def identity_tally(ids):
    """A piece's identities (`ids_schema` rows) per time: ``n`` distinct positions among ``rows``
    records, the lowest and highest position (``lo``, ``hi``). Null times and positions count as 0,
    as `plan.completeness_rows` counts them."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    t = pc.fill_null(ids.column("time"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    p = pc.fill_null(ids.column("position"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.lexsort((p, t))
    t, p = t[order], p[order]
    new_t = np.r_[True, t[1:] != t[:-1]] if len(t) else np.zeros(0, bool)
    new_id = new_t | (np.r_[True, p[1:] != p[:-1]] if len(t) else new_t)
    at = np.nonzero(new_t)[0]
    ends = np.r_[at[1:], len(t)]
    n = np.add.reduceat(new_id.astype(np.int64), at) if len(at) else np.zeros(0, np.int64)
    return pa.Table.from_arrays([pa.array(t[at]), pa.array(n), pa.array(ends - at), pa.array(p[at]),
                                 pa.array(p[ends - 1] if len(at) else np.zeros(0, np.int64))], schema=tally_schema())


@dataclass(frozen=True)
class Identities:
    """What the driver holds for the completeness check (`plan.completeness_rows`) of a run's decoded
    rows (`identities`): ``counted``, the times whose distinct records the tallies give exactly
    (``time``, ``seen``), and ``rows``, the ``rec`` rows of the other times (an identity that may occur
    twice: segments overlap) and every ``cnt`` row (`identity_schema`)."""

    counted: Any
    rows: Any


def identities(small, read=None) -> Identities:
    """The collected decoded rows' identities (`Identities`), in memory that follows the number of
    distinct times, not of records: each piece of a segment sends its tally (``idn``: per time, the
    distinct positions, the records, the lowest and highest position; `identity_tally`); a time
    whose records come from one piece, each identity once, or from pieces whose position ranges
    are apart, has as many distinct records as the tallies sum (``counted``). Only the pieces with a
    time where position ranges meet (an overlap of segments: a transaction landed again) or a
    position occurs twice have their identities read (the ``ids`` parts: from the work area by
    ``read([(seg, offset, size)])``, `read_parts`, or the row's payload), and only those times' kept
    as ``rec`` rows (`identity_rows`): an identity that occurs twice is in them."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    kinds = small.column("kind")
    idn = small.filter(pc.equal(kinds, "idn"))
    tallies = [pa.ipc.open_stream(p).read_all() for p in idn.column("payload").to_pylist()]
    piece = np.repeat(np.arange(len(tallies)), [t.num_rows for t in tallies])
    tally = pa.concat_tables(tallies) if tallies else tally_schema().empty_table()
    del tallies
    t, n, rows, lo, hi = (tally.column(c).to_numpy() for c in ("time", "n", "rows", "lo", "hi"))
    order = np.lexsort((lo, t))
    t, n, rows, lo, hi, piece = t[order], n[order], rows[order], lo[order], hi[order], piece[order]
    new_t = np.r_[True, t[1:] != t[:-1]] if len(t) else np.zeros(0, bool)
    group = np.cumsum(new_t) - 1
    # the highest position of the pieces before each one at its time (positions are int32: a group's
    # offset of 2^33 keeps the running maximum within the group)
    key = group.astype(np.int64) * (1 << 33) + (hi + (1 << 31))
    before = np.r_[np.int64(-1), np.maximum.accumulate(key)[:-1]] if len(t) else key
    apart = new_t | (lo + (1 << 31) + group.astype(np.int64) * (1 << 33) > before)
    exact_row = apart & (rows == n)
    at = np.nonzero(new_t)[0]
    exact = np.minimum.reduceat(exact_row.astype(np.int8), at).astype(bool) if len(at) else np.zeros(0, bool)
    seen = np.add.reduceat(n, at) if len(at) else np.zeros(0, np.int64)
    counted = pa.table({"time": pa.array(t[at][exact], pa.int64()), "seen": pa.array(seen[exact], pa.int64())})
    # the pieces with a time not counted, and those times
    loose = ~exact[group] if len(t) else np.zeros(0, bool)
    loose_times = pa.array(np.unique(t[loose]), pa.int64())
    wanted = {(idn.column("seg")[int(k)].as_py(), idn.column("position")[int(k)].as_py())
              for k in np.unique(piece[loose]).tolist()}
    ids = small.filter(pc.equal(kinds, "ids"))
    picked = [i for i, key in enumerate(zip(ids.column("seg").to_pylist(), ids.column("position").to_pylist()))
              if key in wanted]
    parts = []
    for i in picked:        # one piece's identities at a time, those at a loose time kept
        row = ids.slice(i, 1).to_pylist()[0]
        payload = row["payload"] if row["payload"] is not None else read([(row["seg"], row["offset"], row["size"])])[0]
        one = pa.Table.from_pydict({k: [v] for k, v in row.items()}, schema=small.schema).set_column(
            small.schema.get_field_index("payload"), "payload", pa.array([payload], pa.binary()))
        recs = identity_rows(one)
        parts.append(recs.filter(pc.is_in(pc.fill_null(recs.column("time"), 0), value_set=loose_times)))
    cnt = identity_rows(small.filter(pc.equal(kinds, "cnt")))
    return Identities(counted=counted, rows=pa.concat_tables([*parts, cnt]))


def held_as_text(lake_tables: dict, snaps=(), end: int | None = None) -> dict[str, list[str]]:
    """{table: its array columns held as PostgreSQL's text (`TableSchema.held_as_text`)} as the batch
    that decodes up to ``end`` merges them: the newest of ``snaps`` (pending snapshots) of the table at
    or below ``end`` says so (it replaces or corrects the table in this batch), else the lake table's
    recorded shape (``lake_tables``: {table: its Delta table or None}). For `decode_partition`."""
    from tidemark.lake import table_info
    from tidemark.pgtypes import TableSchema

    out = {}
    for table, dt in lake_tables.items():
        pending = [s for s in snaps if table in s.tables and (end is None or s.lsn <= end)]
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
    parts (tables in ``buckets`` cut into that many) into the work area, its decoded rows out. A
    segment is decoded in pieces of about ``max_records`` updates (`decode_segment_pieces`; default
    `segments.PIECE_RECORDS`), so a task's memory follows that, not the segment's size."""
    import pyarrow as pa

    from tidemark.landing.store import read_uri

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
            with _SpilledParts(store, key) as spill:       # a huge segment: its pieces' parts via a local file
                while (piece := pending.pop(0) if pending else next(pieces, None)) is not None:
                    spill.add(piece)
                    yield pa.RecordBatch.from_pydict(piece, schema=schema)
                    piece = None


class _SpilledParts:
    """The parts of a segment decoded in several pieces, written one piece at a time to a local
    temporary file (``$TIDEMARK_SPILL_DIR`` or the system's), then put as the segment's object of the
    work area (`put_parts` for the pieces together, without holding them)."""

    def __init__(self, store, key: str):
        import os
        import tempfile

        self.store, self.key, self.pos = store, key, 0
        self.file = tempfile.NamedTemporaryFile(dir=os.environ.get("TIDEMARK_SPILL_DIR") or None,
                                                prefix="tidemark-parts-", delete=False)

    def add(self, cols: dict) -> None:
        """Write the ``data`` and ``ids`` rows' payloads of ``cols`` after the others; each row then holds its
        part's ``offset`` and ``size`` instead (as `put_parts` does)."""
        for i, kind in enumerate(cols["kind"]):
            if kind not in PARTS_KINDS:
                continue
            blob = cols["payload"][i]
            cols["offset"][i], cols["size"][i], cols["payload"][i] = self.pos, len(blob), None
            self.file.write(blob)
            self.pos += len(blob)

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        import os

        try:
            self.file.close()
            if kind is None and self.pos:
                self.store.put_file(self.key, self.file.name)
        finally:
            os.unlink(self.file.name)


def decoded_arrow_schema():
    import pyarrow as pa

    return pa.schema([("kind", pa.string()), ("seg", pa.string()), ("table", pa.string()), ("time", pa.int64()),
                      ("position", pa.int32()), ("rhash", pa.int64()), ("count", pa.int64()),
                      ("payload", pa.binary()), ("info", pa.string()), ("bucket", pa.int32()),
                      ("offset", pa.int64()), ("size", pa.int64())])


@dataclass(frozen=True)
class Cut:
    """How `cut_partition` cuts one table's rows: its schema now (meta columns + the table's, ``full``;
    JSON ``shape``), the hashed columns (its key, or every column), the number of buckets, and what
    its older rows need (``fill``: ADD COLUMN ... DEFAULT; ``renames``: RENAME COLUMN)."""

    full: Any
    shape: str
    hashed: tuple
    buckets: int
    fill: dict
    renames: dict


def cut_partition(batches: Iterator, units: list, cuts: dict[str, Cut], work: Work, endpoint: str | None
                  ) -> Iterator:
    """``mapInArrow`` body over a ``spark.range``: unit ids in; each unit's rows in their table's
    schema now, cut by its lake buckets (`Cut`), written as one object of the work area, and their
    ``data`` rows (`decoded_arrow_schema`) out. A unit is ``("parts", name, [(table, seg, offset,
    size)])``, parts decoded and cut otherwise than the lake table cuts now, or ``("reload", name,
    table, uri, lsn, position, cts)``, a re-snapshot's file: its rows as inserts at ``(lsn,
    position)`` with commit time ``cts`` (`reload_rows`)."""
    import pyarrow as pa
    import pyarrow.compute as pc


    schema = decoded_arrow_schema()
    store = work.open()
    for batch in batches:
        for unit in [units[i] for i in batch.column("id").to_pylist()]:
            rows: dict[str, list] = {}
            if unit[0] == "parts":
                _, name, parts = unit
                payloads = read_parts(store, work, [(seg, off, size) for _, seg, off, size in parts])
                for (table, *_), payload in zip(parts, payloads):
                    c = cuts[table]
                    rows.setdefault(table, []).append(conform_payload(pa.ipc.open_stream(payload).read_all(), c.full,
                                                                      table, c.fill, c.renames))
            else:
                _, name, table, uri, lsn, position, cts = unit
                c = cuts[table]
                got = reload_rows([pa.record_batch({"uri": [uri]})], c.full, endpoint, lsn, position, cts, c.renames,
                                  c.fill)
                rows[table] = [pa.Table.from_batches([b], schema=c.full) for b in got]
            out: dict[str, list] = {k: [] for k in schema.names}
            for table, tables in rows.items():
                c = cuts[table]
                t = pa.concat_tables(tables) if tables else c.full.empty_table()
                if not t.num_rows:
                    continue
                for bucket, part in _by_bucket(t, c.buckets, list(c.hashed), [])[0]:
                    toasted = pc.sum(pc.and_(pc.greater(part.column(META_DIFF), 0), pc.greater(
                        pc.fill_null(pc.list_value_length(part.column(META_UNKNOWN)), 0), 0))).as_py() or 0
                    for k, v in (("kind", "data"), ("seg", name), ("table", table),
                                 ("time", pc.max(part.column(META_TIME)).as_py()), ("position", part.num_rows),
                                 ("rhash", None), ("count", toasted), ("payload", _ipc(part)), ("info", c.shape),
                                 ("bucket", bucket), ("offset", None), ("size", None)):
                        out[k].append(v)
            put_parts(store, work.key(name), out)
            yield pa.RecordBatch.from_pydict(out, schema=schema)


def snapshot_rows(batches, target, endpoint: str | None, renames: dict | None = None,
                  fill: dict | None = None) -> Iterator:
    """``mapInArrow`` body: snapshot file URIs in, their rows (the lake schema ``target``; columns
    renamed since the copy, ``renames``, under their new names; columns added since, ``fill``'s
    value or null) out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tidemark.consolidate.layout import conform, with_renames
    from tidemark.landing.store import read_uri

    for batch in batches:
        for uri in batch.column("uri").to_pylist():
            rows = pq.read_table(pa.BufferReader(read_uri(uri, endpoint_url=endpoint)))
            yield from conform(with_renames(rows, renames), target, fill).to_batches()


def reload_rows(batches, full, endpoint: str | None, lsn: int, position: int, cts: int,
                renames: dict | None = None, fill: dict | None = None) -> Iterator:
    """``mapInArrow`` body: a re-snapshot's Parquet file URIs in; its rows out as whole-row inserts at
    ``(lsn, position)`` in the ``full`` schema (meta columns + the table's; ``renames``: columns
    renamed since the copy; ``fill``: the missing value of columns added after it, a DEFAULT's,
    which its rows hold as every row that existed then does)."""
    import pyarrow as pa

    target = pa.schema([f for f in full if f.name not in META_COLUMNS])
    for t in snapshot_rows(batches, target, endpoint, renames, fill):
        n = t.num_rows
        meta = {META_TIME: pa.array([lsn] * n, pa.int64()), META_POS: pa.array([position] * n, pa.int32()),
                META_DIFF: pa.array([1] * n, pa.int64()), META_FULL: pa.array([True] * n, pa.bool_()),
                META_UNKNOWN: pa.array([[]] * n, pa.list_(pa.string())), META_XID: pa.array([0] * n, pa.int64()),
                META_CTS: pa.array([cts] * n, pa.int64())}
        yield from pa.Table.from_arrays([meta[f.name] if f.name in meta else t.column(f.name) for f in full],
                                        schema=full).to_batches()


def conform_payload(part, target, table: str, fill: dict | None = None, renames: dict | None = None):
    """One ``data`` payload's changes in the ``target`` schema (meta + the table's columns now).

    Columns the target has and a payload lacks (added later) are null, or hold ``fill``'s value (a
    column added with a DEFAULT: every row that lacks it holds it, as in PostgreSQL); columns a
    payload has and the target lacks (dropped since) are left out; a payload from before a RENAME
    COLUMN has the column under its old name (``renames``: old -> new)."""
    import pyarrow as pa

    from tidemark.consolidate.layout import with_renames
    from tidemark.errors import TidemarkError

    part = with_renames(part, renames)
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
        elif fill and field.name in fill:
            arrays.append(pa.repeat(fill[field.name], part.num_rows))
        else:
            arrays.append(pa.nulls(part.num_rows, field.type))
    return pa.Table.from_arrays(arrays, schema=target)
