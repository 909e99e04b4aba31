"""The records' identities ``(table, time, position)`` of the decoded rows, for the completeness check
(`plan.completeness_rows`): each piece's identities (``ids``) and their tally per time (``idn``,
`identity_tally`), what the driver holds of them (`identities`), and the content hashes that tell two
records claiming one identity apart (`record_hashes`, `content_hashes`, `with_content_hashes`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from tidemark.consolidate.avro_columns import encode_rows
from tidemark.consolidate.work_area import META_COLUMNS, META_DIFF, META_FULL, META_POS, META_TIME, META_UNKNOWN, \
    META_XID, Work, decoded_arrow_schema, read_parts


def rhash(*parts: Any) -> int:
    """An event's content hash (its kind, table, xid and detail)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def record_hashes(qualified: str, table) -> list[int]:
    """A 64-bit hash of each update's content (table, diff, image, unknown columns, xid, values; not
    its time, position or commit time): XXH64 of its Avro encoding (`avro_columns`), seeded with the
    XXH64 of the table's name."""
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


def _ident(time, position):
    """One int64 per identity ``(time, position)``, to pick which records to hash (times 2^32 apart
    wrap to one value: a few more may be picked; the check compares time and position apart)."""
    return pc.add(pc.multiply(time.cast(pa.int64()), 1 << 32), position.cast(pa.int64()))


def content_hashes(batches: Iterator, wanted: list[int], work: Work) -> Iterator:
    """``mapInArrow`` body: decoded ``data`` rows (seg, table, offset, size) in; one `identity_rows`
    ``rec`` row out for each update whose identity (`_ident`) is in ``wanted``, with its
    `record_hashes` value as ``rhash``."""
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
    """The schema of `identity_rows`: the decoded rows' first seven columns, kind to count."""
    return decoded_arrow_schema(7)


def with_content_hashes(ids, rehash):
    """The collected identity rows (`identity_rows`) made ready for `plan.completeness_rows`: an update
    whose identity occurs once gets rhash 0; those of an identity that occurs again are replaced by
    the rows ``rehash(wanted, segs)`` returns (`content_hashes` of the segments ``segs``, called only
    then, ``wanted`` the identities as `_ident` values), which carry their content hash."""
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
        wanted = pa.array(twice, pa.int64())
        again = pc.and_(update, pc.is_in(_ident(ids.column("time"), ids.column("position")), value_set=wanted))
        hashed = rehash(wanted.to_pylist(), sorted(set(ids.filter(again).column("seg").to_pylist())))
        ids = pa.concat_tables([ids.filter(pc.invert(again)), hashed.cast(ids.schema)])
        update = pc.and_(pc.equal(ids.column("kind"), "rec"), pc.is_null(ids.column("rhash")))
    return ids.set_column(ids.column_names.index("rhash"), "rhash",
                          pc.if_else(update, pa.scalar(0, pa.int64()), ids.column("rhash")))


def ids_schema():
    return pa.schema([("table", pa.string()), ("time", pa.int64()), ("position", pa.int32()), ("rhash", pa.int64())])


def identity_rows(small):
    """The collected ``ids`` and ``cnt`` rows (kind, seg, payload, time, count) as the rows
    `plan.completeness_rows` reads: one ``rec`` row per record (kind, seg, table, time, position,
    rhash, count) and the ``cnt`` rows."""
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
    return pa.schema([("time", pa.int64()), ("n", pa.int64()), ("rows", pa.int64()), ("lo", pa.int64()),
                      ("hi", pa.int64())])


def identity_tally(ids):
    """A piece's identities (`ids_schema` rows) per time: ``n`` distinct positions among ``rows``
    records, the lowest and highest position (``lo``, ``hi``). Null times and positions count as 0,
    as `plan.completeness_rows` counts them."""
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
    """What the driver holds for the completeness check (`identities`): ``counted``, the times whose
    distinct records the tallies give exactly (``time``, ``seen``), and ``rows``, the ``rec`` rows of
    the other times and every ``cnt`` row (`identity_schema`)."""

    counted: Any
    rows: Any


def identities(small, read=None) -> Identities:
    """The collected decoded rows' identities (`Identities`), in memory that follows the number of
    distinct times, not of records: a time whose pieces' tallies (``idn``) have each identity once
    and position ranges apart is ``counted``; only the pieces with another time have their ``ids``
    read (the row's payload, else ``read([(seg, offset, size)])``: `read_parts`), those times' kept
    as ``rec`` rows."""
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
        if row["payload"] is None:
            row["payload"] = read([(row["seg"], row["offset"], row["size"])])[0]
        recs = identity_rows(pa.Table.from_pylist([row], schema=small.schema))
        parts.append(recs.filter(pc.is_in(pc.fill_null(recs.column("time"), 0), value_set=loose_times)))
    cnt = identity_rows(small.filter(pc.equal(kinds, "cnt")))
    return Identities(counted=counted, rows=pa.concat_tables([*parts, cnt]))

