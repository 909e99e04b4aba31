"""A tiny reference applier for capture tests, and the source oracle they compare with.

Rows are compared in their *lake* form (`tidemark.pgtypes.lake_array` of the canonical values, as
Python values), made hashable by `norm` (NaN is a marker, lists become tuples).

`apply_capture` applies a snapshot's rows, then segment updates and events in ``(time, position)``
order: keyed tables by their replica-identity key (a ``-1`` removes the row with its key, so an update that changes
the key deletes the old key; ``image="key"`` records only know the key), ``unchanged_toast`` columns
keep the previous value, tables without a key (or REPLICA IDENTITY FULL) are
multisets, and ``truncate`` empties the table.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable

from psycopg2 import sql

from tidemark.pgtypes import TableSchema, lake_array, session_options, table_schema_from_catalog, text_parser


class _NaN:
    def __repr__(self) -> str:
        return "NaN"

    def __eq__(self, other) -> bool:
        return isinstance(other, _NaN)

    def __hash__(self) -> int:
        return 0x7FF8


NAN = _NaN()


def norm(value: Any) -> Any:
    """A hashable, NaN-equal form of a lake Python value."""
    if isinstance(value, float) and math.isnan(value):
        return NAN
    if isinstance(value, list):
        return tuple(norm(v) for v in value)
    return value


def _storage(arr):
    """Dates and timestamps as their integers (±infinity do not fit Python's datetime)."""
    import pyarrow as pa

    t = arr.type
    if pa.types.is_date32(t):
        return arr.cast(pa.int32())
    if pa.types.is_timestamp(t):
        return arr.cast(pa.int64())
    if pa.types.is_list(t) and (pa.types.is_date32(t.value_type) or pa.types.is_timestamp(t.value_type)):
        ints = pa.int32() if pa.types.is_date32(t.value_type) else pa.int64()
        return arr.cast(pa.list_(ints))
    return arr


def values(arr) -> list:
    """An Arrow array's values as normalised Python values (dates/timestamps as integers)."""
    return [norm(v) for v in _storage(arr).to_pylist()]


def lake_rows(schema: TableSchema, rows: list[dict]) -> list[tuple]:
    """Canonical rows (dicts) -> lake rows (tuples in column order, normalised)."""
    cols = [values(lake_array(c, [r.get(c.name) for r in rows])) for c in schema.columns]
    return list(zip(*cols)) if cols else []


def arrow_rows(table) -> list[tuple]:
    """An Arrow table's rows as normalised tuples in column order."""
    cols = [values(table.column(i)) for i in range(table.num_columns)]
    return list(zip(*cols))


def source_rows(conn, schema: TableSchema) -> list[tuple]:
    """``SELECT`` the table's columns in PostgreSQL's text output (the output functions pgoutput uses,
    not ``::text`` casts, which differ for bool and char(n)) and parse them the way the drain does.

    ``conn`` must use `tidemark.pgtypes.session_options()` (canonical text output)."""
    import psycopg2.extensions as ext

    cols = sql.SQL(", ").join(sql.Identifier(c.name) for c in schema.columns)
    with conn.cursor() as cur:
        query = sql.SQL("SELECT {} FROM {}").format(cols, sql.Identifier(schema.schema, schema.name))
        cur.execute(sql.SQL("{} LIMIT 0").format(query))   # learn the result's type OIDs first
        raw_type = ext.new_type(tuple({d.type_code for d in cur.description}), "TIDEMARK_RAW", lambda v, c: v)
        ext.register_type(raw_type, cur)
        cur.execute(query)
        raw = cur.fetchall()
    parsers = [text_parser(c) for c in schema.columns]
    canon = [{c.name: (None if v is None else p(v)) for c, p, v in zip(schema.columns, parsers, r)} for r in raw]
    return lake_rows(schema, canon)


class TableState:
    """The reference state of one table: by key, or a multiset when the table has no key."""

    def __init__(self, schema: TableSchema):
        self.schema = schema
        self.names = [c.name for c in schema.columns]
        # REPLICA IDENTITY FULL marks every column as key: such a table may hold duplicates (multiset)
        keyed = schema.replica_identity != "f"
        self.key_idx = [i for i, c in enumerate(schema.columns) if c.key] if keyed else []
        self.by_key: dict[tuple, tuple] = {}
        self.bag: Counter = Counter()

    def key_of(self, row: tuple) -> tuple:
        return tuple(row[i] for i in self.key_idx)

    def insert(self, row: tuple) -> None:
        if self.key_idx:
            self.by_key[self.key_of(row)] = row
        else:
            self.bag[row] += 1

    def delete(self, row: tuple) -> tuple | None:
        """Remove the row (by key, or one identical instance); return what was removed."""
        if self.key_idx:
            return self.by_key.pop(self.key_of(row), None)
        if self.bag[row] <= 0:
            raise AssertionError(f"{self.schema.qualified}: delete of a row that is not there: {row}")
        self.bag[row] -= 1
        if not self.bag[row]:
            del self.bag[row]
        return row

    def truncate(self) -> None:
        self.by_key.clear()
        self.bag.clear()

    def rows(self) -> Counter:
        return Counter(self.by_key.values()) if self.key_idx else Counter(self.bag)


def apply_capture(snapshot: dict[str, tuple[TableSchema, list[tuple]]], lsn: int,
                  segments: Iterable) -> dict[str, Counter]:
    """Apply snapshot rows (``{table: (schema, lake rows)}``) then the segments' records with
    ``time >= lsn`` in (time, position) order; return each table's rows as a Counter."""
    states = {t: TableState(schema) for t, (schema, _) in snapshot.items()}
    for t, (_, rows) in snapshot.items():
        for r in rows:
            states[t].insert(r)
    records = []
    for seg in segments:
        for u in seg.updates:
            if u.time >= lsn:
                records.append((u.time, u.position, 0, u))
        for e in seg.events:
            if e.time >= lsn:
                records.append((e.time, e.position, 1, e))
    records.sort(key=lambda r: (r[0], r[1]))
    seen: set[tuple[int, int]] = set()
    last_removed: dict[str, tuple] = {}
    for time_, pos, is_event, rec in records:
        if (time_, pos) in seen:
            continue   # a duplicate of an update already applied
        seen.add((time_, pos))
        if is_event:
            if rec.kind == "truncate" and rec.table in states:
                states[rec.table].truncate()
            continue
        table = rec.table.qualified
        if table not in states:
            continue
        state = states[table]
        if rec.table.columns != state.schema.columns:
            raise AssertionError(f"{table}: shape changed during the test ({rec.table.columns})")
        (row,) = lake_rows(state.schema, [rec.row])
        if rec.diff < 0:
            removed = state.delete(row)   # keyed: by key (any image); keyless: this exact row
            if removed is not None:
                last_removed[table] = removed
        else:
            if rec.unchanged_toast:
                prev = state.by_key.get(state.key_of(row)) if state.key_idx else None
                prev = prev or last_removed.get(table)
                if prev is None:
                    raise AssertionError(f"{table}: unchanged TOAST columns {rec.unchanged_toast} with no "
                                         f"previous row at time {time_} position {pos}")
                row = tuple(prev[i] if n in rec.unchanged_toast else v
                            for i, (n, v) in enumerate(zip(state.names, row)))
            state.insert(row)
    return {t: s.rows() for t, s in states.items()}


def source_counter(dsn: str, table: str) -> Counter:
    """The table's rows as PostgreSQL prints them now, in lake form, as a multiset."""
    import psycopg2

    schema, name = table.split(".")
    conn = psycopg2.connect(dsn, options=session_options())
    try:
        return Counter(source_rows(conn, table_schema_from_catalog(conn, schema, name)))
    finally:
        conn.close()
