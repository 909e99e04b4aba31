"""Segment helpers shared by unit and integration tests."""

from __future__ import annotations

import io
import json

import fastavro

from tidemark.landing.segments import SegmentWriter
from tidemark.pgtypes import TableSchema


def counted_framing(data: bytes) -> bytes:
    """The same segment as written before each update was its own array block: each transaction one
    counted array (fastavro), same header, same records."""
    reader = fastavro.reader(io.BytesIO(data), return_record_name=True)
    meta, schema = reader.metadata, fastavro.parse_schema(reader.writer_schema)
    datums = list(reader)
    w = SegmentWriter(meta["tidemark.stream"], int(meta["tidemark.seq"]), datums[-1][1]["lower"][0])
    relations = json.loads(meta["tidemark.relations"])
    names = [b["name"] for b in reader.writer_schema[0]["items"]["fields"][0]["type"]]
    for n in names:
        if n.rsplit(".", 1)[-1] in relations:
            w.branch(TableSchema.from_json(relations[n.rsplit(".", 1)[-1]]))
    for d in datums[:-1]:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, schema, d)
        w.append(buf.getvalue())
    w.counts = {c["time"]: c["count"] for c in datums[-1][1]["counts"]}
    return w.build(datums[-1][1]["upper"][0])
