"""The changelog Delta table's schema and files: the table's columns and the changelog's own
(`tidemark.lake.scd2.log_schema`), kept the union of every column the table has had as the source
adds columns (`evolve_log_schema`), and restarted at a base when a column's type changed
(`log_type_change`); its Parquet files, one per ``_commit_date`` (`write_log_files`, `write_log_part`:
the driver's, the executors' and `maintain`'s). ``UNREAD`` stands for a changelog Delta table (or the
lake's frontier given with it) not read yet. The history tables (`consolidate.history`) follow the
same schema rules.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.errors import ChangelogError
from tidemark.lake import filesystem, layout, open_delta, strip_scheme, writer as _commit


RESTART_OPERATION = "changelog_restart"     # the Delta commit that restarts a changelog (`log_type_change`)
UNREAD = object()     # an argument its caller has not read (None is a value: "no table yet")


def log_type_change(dt, target) -> str | None:
    """What keeps the changelog Delta table ``dt`` from holding rows of ``target``: a column whose
    type changed (ALTER COLUMN TYPE), or None. At a base (a snapshot of the table loaded) the
    changelog then restarts: that commit overwrites it with the new schema (`RESTART_OPERATION`), its
    earlier rows stay in the Delta versions before it (`tidemark.lake.changelog_between` stitches
    them), and the CDC feed restarts with the snapshot's rows alone (header ``tidemark.restart``)."""
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


def write_log_files(uri: str, options, rows, *, tag: str) -> list[dict]:
    """Write changelog rows as one Parquet file per ``_commit_date``; return their add actions."""
    if rows.num_rows == 0:
        return []
    dates = pc.cast(pc.cast(rows.column("_commit_ts"), pa.timestamp("us")), pa.date32())
    fs = filesystem(uri, options)
    base = strip_scheme(uri)
    out = []
    days = sorted(pc.unique(dates).to_pylist())
    for d in days:
        part = rows if len(days) == 1 else rows.filter(pc.equal(dates, pa.scalar(d, pa.date32())))
        day = d.isoformat()
        out.append(write_log_part(part, base, f"_commit_date={day}/part-{tag}.parquet", fs, day))
    return out


def write_log_part(rows, base: str, rel: str, fs, day: str) -> dict:
    """Write ``rows`` as the changelog's file ``rel`` (of partition ``_commit_date=day``) below ``base``,
    the table's path in ``fs``; its add action."""
    size = layout.write_parquet(rows, base + "/" + rel, fs)
    return {"target": "changelog", "op": "add", "path": rel, "size": size, "rows": rows.num_rows,
            "stats": json.dumps({"numRecords": rows.num_rows}), "partition": day}
