"""Materialize CDC feed files for the tests: the seed's schema shape and a writer."""

from __future__ import annotations

import io

import fastavro


def seed_schema(fields: list[dict]) -> list:
    """The seed's schema shape (000_*.txt) with ``fields`` as the data record."""
    return [
        {"type": "array", "items": {"type": "record", "name": "update", "namespace": "com.materialize.cdc",
                                    "fields": [{"name": "data", "type": {"type": "record", "name": "data",
                                                                         "fields": fields}},
                                               {"name": "time", "type": "long"}, {"name": "diff", "type": "long"}]}},
        {"type": "record", "name": "progress", "namespace": "com.materialize.cdc", "fields": [
            {"name": "lower", "type": {"type": "array", "items": "long"}},
            {"name": "upper", "type": {"type": "array", "items": "long"}},
            {"name": "counts", "type": {"type": "array", "items": {"type": "record", "name": "counts", "fields": [
                {"name": "time", "type": "long"}, {"name": "count", "type": "long"}]}}}]},
    ]


# the seed's example schema (000_*.txt), verbatim: data {id: long, price: [null, int]}
SEED_READER = seed_schema([{"name": "id", "type": "long"}, {"name": "price", "type": ["null", "int"]}])


def feed_file(schema: list, datums: list) -> bytes:
    """One Avro file of ``datums`` (update arrays and progress records) written with ``schema``."""
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(schema), datums)
    return buf.getvalue()
