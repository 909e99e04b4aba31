"""The completeness check's data on the driver follows the number of distinct times, not of records
(issue 34, point 5): each decoded piece sends a per-time tally of its identities (`identities.identity_tally`);
the identities themselves stay in the run's work area and only those of a time where pieces may share
an identity (segments overlap) are read back (`identities.identities`). The verdict is exactly the one
over every record's row (`plan.completeness_rows` of `identities.identity_rows`)."""

from __future__ import annotations

import tempfile

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from tidemark.consolidate import plan as P
from tidemark.consolidate.decode import decode_partition
from tidemark.consolidate.identities import (_ident, content_hashes, identities, identity_rows, identity_schema,
                                             identity_tally, ids_schema, with_content_hashes)
from tidemark.consolidate.work_area import Work, decoded_arrow_schema, ipc, read_parts
from tidemark.landing import segments
from tidemark.landing.segments import SegmentBuilder, Update
from tidemark.landing.store import open_store
from tidemark.pgtypes import Column, TableSchema

T = TableSchema("public", "t", 1, (Column("id", "int64", "int8", 20, key=True), Column("v", "text", "text", 25)))


def _verdict(fn):
    try:
        return fn()
    except P.CompletenessError as exc:
        return str(exc)


def _decoded(pieces, cnts):
    """Decoded rows as the decoding sends them: per piece ``(seg, [(time, position, content, event)])``
    an ``ids`` row (its identities; an event's content hash is known, an update's is not) and its
    ``idn`` tally; per ``(seg, time, count)`` a ``cnt`` row."""
    rows = {k: [] for k in decoded_arrow_schema().names}

    def add(**kw):
        for k in rows:
            rows[k].append(kw.get(k))

    for k, (seg, recs) in enumerate(pieces):
        ids = pa.table({"table": ["public.t"] * len(recs), "time": [r[0] for r in recs],
                        "position": [r[1] for r in recs], "rhash": [r[2] if r[3] else None for r in recs]},
                       schema=ids_schema())
        add(kind="ids", seg=seg, position=k, payload=ipc(ids))
        add(kind="idn", seg=seg, position=k, payload=ipc(identity_tally(ids)))
    for seg, t, c in cnts:
        add(kind="cnt", seg=seg, time=t, count=c)
    return pa.Table.from_pydict(rows, schema=decoded_arrow_schema())


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(st.tuples(st.sampled_from("abc"), st.lists(
           st.tuples(st.integers(0, 12), st.integers(0, 5), st.integers(0, 2), st.booleans()), max_size=10)),
           max_size=6),
       cnts=st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 12), st.integers(0, 6)), max_size=8))
def test_the_tallies_give_the_verdict_of_every_records_row(pieces, cnts):
    """Any pieces (overlapping or apart, an identity twice in one piece or in several, different
    contents under one identity, events and updates) and counts: the unmet times and errors from
    the tallies and the few rows read back are those from every record's row."""

    small = _decoded(pieces, cnts)
    content = {}
    for seg, recs in pieces:
        for t, p, c, _ in recs:
            content.setdefault((seg, t, p), set()).add(c)

    def rehash(wanted, segs):       # `identities.content_hashes`: the updates of ``segs`` whose identity is wanted
        want = set(wanted)
        out = [{"kind": "rec", "seg": seg, "table": "public.t", "time": t, "position": p, "rhash": c, "count": None}
               for seg, recs in pieces if seg in segs for t, p, c, ev in recs
               if not ev and _ident(pa.array([t]), pa.array([p])).to_pylist()[0] in want]
        return pa.Table.from_pylist(out, schema=identity_schema())

    every = _verdict(lambda: P.completeness_rows(with_content_hashes(identity_rows(small), rehash), 0, 10))
    found = identities(small)
    tallied = _verdict(lambda: P.completeness_rows(with_content_hashes(found.rows, rehash), 0, 10,
                                                   counted=found.counted))
    assert tallied == every
    # a time is counted from the tallies or read back, never both
    recs = found.rows.filter(pc.equal(found.rows.column("kind"), "rec"))
    assert not set(recs.column("time").to_pylist()) & set(found.counted.column("time").to_pylist())


def _big_transaction(n: int) -> bytes:
    b = SegmentBuilder("s", 0, 10)
    b.add_transaction([Update(T, {"id": i, "v": "v" * (i % 30)}, 50, 1, 9, i, 0) for i in range(n)]
                      + [Update(T, {"id": i}, 51, -1, 9, 0, 0, image="key") for i in range(1)])
    return b.build(100)


def _decode(tmp_path, data: bytes, names: list[str]):
    """``data`` landed as the segments ``names`` (a copy is an overlap), decoded as a run decodes them."""
    uris = []
    for name in names:
        f = tmp_path / "landing" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
        uris.append(f.as_uri())
    work = Work((tempfile.mkdtemp(dir=tmp_path), None, None), "w-")
    out = pa.Table.from_batches(list(decode_partition([pa.record_batch({"id": list(range(len(uris)))})], None, uris,
                                                      {"public.t": 4}, work)), schema=decoded_arrow_schema())
    store = work.open()
    return out, (lambda parts: read_parts(store, work, parts)), work


def test_a_huge_transactions_identities_stay_in_the_work_area(monkeypatch, tmp_path):
    """One transaction of N records in pieces: no per-record row reaches the driver (the ``ids``
    rows carry no payload: it is in the work area) and what the check holds is one counted time per
    transaction, for any N; landed twice, the overlap is read back and still counted once."""
    monkeypatch.setattr(segments, "BLOCK_BYTES", 8 << 10)
    monkeypatch.setattr(segments, "ARRAY_MAX_RECORDS", 200, raising=False)
    monkeypatch.setattr(segments, "PIECE_RECORDS", 500, raising=False)
    for n in (1_000, 8_000):
        out, read, _ = _decode(tmp_path / str(n), _big_transaction(n), ["a.avro"])
        ids = out.filter(pc.equal(out.column("kind"), "ids"))
        assert ids.num_rows > 1 and ids.column("payload").null_count == ids.num_rows      # in pieces, not here
        found = identities(out, read)
        assert found.counted.to_pylist() == [{"time": 50, "seen": n}, {"time": 51, "seen": 1}]
        assert pc.sum(pc.equal(found.rows.column("kind"), "rec")).as_py() == 0
        assert P.completeness_rows(found.rows, 0, 100, counted=found.counted) == []
    out, read, work = _decode(tmp_path / "twice", _big_transaction(2_000), ["a.avro", "b.avro"])
    found = identities(out, read)
    recs = found.rows.filter(pc.equal(found.rows.column("kind"), "rec"))
    assert recs.num_rows == 2 * 2_001 and found.counted.num_rows == 0
    data = out.filter(pc.equal(out.column("kind"), "data")).select(["seg", "table", "offset", "size"])

    def rehash(wanted, segs):
        picked = data.filter(pc.is_in(data.column("seg"), value_set=pa.array(segs)))
        return pa.Table.from_batches(list(content_hashes(picked.to_batches(), wanted, work)), schema=identity_schema())

    assert P.completeness_rows(with_content_hashes(found.rows, rehash), 0, 100, counted=found.counted) == []
