"""Table shapes and type kinds read from the source's catalog (pg_type, pg_attribute, pg_index)."""

from __future__ import annotations

from tidemark.pgtypes.mapping import BUILTIN_KINDS, BUILTIN_NAMES, Column, TableSchema

_CATALOG_SQL = """
WITH RECURSIVE t(oid, base, depth) AS (
    SELECT %s::oid, %s::oid, 0
    UNION ALL
    SELECT t.oid, ty.typbasetype, t.depth + 1 FROM t JOIN pg_type ty ON ty.oid = t.base
     WHERE ty.typtype = 'd' AND t.depth < 16
)
SELECT ty.oid, ty.typtype, ty.typcategory, ty.typelem, format_type(%s::oid, NULL), ty.typname,
       (SELECT e.typdelim FROM pg_type e WHERE e.oid = ty.typelem), ty.typinput = 'array_in'::regproc
  FROM t JOIN pg_type ty ON ty.oid = t.base ORDER BY t.depth DESC LIMIT 1
"""


class TypeResolver:
    """Resolve type OIDs to kinds through the source's catalog, with a cache."""

    def __init__(self, conn=None):
        self.conn = conn
        self.cache: dict[int, tuple[str, str, str | None]] = {}

    def resolve(self, type_oid: int) -> tuple[str, str, str | None]:
        """Return (kind, type_name, elem_kind) for a type OID."""
        if type_oid in BUILTIN_KINDS:
            return BUILTIN_KINDS[type_oid], BUILTIN_NAMES[type_oid], None
        if type_oid in self.cache:
            return self.cache[type_oid]
        row = None
        if self.conn is not None:
            with self.conn.cursor() as cur:
                cur.execute(_CATALOG_SQL, (type_oid, type_oid, type_oid))
                row = cur.fetchone()
        if row is None:
            result = ("text", f"oid:{type_oid}", None)
        else:
            base_oid, typtype, category, elem, display, _, delim, array_in = row
            elem_kind = self.resolve(elem)[0] if category == "A" and elem else None
            if category == "A" and delim == "," and array_in and elem_kind != "array":
                # a list of the element's kind (an enum's, a composite's: text; a domain's: its
                # base's); the column's dimensions are its own (`table_schema_for_oid`)
                result = ("array", display, elem_kind)
            elif category != "A" and base_oid in BUILTIN_KINDS:
                result = (BUILTIN_KINDS[base_oid], display, None)
            else:
                # their text: enums, ranges, geometric, composite and user types; box[] (';' between
                # elements), int2vector and oidvector ('1 2'), an array of a domain over an array
                result = ("text", display, None)
        self.cache[type_oid] = result
        return result

    def dims(self, rel_oid: int) -> dict[str, int]:
        """{column: its declared dimensions (``attndims``)} of the relation's array columns (a column
        declared ``int[][]``: 2; a domain over an array or a ``CREATE TABLE AS`` column: 0)."""
        if self.conn is None:
            return {}
        with self.conn.cursor() as cur:
            cur.execute("SELECT attname, attndims FROM pg_attribute WHERE attrelid = %s AND attnum > 0 "
                        "AND attndims > 0", (rel_oid,))
            return {name: int(n) for name, n in cur.fetchall()}


_RELATION_SQL = """
SELECT n.nspname, c.relname, c.relreplident FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE c.oid = %s
"""

_COLUMNS_SQL = """
SELECT a.attname, a.atttypid, a.atttypmod, a.attndims,
       CASE c.relreplident
            WHEN 'f' THEN true
            WHEN 'd' THEN COALESCE(a.attnum = ANY ((pk.indkey::int2[])[0:pk.indnkeyatts - 1]), false)
            WHEN 'i' THEN COALESCE(a.attnum = ANY ((ri.indkey::int2[])[0:ri.indnkeyatts - 1]), false)
            ELSE false END
  FROM pg_attribute a
  JOIN pg_class c ON c.oid = a.attrelid
  LEFT JOIN pg_index pk ON pk.indrelid = a.attrelid AND pk.indisprimary AND pk.indimmediate
  LEFT JOIN pg_index ri ON ri.indrelid = a.attrelid AND ri.indisreplident
 WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
 ORDER BY a.attnum
"""


def table_schema_for_oid(conn, oid: int, resolver: TypeResolver | None = None,
                         columns: list[str] | tuple[str, ...] | None = None) -> TableSchema:
    """Read a table's shape from the catalog exactly as pgoutput's Relation message describes it (the
    drain's `tidemark.capture.pgoutput.table_from_relation`): no dropped or generated columns, attnum order,
    ``key`` = the replica-identity columns (the primary key's under DEFAULT, the index's under USING
    INDEX, also beside a primary key; every column under FULL; an index's INCLUDE columns are not
    part of it, nor is a DEFERRABLE primary key, which PostgreSQL does not take for the identity, as in
    pgoutput's Relation message), ``nullable`` always True (pgoutput does not send it).
    ``columns``: only those (a publication's column list, `published_filter`: pgoutput's Relation
    message then lists only them, in attnum order)."""
    resolver = resolver or TypeResolver(conn)
    with conn.cursor() as cur:
        cur.execute(_RELATION_SQL, (oid,))
        rel = cur.fetchone()
        if rel is None:
            raise LookupError(f"relation with oid {oid} does not exist")
        cur.execute(_COLUMNS_SQL, (oid,))
        rows = cur.fetchall()
    if columns is not None:
        rows = [r for r in rows if r[0] in columns]
    out = []
    for name, type_oid, typmod, ndims, key in rows:
        kind, type_name, elem_kind = resolver.resolve(type_oid)
        out.append(Column(name=name, kind=kind, type_name=type_name, type_oid=type_oid, typmod=typmod,
                          key=bool(key), elem_kind=elem_kind, dims=array_dims(kind, ndims)))
    return TableSchema(schema=rel[0], name=rel[1], oid=oid, columns=tuple(out), replica_identity=rel[2])


def array_dims(kind: str, attndims: int | None) -> int:
    """An array column's dimensions in the lake: as declared (``attndims``), at least 1; 0 for
    every other column."""
    return max(int(attndims or 0), 1) if kind == "array" else 0


def published_filter(conn, publication: str | None, oid: int) -> tuple[list[str] | None, str | None]:
    """The table's column list (names, attnum order; None: every column) and row filter (as PostgreSQL
    stores it, ``pg_get_expr``; None: every row) in ``publication``, as the connection's snapshot sees
    the catalog (the snapshot's copy reads it under its exported snapshot: exactly what pgoutput
    publishes from that point on). A table not in the publication (or no publication): (None, None)."""
    if not publication:
        return None, None
    with conn.cursor() as cur:
        cur.execute("""SELECT CASE WHEN pr.prattrs IS NOT NULL THEN
                                   ARRAY(SELECT a.attname::text FROM pg_attribute a WHERE a.attrelid = pr.prrelid
                                            AND a.attnum = ANY (pr.prattrs::int2[]) ORDER BY a.attnum) END,
                              pg_get_expr(pr.prqual, pr.prrelid)
                         FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                        WHERE p.pubname = %s AND pr.prrelid = %s""", (publication, oid))
        row = cur.fetchone()
    return (None, None) if row is None else (row[0], row[1])


def column_attnums(conn, oid: int) -> dict[str, int]:
    """{column: its attnum} of the table's columns as `table_schema_for_oid` lists them. An attnum
    is a column's identity: RENAME COLUMN keeps it, DROP COLUMN retires it and ADD COLUMN takes a new
    one, so two reads of the catalog tell a renamed column from a dropped and an added one."""
    with conn.cursor() as cur:
        cur.execute("""SELECT attname, attnum FROM pg_attribute
                        WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND attgenerated = ''""", (oid,))
        return {name: int(num) for name, num in cur.fetchall()}


def generated_columns(conn, schema: str, name: str) -> list[str]:
    """The table's ``GENERATED ALWAYS AS (...) STORED`` columns: PostgreSQL 15's pgoutput does not
    publish them, so a stream cannot capture them (the lake table has no such column)."""
    with conn.cursor() as cur:
        cur.execute("""SELECT a.attname FROM pg_attribute a
                         JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
                        WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped
                          AND a.attgenerated <> '' ORDER BY a.attnum""", (schema, name))
        return [r[0] for r in cur.fetchall()]


def table_schema_from_catalog(conn, schema: str, name: str, resolver: TypeResolver | None = None,
                              columns: list[str] | tuple[str, ...] | None = None) -> TableSchema:
    """Read the shape of ``schema.name`` from the catalog (see `table_schema_for_oid`)."""
    row = relation(conn, schema, name)
    if row is None:
        raise LookupError(f"table {schema}.{name} does not exist")
    return table_schema_for_oid(conn, row[0], resolver, columns)


def relation(conn, schema: str, name: str) -> tuple[int, str] | None:
    """(oid, relkind) of the relation ``schema.name``, or None if there is none."""
    with conn.cursor() as cur:
        cur.execute("""SELECT c.oid, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                        WHERE n.nspname = %s AND c.relname = %s""", (schema, name))
        return cur.fetchone()
