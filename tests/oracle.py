"""The oracle of the end-to-end tests: PostgreSQL's own rows, in lake types, compared as multisets."""

from __future__ import annotations

from collections import Counter

from psycopg2 import sql

from tidemark.consolidate.layout import plain
from tidemark.pgtypes import arrow_schema, lake_array, text_parser


def norm(v):
    """Make a value comparable in a tuple: NaN equals NaN, lists become tuples."""
    if isinstance(v, float) and v != v:
        return "NaN"
    if isinstance(v, list):
        return tuple(norm(x) for x in v)
    return v


def row_tuples(table) -> list[tuple]:
    """Rows of an Arrow table as tuples (temporal values as integers, NaN comparable)."""
    view = plain(table)
    cols = [[norm(v) for v in view.column(i).to_pylist()] for i in range(view.num_columns)]
    return list(zip(*cols))


def rows(table) -> Counter:
    """Rows of an Arrow table as a multiset."""
    return Counter(row_tuples(table))


def source_table(conn, shape):
    """``SELECT *`` of the source in lake types: each value's output-function text (what pgoutput
    sends; ``::text`` differs for bool, inet, char(n)) parsed the canonical way."""
    import pyarrow as pa

    cols = sql.SQL(", ").join(sql.SQL("CASE WHEN {0} IS NULL THEN NULL ELSE format('%s', {0}) END")
                              .format(sql.Identifier(c.name)) for c in shape.columns)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT {} FROM {}").format(cols, sql.Identifier(shape.schema, shape.name)))
        raw = cur.fetchall()
    arrays = []
    for i, c in enumerate(shape.columns):
        parse = text_parser(c)
        arrays.append(lake_array(c, [None if r[i] is None else parse(r[i]) for r in raw]))
    return pa.Table.from_arrays(arrays, schema=arrow_schema(shape))
