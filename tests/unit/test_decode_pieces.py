"""One huge transaction is decoded in bounded pieces (issue 34, point 5): a segment of many updates,
decoded by the consolidation's decode task (`decode.decode_partition`), never holds more than a
piece's updates at once, and its parts are the same records as decoding it whole."""

from __future__ import annotations

import tempfile

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.consolidate import decode
from tidemark.consolidate.decode import decode_partition, decode_segment
from tidemark.consolidate.identities import identities
from tidemark.consolidate.work_area import Work, decoded_arrow_schema, read_parts
from tidemark.landing import segments
from tidemark.landing.segments import SegmentBuilder, Update, read_segment_columns
from tidemark.landing.store import open_store
from tidemark.pgtypes import Column, TableSchema

T = TableSchema("public", "t", 1, (Column("id", "int64", "int8", 20, key=True), Column("v", "text", "text", 25),
                                   Column("big", "text", "text", 25)))
N = 6_000
PIECE = 500


def _one_big_transaction() -> bytes:
    """One transaction of inserts, key-changing updates that leave a TOAST value unchanged (a -1
    then its +1) and deletes: N records."""
    ups, pos = [], 0
    while pos < N:
        k = pos
        if pos % 7 == 3:
            ups.append(Update(T, {"id": k}, 50, -1, 9, pos, 0, image="key"))
            ups.append(Update(T, {"id": k + 10**6, "v": f"moved {k}", "big": None}, 50, 1, 9, pos + 1, 0,
                              unchanged_toast=("big",)))
            pos += 2
        else:
            ups.append(Update(T, {"id": k, "v": "x" * (k % 40), "big": "b" * (k % 300)}, 50, 1, 9, pos, 0))
            pos += 1
    b = SegmentBuilder("s", 0, 10)
    b.add_transaction(ups)
    return b.build(100)


def _records(parts: list[bytes]):
    t = pa.concat_tables([pa.ipc.open_stream(p).read_all() for p in parts])
    return t.sort_by([("_tm_pos", "ascending")])


def test_a_huge_segment_is_decoded_in_bounded_pieces_with_the_same_records(monkeypatch, tmp_path):
    monkeypatch.setattr(segments, "BLOCK_BYTES", 8 << 10)         # small container blocks, as a 1 MiB one is
    monkeypatch.setattr(segments, "ARRAY_MAX_RECORDS", 200, raising=False)   # to a huge transaction
    monkeypatch.setattr(segments, "PIECE_RECORDS", PIECE, raising=False)
    data = _one_big_transaction()
    seg_file = tmp_path / "landing" / "seg.avro"
    seg_file.parent.mkdir()
    seg_file.write_bytes(data)
    held = []
    payload_table = decode._payload_table

    def counted(name, shape, cols, bad=None):      # the updates decoded at once, at the widest point
        held.append(len(cols["time"]))
        return payload_table(name, shape, cols, bad)

    monkeypatch.setattr(decode, "_payload_table", counted)
    area = tempfile.mkdtemp(dir=tmp_path)
    work = Work((area, None, None), "w-")
    out = pa.Table.from_batches(list(decode_partition([pa.record_batch({"id": [0]})], None, [seg_file.as_uri()],
                                                      {"public.t": 4}, work)), schema=decoded_arrow_schema())
    # a piece is PIECE updates plus at most one container block's (8 KiB of small updates here)
    assert held and sum(held) == N and max(held) <= PIECE + 400, held
    data_rows = out.filter(pc.equal(out.column("kind"), "data")).to_pylist()
    store = open_store(area)
    got = _records([store.get_range(work.key(r["seg"]), r["offset"], r["size"]) for r in data_rows])
    monkeypatch.setattr(decode, "_payload_table", payload_table)
    whole = decode_segment(seg_file.as_uri(), data, {"public.t": 4})
    want = _records([p for k, p in zip(whole["kind"], whole["payload"]) if k == "data"])
    assert got.equals(want)
    # the other rows: one seg row, the progress counts, every record's identity, the links, once each
    kinds = out.column("kind").to_pylist()
    assert kinds.count("seg") == 1 and kinds.count("cnt") == 1
    found = identities(out, lambda parts: read_parts(store, work, parts))
    assert found.counted.to_pylist() == [{"time": 50, "seen": N}]       # in the work area, tallied per piece
    links = {bytes(p) for k, p in zip(whole["kind"], whole["payload"]) if k == "lnk"}
    got_links = set()
    import numpy as np

    for r in out.filter(pc.equal(out.column("kind"), "lnk")).to_pylist():
        got_links |= set(map(tuple, np.frombuffer(r["payload"], "<i4").reshape(-1, 2).tolist()))
    assert got_links == set(map(tuple, np.frombuffer(b"".join(links), "<i4").reshape(-1, 2).tolist()))


def test_pieces_of_a_segment_are_its_columns(monkeypatch):
    monkeypatch.setattr(segments, "BLOCK_BYTES", 8 << 10)
    monkeypatch.setattr(segments, "ARRAY_MAX_RECORDS", 200)
    data = _one_big_transaction()
    whole = read_segment_columns(data, "seg.avro")
    pieces = list(segments.read_segment_pieces(data, "seg.avro", PIECE))
    assert len(pieces) > 5 and all(not p.last for p in pieces[:-1]) and pieces[-1].last
    assert (pieces[-1].lower, pieces[-1].upper, pieces[-1].counts) == (whole.lower, whole.upper, whole.counts)
    cols = whole.shapes["public_t"] if "public_t" in whole.shapes else next(iter(whole.shapes.values()))
    order = [o for p in pieces for c in p.shapes.values() for o in c["order"].tolist()]
    assert order == cols["order"].tolist()
    ids = [v for p in pieces for c in p.shapes.values() for v in c["row"]["id"].to_pylist()]
    assert ids == cols["row"]["id"].to_pylist()


def test_a_segment_whose_counts_are_short_fails_after_its_pieces(monkeypatch):
    import pytest

    from tidemark.errors import SegmentError

    monkeypatch.setattr(segments, "BLOCK_BYTES", 8 << 10)
    monkeypatch.setattr(segments, "ARRAY_MAX_RECORDS", 200)
    b = SegmentBuilder("s", 0, 10)
    b.add_transaction([Update(T, {"id": i, "v": "v", "big": "b" * 50}, 50, 1, 9, i, 0) for i in range(3000)])
    b.counts[50] -= 1
    data = b.build(100)
    with pytest.raises(SegmentError, match="3000 records at time 50 but progress counts say 2999"):
        list(segments.read_segment_pieces(data, "seg.avro", PIECE))
