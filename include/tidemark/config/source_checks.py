"""The checks of a stream's tables that need the source database (`validate_against_source`): they
exist, their replica identity names their rows, their names suit the lake, their column list and row
filter are ones PostgreSQL takes for a publication that publishes UPDATE and DELETE."""

from __future__ import annotations

import re

from tidemark.config.model import NO_FILTER, StreamConfig, TableFilter, TableRef
from tidemark.errors import ConfigError
from tidemark.pgtypes import lake_name_problem
from tidemark.pgtypes.catalog import column_attnums, generated_columns, table_schema_for_oid


def validate_against_source(cfg: StreamConfig, conn) -> list[str]:
    """Check the tables against the source database: they exist, and each has a replica identity
    that names its rows (`replica_identity_problem`). ``conn`` is an open psycopg2 connection to the
    source. Returns notes on what will not be captured (generated columns: pgoutput does not publish
    them)."""
    notes: list[str] = []
    with conn.cursor() as cur:
        for i, ref in enumerate(cfg.source.tables):
            key = f"source.tables[{i}]"
            cur.execute(
                """SELECT c.oid, c.relkind, c.relreplident,
                          EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary
                                                                 AND i.indimmediate),
                          EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary
                                                                 AND NOT i.indimmediate),
                          EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident)
                     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE n.nspname = %s AND c.relname = %s""",
                (ref.schema, ref.name),
            )
            row = cur.fetchone()
            if row is None:
                raise ConfigError(key, f"table {ref} does not exist in the source database", source=cfg.origin)
            oid, relkind, replident, has_pk, deferrable_pk, has_ri_index = row
            if relkind not in ("r", "p"):
                raise ConfigError(key, f"{ref} is not a table (relkind {relkind!r})", source=cfg.origin)
            problem = replica_identity_problem(conn, ref, oid, replident, has_pk, has_ri_index, deferrable_pk)
            if problem:
                raise ConfigError(key, problem, source=cfg.origin)
            if ref in cfg.history and replident == "f":
                if cfg.history_all:
                    notes.append(f"history: all: {ref} has no key (REPLICA IDENTITY FULL), so it gets no history "
                                 "table")
                else:
                    raise ConfigError(f"history[{cfg.history.index(ref)}]",
                                      f"{ref} has no key (REPLICA IDENTITY FULL): a history table follows each "
                                      "key's versions; take it out of history:", source=cfg.origin)
            cur.execute("""SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0
                            AND NOT attisdropped ORDER BY attnum""", (oid,))
            problem = lake_name_problem([r[0] for r in cur.fetchall()])
            if problem:
                raise ConfigError(key, f"table {ref}: {problem}", source=cfg.origin)
            if cfg.source.filter_of(ref) != NO_FILTER:
                trial_filter(cfg, conn, ref, oid, key)
            generated = generated_columns(conn, ref.schema, ref.name)
            if generated:
                notes.append(f"{key}: {ref} column(s) {', '.join(generated)} are GENERATED ALWAYS ... STORED; "
                             "PostgreSQL's pgoutput does not publish generated columns, so they are not captured "
                             "and the lake table has no such column")
    return notes


def publication_table(ref: TableRef, filt: TableFilter):
    """The publication's table element: ``schema.table [(columns)] [WHERE (expr)]`` (psycopg2.sql)."""
    from psycopg2 import sql

    out = sql.Identifier(ref.schema, ref.name)
    if filt.columns is not None:
        out = sql.SQL("{} ({})").format(out, sql.SQL(", ").join(sql.Identifier(c) for c in filt.columns))
    if filt.where is not None:       # one expression, checked by `_expression_problem` and by PostgreSQL
        out = sql.SQL("{} WHERE ({})").format(out, sql.SQL(filt.where))
    return out


def trial_filter(cfg: StreamConfig, conn, ref: TableRef, oid: int, key: str) -> str | None:
    """Check a table's column list and row filter against the source and return the filter as
    PostgreSQL stores it (``pg_get_expr``; None: no filter). The column list must name existing
    columns and hold the table's replica identity (its key; under REPLICA IDENTITY FULL every column);
    the row filter must be an expression PostgreSQL takes for a publication (tried in a publication
    created and rolled back in one transaction) and, as the stream publishes UPDATE and DELETE, use
    only replica-identity columns: PostgreSQL accepts other columns at CREATE PUBLICATION but then
    refuses every UPDATE and DELETE of the table. Raises `ConfigError` naming the table."""
    import secrets

    from psycopg2 import errors as pg_errors
    from psycopg2 import sql

    filt = cfg.source.filter_of(ref)
    shape = table_schema_for_oid(conn, oid)
    names = [c.name for c in shape.columns]
    ident = [c.name for c in shape.columns if c.key]
    full = shape.replica_identity == "f"
    if filt.columns is not None:
        unknown = [c for c in filt.columns if c not in names]
        if unknown:
            raise ConfigError(f"{key}.columns", f"table {ref} has no column {', '.join(unknown)} (columns that "
                                                f"can be published: {', '.join(names)})", source=cfg.origin)
        lacking = [c for c in ident if c not in filt.columns]
        if lacking:
            why = ("it is REPLICA IDENTITY FULL: every column is in its identity, so the column list must name "
                   "them all" if full else f"its key (replica identity) is {', '.join(ident)}")
            raise ConfigError(f"{key}.columns", f"table {ref}: the column list lacks {', '.join(lacking)}: {why} "
                                                "(PostgreSQL refuses UPDATE and DELETE of a table whose publication's "
                                                "column list does not hold its replica identity)", source=cfg.origin)
    name = f"tidemark_check_{secrets.token_hex(6)}"
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        try:
            cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish_via_partition_root = true)")
                        .format(sql.Identifier(name), publication_table(ref, filt)))
            cur.execute("""SELECT pg_get_expr(pr.prqual, pr.prrelid), pr.prqual::text FROM pg_publication_rel pr
                             JOIN pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = %s""", (name,))
            where, tree = cur.fetchone()
        except pg_errors.InsufficientPrivilege:
            raise
        except Exception as exc:
            what = (f"where {filt.where!r}" if filt.where is not None else "") + \
                   (" and " if filt.where is not None and filt.columns is not None else "") + \
                   (f"columns {list(filt.columns)}" if filt.columns is not None else "")
            raise ConfigError(key, f"table {ref}: {what}: PostgreSQL refuses it: "
                                   f"{' '.join(str(getattr(exc, 'pgerror', None) or exc).split())}",
                              source=cfg.origin) from None
        finally:
            cur.execute("ROLLBACK")
    if where is not None and not full:
        by_num = {v: k for k, v in column_attnums(conn, oid).items()}
        used = sorted({by_num.get(int(n), f"attnum {n}") for n in re.findall(r":varattno (-?\d+)", tree or "")})
        outside = [c for c in used if c not in ident]
        if outside:
            raise ConfigError(f"{key}.where", f"table {ref}: the row filter {filt.where!r} uses {', '.join(outside)}, "
                                              f"outside the table's replica identity ({', '.join(ident)}); the stream "
                                              "publishes UPDATE and DELETE, so PostgreSQL would refuse them: filter "
                                              "on key columns only, or make the table REPLICA IDENTITY FULL",
                              source=cfg.origin)
    return where


# A unique index PostgreSQL accepts for REPLICA IDENTITY USING INDEX: not partial, no expressions,
# not deferrable, valid, every key column NOT NULL (INCLUDE columns may be null); not the primary key
# (DEFAULT is that). Named in the refusal of a table whose replica identity names no row.
_IDENTITY_INDEX_SQL = """
SELECT quote_ident(ic.relname),
       ARRAY(SELECT a.attname::text FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) WITH ORDINALITY k(num, ord)
               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.num ORDER BY k.ord)
  FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
 WHERE i.indrelid = %s AND i.indisunique AND i.indimmediate AND i.indisvalid AND i.indpred IS NULL
   AND i.indexprs IS NULL AND NOT i.indisprimary
   AND NOT EXISTS (SELECT 1 FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) k(num)
                     JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.num WHERE NOT a.attnotnull)
 ORDER BY i.indnkeyatts, ic.relname LIMIT 1
"""


def replica_identity_problem(conn, ref: TableRef, oid: int, replident: str, has_pk: bool,
                             has_ri_index: bool, deferrable_pk: bool = False) -> str | None:
    """Why the table's replica identity does not name its rows in pgoutput's changes, with the
    commands that give it one; None when it does. A row is named by its replica identity's columns
    (pgoutput's old-key images carry exactly those): the primary key (DEFAULT), the columns of a
    unique index on NOT NULL columns (USING INDEX, with or without a primary key: the lake's key is
    that index's columns), or the whole row (FULL: the table is a multiset). DEFAULT without a
    primary key, NOTHING, and USING INDEX whose index was dropped (PostgreSQL then behaves as
    NOTHING) send no old key, and PostgreSQL refuses UPDATE and DELETE on such a published table. A
    DEFERRABLE primary key is no replica identity (``has_pk`` counts only immediate ones; PostgreSQL
    takes only those): DEFAULT with one names no row either."""
    if replident == "f" or (replident == "d" and has_pk) or (replident == "i" and has_ri_index):
        return None
    if replident == "d" and deferrable_pk:
        why = (f"{ref}'s primary key is DEFERRABLE, which PostgreSQL does not take as a replica identity: under "
               "REPLICA IDENTITY DEFAULT its changes name no row (and once published, UPDATE and DELETE on it fail)")
    elif replident == "d":
        why = f"{ref} has no primary key and is REPLICA IDENTITY DEFAULT (its changes name no row)"
    elif replident == "i":
        why = (f"{ref} is REPLICA IDENTITY USING INDEX, but that index no longer exists (PostgreSQL then "
               "treats it as NOTHING: its changes name no row)")
    else:
        why = f"{ref} is REPLICA IDENTITY NOTHING (its changes name no row)"
    options = [f"ALTER TABLE {ref} REPLICA IDENTITY DEFAULT (its primary key)"] if has_pk else \
        [f"re-create {ref}'s primary key NOT DEFERRABLE (ALTER TABLE {ref} DROP CONSTRAINT ..., ADD PRIMARY KEY "
         "(...))"] if deferrable_pk else [f"ALTER TABLE {ref} ADD PRIMARY KEY (...)"]
    with conn.cursor() as cur:
        cur.execute(_IDENTITY_INDEX_SQL, (oid,))
        index = cur.fetchone()
    if index:
        options.append(f"ALTER TABLE {ref} REPLICA IDENTITY USING INDEX {index[0]} (its unique index on "
                       f"NOT NULL columns {', '.join(index[1])})")
    else:
        options.append(f"ALTER TABLE {ref} REPLICA IDENTITY USING INDEX <a unique index on NOT NULL columns>")
    options.append(f"ALTER TABLE {ref} REPLICA IDENTITY FULL (no key: the table is kept as a multiset of whole rows)")
    return f"{why}; run one of: " + "; ".join(options)
