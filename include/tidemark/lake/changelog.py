"""Reading a table's consolidated changelog (`read_changelog`), across the restarts a type change makes
(`changelog_between`), and a table at a frontier from a version's rows plus the changelog (`at_frontier`).
"""

from __future__ import annotations

from tidemark.config import StreamConfig, TableRef
from tidemark.lake.delta import (LakeError, changelog_uri, conform, filesystem, missing_values, open_delta,
                                 resolved_name, storage_options, strip_scheme, table_info, table_uri, tidemark_commits)
from tidemark.lsn import format_lsn
from tidemark.rowid import identity_table, row_keys


def _log_restarts(dt, stream: str) -> list[tuple[int, int]]:
    """(Delta version, lower) of each restart of a changelog (`changelog_restart` commits: a column's
    type changed at a re-snapshot), oldest first; the rows below ``lower`` are in the versions before."""
    out, last = [], None
    for version, m in tidemark_commits(dt, stream):
        if m.get("operation") == "changelog_restart" and last is not None:
            out.append((int(version), int(last)))
        last = m.get("frontier", last)
    return out


def changelog_between(cfg: StreamConfig, table: str | TableRef, lower: int, upper: int):
    """The changelog rows of ``table`` at times in ``[lower, upper)``, across restarts: each stretch
    between two restarts read from the version that holds it (columns as `read_changelog`; a stretch
    before a type change keeps its own types, cast to the newest where Arrow can, else a clear error)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    dt = open_delta(changelog_uri(cfg, table), storage_options(cfg))
    if dt is None:
        raise LakeError(f"{changelog_uri(cfg, table)}: no changelog yet")
    cuts = [lo for _, lo in _log_restarts(dt, cfg.stream) if lower < lo < upper]
    parts = []
    for a, b in zip([lower] + cuts, cuts + [upper]):
        log = read_changelog(cfg, table, covering=a)
        parts.append(log.filter(pc.and_(pc.greater_equal(log.column("_time"), a), pc.less(log.column("_time"), b))))
    if len(parts) == 1:
        return parts[0]
    try:
        return pa.concat_tables([conform(p, parts[-1].schema) for p in parts])
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise LakeError(f"{resolved_name(table)}: its changelog restarted at {format_lsn(cuts[0])} (a column changed "
                        f"type) and the rows before cannot be read in the new types ({exc}); read from "
                        f"{format_lsn(cuts[-1])} on, or each stretch on its own") from exc


def at_frontier(cfg: StreamConfig, table: str, rows, lower: int, frontier: int):
    """``rows`` (the table at ``lower``) plus its changelog's changes at times in ``[lower, frontier)``:
    the table at ``frontier`` (the changelog holds every change at its own time, as full rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    # each row by its index into ``rows`` then ``data``, never as Python values: a date of 'infinity' or
    # a BC timestamp has none
    counts: dict[tuple, list] = {}
    for i, k in enumerate(row_keys(rows)):      # rows are the same by value bits (NaN, -0.0)
        counts.setdefault(k, [i, 0])[1] += 1
    log = read_changelog(cfg, table, covering=lower)   # the table at ``lower`` has that version's types
    log = log.filter(pc.and_(pc.greater_equal(log.column("_time"), lower), pc.less(log.column("_time"), frontier)))
    data = conform(log, rows.schema)
    for i, (k, d) in enumerate(zip(row_keys(data), log.column("_diff").to_pylist()), start=rows.num_rows):
        counts.setdefault(k, [i, 0])[1] += d
    both = pa.concat_tables([rows, data])
    take = []
    for i, n in counts.values():
        if n < 0:
            raise LakeError(f"{table}: its changelog takes out a row more often than the lake at {format_lsn(lower)} "
                            f"holds it ({_row_text(both, i)}); cannot read it at frontier {format_lsn(frontier)}")
        take.extend([i] * n)
    return both.take(pa.array(take, pa.int64()))


def _row_text(table, i: int) -> str:
    """Row ``i`` of ``table`` for a message (a value Python has no date or time for: its integer storage)."""
    row = table.slice(i, 1)
    try:
        return str(row.to_pylist()[0])
    except (ValueError, OverflowError):
        return str(identity_table(row).to_pylist()[0])


def read_changelog(cfg: StreamConfig, table: str | TableRef, *, days: tuple | None = None,
                   covering: int | None = None):
    """The consolidated changelog of ``table``: data columns, ``_time`` (commit LSN), ``_diff``,
    ``_commit_ts`` and the partition ``_commit_date``; ``days=(first, last)`` reads only those
    partitions (inclusive). The data columns are every column the table has had (ADD COLUMN adds
    one, DROP COLUMN keeps it), in the order they first appeared; a row reads null in a column the
    table did not have when the row was committed.

    A column whose type changed (ALTER COLUMN TYPE) restarts the changelog at the re-snapshot that
    followed (`tidemark.consolidate.log_evolution.log_type_change`): the current version holds the rows
    from there on; ``covering=P`` reads the version that holds the rows at position ``P`` (the one
    before the first restart past ``P``, with the types of then)."""
    log = changelog_or_none(cfg, table, days=days, covering=covering)
    if log is None:
        raise LakeError(f"{changelog_uri(cfg, table)}: no changelog yet")
    return log


def changelog_or_none(cfg: StreamConfig, table: str | TableRef, *, days: tuple | None = None,
                      covering: int | None = None):
    """`read_changelog`, or None when ``table`` has no changelog yet (its Delta log opened once)."""
    import datetime as _dt

    import pyarrow as pa
    import pyarrow.parquet as pq

    uri, opts = changelog_uri(cfg, table), storage_options(cfg)
    dt = open_delta(uri, opts)
    if dt is None:
        return None
    # the version just before the first restart past ``covering`` (None: the current one)
    version = next((v - 1 for v, lower in _log_restarts(dt, cfg.stream) if covering < lower), None) \
        if covering is not None else None
    if version is not None:
        dt.load_as_version(version)
    schema = pa.schema(dt.schema().to_arrow())
    meta = ("_time", "_diff", "_commit_ts")     # columns added later come after these in the Delta schema
    data_schema = pa.schema([f for f in schema if f.name not in meta + ("_commit_date",)]
                            + [schema.field(n) for n in meta])
    fs = filesystem(uri, opts)
    table_dt = open_delta(table_uri(cfg, table), opts)
    fill = missing_values(table_info(table_dt)) if table_dt is not None else {}
    parts = []
    for a in pa.table(dt.get_add_actions(flatten=True)).to_pylist():
        day = a["partition._commit_date"]
        day = day if isinstance(day, _dt.date) else _dt.date.fromisoformat(str(day))
        if days is not None and not (days[0] <= day <= days[1]):
            continue
        t = pq.read_table(strip_scheme(uri) + "/" + a["path"], filesystem=fs)
        t = conform(t, data_schema, fill)    # a column added later: null, or the DEFAULT rows took
        parts.append(t.append_column("_commit_date", pa.array([day] * t.num_rows, pa.date32())))
    if not parts:
        return data_schema.empty_table().append_column("_commit_date", pa.array([], pa.date32()))
    return pa.concat_tables(parts)
