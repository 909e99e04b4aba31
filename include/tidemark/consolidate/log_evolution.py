"""The changelog Delta table's schema: the table's columns and the changelog's own (`log_schema`), kept
the union of every column the table has had as the source adds columns (`evolve_log_schema`), and
restarted at a base when a column's type changed (`log_type_change`). The history tables
(`consolidate.history`) follow the same rules.
"""

from __future__ import annotations

from tidemark.errors import ChangelogError
from tidemark.lake import open_delta, writer as _commit
from tidemark.lake.scd2 import log_schema  # noqa: F401 - the changelog's Arrow schema (the lake reads it too)


RESTART_OPERATION = "changelog_restart"     # the Delta commit that restarts a changelog (`log_type_change`)


def log_type_change(dt, target) -> str | None:
    """What keeps the changelog Delta table ``dt`` from holding rows of ``target``: a column whose
    type changed (ALTER COLUMN TYPE), or None. At a base (a snapshot of the table loaded) the
    changelog then restarts: that commit overwrites it with the new schema (`RESTART_OPERATION`), its
    earlier rows stay in the Delta versions before it (`tidemark.lake.changelog_between` stitches
    them), and the CDC feed restarts with the snapshot's rows alone (header ``tidemark.restart``)."""
    import pyarrow as pa
    from deltalake import Schema

    if dt is None:
        return None
    have = {f.name: f.type for f in dt.schema().fields}
    for f in target:
        if f.name in have and Schema.from_arrow(pa.schema([f])).fields[0].type != have[f.name]:
            return f"column {f.name} has type {f.type} now but {have[f.name]} in the changelog"
    return None


def evolve_log_schema(uri: str, options, dt, target, table: str):
    """Make the changelog Delta table's schema hold every column of ``target`` (the table's columns
    now): a column added in the source is added as a nullable column (earlier rows read null); a
    dropped column stays (later rows read null), so the schema is the union of every column the
    table has had, in the order they first appeared. A column whose type changed is a
    `ChangelogError`. Return the table as reopened (``dt`` itself if unchanged)."""
    if dt is None:
        return dt
    changed = log_type_change(dt, target)
    if changed is not None:
        raise ChangelogError(f"table {table}: {changed} {uri}; the changelog cannot hold both: a re-snapshot of "
                             "the table (mode table, or a resend) restarts it with the new type")
    have = {f.name for f in dt.schema().fields}
    added = [f.with_nullable(True) for f in target if f.name not in have]
    if not added:
        return dt
    _commit.add_columns(dt, added)
    return open_delta(uri, options)
