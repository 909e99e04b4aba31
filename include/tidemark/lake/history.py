"""History from what the lake keeps: any table as of a source position or time (`read_tables_at`), a
key's versions (`key_history`), and the history tables the consolidation keeps (`read_history`).

The table right after the commit at LSN ``L`` is its newest Delta version whose frontier is at most
``L + 1`` plus its changelog's rows at times in ``[that frontier, L]``; positions are the source's
commit LSNs, so tables read at one ``L`` are a consistent cut (docs/reading-the-lake.md).
"""

from __future__ import annotations

import datetime as _dt
import re
from typing import Any

from tidemark.config import StreamConfig, TableRef
from tidemark.lake import retention
from tidemark.lake.changelog import at_frontier, changelog_or_none
from tidemark.lake.delta import (LakeError, conform, exact_schema, filesystem, frontier_of, history_uri,
                                 lake_schema, missing_values, open_delta, open_lake_table, read_dt, resolved_name,
                                 storage_options, strip_scheme, table_info, tidemark_commits, version_at)
from tidemark.lsn import format_lsn, parse_lsn
from tidemark.pgtypes import TableSchema

_LSN = re.compile(r"^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$")


def parse_at(at: Any) -> int | _dt.datetime:
    """``at`` as a position (an ``int`` LSN, or ``'16/B374D848'``) or an aware UTC datetime (an
    ISO-8601 text such as ``2026-11-24T10:00:00Z``; a naive one is taken as UTC)."""
    if isinstance(at, bool):
        raise LakeError(f"as of {at!r}: give an LSN (16/B374D848) or a time (2026-11-24T10:00:00Z)")
    if isinstance(at, int):
        if at < 0:
            raise LakeError(f"as of {at}: a position is not negative")
        return at
    if isinstance(at, _dt.datetime):
        return at if at.tzinfo else at.replace(tzinfo=_dt.timezone.utc)
    text = str(at).strip()
    if _LSN.match(text):
        return parse_lsn(text)
    try:
        when = _dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise LakeError(f"as of {text!r}: neither an LSN (like 16/B374D848) nor an ISO-8601 time "
                        "(like 2026-11-24T10:00:00Z)") from None
    return when if when.tzinfo else when.replace(tzinfo=_dt.timezone.utc)


def stream_frontier(cfg: StreamConfig) -> int | None:
    """The stream's frontier as the control database records it: every table of the stream holds
    every change below it (a batch that failed part-way may have committed some tables further)."""
    # deferred: tidemark.control imports psycopg2; the lake's readers load it only to read as of a position
    from tidemark.control import open_control

    with open_control(cfg) as ctl:
        return ctl.stream(cfg.stream).frontier


def position_at(cfg: StreamConfig, when: _dt.datetime, names: list[str]) -> int:
    """The LSN of the last commit at or before ``when`` among the changes of ``names`` that the lake
    recorded (their changelogs' ``_commit_ts``). Before the first of them: the snapshot the tables
    were loaded from, when ``when`` is after it finished (no change of these tables lies between);
    else an error naming the earliest time that can be read. Costs a read of the tables' changelogs'
    ``_time`` and ``_commit_ts`` columns."""
    import pyarrow as pa
    import pyarrow.compute as pc

    best, first = None, None
    for name in names:
        log = changelog_or_none(cfg, name)
        if log is None or log.num_rows == 0:
            continue
        ts = log.column("_commit_ts")
        known = pc.is_valid(ts)
        times, ts = log.column("_time").filter(known), ts.filter(known)
        if len(times) == 0:
            continue
        early = pc.min(ts).as_py()
        first = early if first is None or early < first else first
        at_or_before = pc.less_equal(ts, pa.scalar(when, pa.timestamp("us", tz="UTC")))
        picked = times.filter(at_or_before)
        if len(picked):
            cand = pc.max(picked).as_py()
            best = cand if best is None or cand > best else best
    if best is not None:
        return best
    base = _base_snapshot(cfg, names)
    if base is not None and base[1] is not None and when >= base[1]:
        return base[0] - 1 if base[0] > 0 else 0
    earliest = [t for t in (first, base[1] if base else None) if t is not None]
    raise LakeError(f"as of {when.isoformat()}: no commit of {', '.join(names)} the lake recorded is at or before "
                    "it" + (f"; the earliest time that can be read is {min(earliest).isoformat()}" if earliest else ""))


def _base_snapshot(cfg: StreamConfig, names: list[str]) -> tuple[int, _dt.datetime | None] | None:
    """(LSN, finished_at) of the newest loaded snapshot that holds any of ``names``, from the control database."""
    # deferred: tidemark.control imports psycopg2; the lake's readers load it only to read as of a position
    from tidemark.control import open_control

    with open_control(cfg) as ctl:
        rows = ctl.loaded_snapshots(cfg.stream)
    for lsn, finished, tables in rows:
        if any(n in tables for n in names):
            return lsn, finished
    return None


def read_tables_at(cfg: StreamConfig, at: Any, tables: list[str | TableRef] | None = None, *,
                   frontier: int | None = None) -> dict:
    """Every (or the given) table of the stream as the source held it right after its commit at
    position ``at`` (an LSN), or at time ``at`` (the last commit at or before it: `position_at`);
    ``{schema.table: pyarrow.Table}``, all at the same position.

    ``frontier`` is the stream's (read from the control database when None): a position at or past
    it is refused, the lake does not hold it yet. Per table: one Delta version's files plus its
    changelog's rows up to the position, folded here. Columns are those of that version, with those
    a later batch added (a column added inside a batch reads null before its first change).

    A position below the oldest version Delta still lists (VACUUM, log retention) or below the
    tables' first load raises `LakeError` naming the oldest position that can be read."""
    names = [resolved_name(t) for t in (tables if tables is not None else cfg.source.tables)]
    when = parse_at(at)
    now = _dt.datetime.now(_dt.timezone.utc)
    if isinstance(when, _dt.datetime) and when > now:
        # the last commit before a time still to come is not known yet: its table would be today's, shown as then
        raise LakeError(f"as of {when.isoformat()}: that time is still to come (now is {now.isoformat()}); read a "
                        "time up to now, or a position below the stream's frontier")
    frontier = stream_frontier(cfg) if frontier is None else frontier
    if frontier is None:
        raise LakeError(f"stream {cfg.stream} has nothing consolidated yet")
    lsn = position_at(cfg, when, names) if isinstance(when, _dt.datetime) else when
    if lsn >= frontier:
        raise LakeError(f"as of {format_lsn(lsn)}: the lake holds stream {cfg.stream} up to {format_lsn(frontier)} "
                        "(exclusive); consolidate first, or read an earlier position")

    retention.check_position(cfg, lsn, f"as of {format_lsn(lsn)}")     # the retention window is the rule
    return {name: _table_at(cfg, name, lsn) for name in names}


def read_table_at(cfg: StreamConfig, table: str | TableRef, at: Any, *, frontier: int | None = None):
    """One table as of ``at`` (`read_tables_at`)."""
    name = resolved_name(table)
    return read_tables_at(cfg, at, [name], frontier=frontier)[name]


def _table_at(cfg: StreamConfig, name: str, lsn: int):
    import pyarrow as pa

    uri, opts, dt = open_lake_table(cfg, name)
    version = version_at(dt, cfg.stream, lsn + 1)
    if version is None:
        oldest = min((int(m["frontier"]) for _, m in tidemark_commits(dt, cfg.stream)), default=None)
        raise LakeError(f"{name} as of {format_lsn(lsn)}: below what the lake holds of it"
                        + (f"; its oldest readable position is {format_lsn(oldest)} (the first version Delta "
                           "still lists; older ones were vacuumed or never existed)" if oldest is not None else ""))
    below = frontier_of(dt, stream=cfg.stream, version=version)
    # the first version that records a frontier past lsn + 1 (the batch that holds it), if any
    covering = next((v for v, m in tidemark_commits(dt, cfg.stream) if int(m["frontier"]) > lsn + 1), None)
    try:
        dt.load_as_version(version)
        rows = read_dt(dt, uri, opts)
    except Exception as exc:  # noqa: BLE001 - a vacuumed file or a cleaned-up log entry
        raise LakeError(f"{name} as of {format_lsn(lsn)}: version {version} of {uri} cannot be read any more "
                        f"({type(exc).__name__}: {str(exc)[:200]}); its files or log were removed by VACUUM or "
                        "log retention") from exc
    if covering is not None:      # columns a later batch added (its shape may have come inside it)
        dt.load_as_version(covering)
        added = [f for f in exact_schema(dt) if f.name not in rows.column_names]
        rows = conform(rows, pa.schema(list(rows.schema) + added), missing_values(table_info(dt)))
    if below is not None and below <= lsn:
        rows = at_frontier(cfg, name, rows, below, lsn + 1)
    return rows


# -- a key's versions (SCD type 2, folded from the changelog: `lake.scd2`) ------------------------------
def fold_versions(base_rows, base: int, changes, keys: list[str]) -> list[dict]:
    """The versions of every key, SCD type 2 (`scd2.fold`), sorted by key and start: ``base_rows``
    (the rows at position ``base``) open a version each at ``base``; then ``changes`` (changelog
    rows: the columns, ``_time``, ``_diff``, ``_commit_ts``) close and open versions. Each: Arrow
    table or Python rows (None or empty: none). A version: the row's columns plus `scd2.HISTORY_META`."""
    import pyarrow as pa

    # deferred: scd2 imports numpy and pyarrow at its top, which `import tidemark.lake` does not load
    from tidemark.lake.scd2 import LOG_META, fold, history_schema, log_schema, opened_at_load

    base_rows, changes = [pa.Table.from_pylist(t) if isinstance(t, list) and t else None if isinstance(t, list) else t
                          for t in (base_rows, changes)]
    fields: dict = {}
    for t in (changes, base_rows):
        for f in (t.schema if t is not None else []):
            if f.name not in LOG_META and (f.name not in fields or pa.types.is_null(fields[f.name].type)):
                fields[f.name] = f.with_nullable(True)
    if not fields:
        return []
    data = pa.schema(list(fields.values()))
    hs = history_schema(data)
    opened = opened_at_load(conform(base_rows, data), base, hs) if base_rows is not None else hs.empty_table()
    log = conform(changes, log_schema(data)) if changes is not None else log_schema(data).empty_table()
    kept, opened, closed, problem = fold(opened, log, keys, hs)
    if problem is not None:
        raise LakeError(problem)
    done = kept.to_pylist() + opened.to_pylist() + closed.to_pylist()
    return sorted(done, key=lambda v: (tuple(_sortable(v[k]) for k in keys), v["_valid_from_lsn"]))


def _sortable(value):
    return (value is None, str(type(value)), value if value is not None else 0)


def key_history(cfg: StreamConfig, table: str | TableRef, key: dict[str, Any]) -> list[dict]:
    """The versions of one key of ``table`` (`fold_versions`), oldest first, from the table's last
    load (its snapshot or a full resend: the changelog restarts there), or from the retention
    window's first version when the load is older (`tidemark.lake.retention`: the version open there
    is shown from the window's horizon), to the lake's frontier. The
    key's values are compared after casting them to the key columns' lake types. Costs a read of the
    loaded version's files and of the table's changelog."""
    import pyarrow as pa
    import pyarrow.compute as pc

    name = resolved_name(table)
    uri, opts, dt = open_lake_table(cfg, name)

    info = table_info(dt)
    shape = TableSchema.from_json(info["table_schema"]) if info.get("table_schema") else None
    keys = list(shape.key_columns) if shape is not None and shape.replica_identity != "f" else []
    if not keys:
        raise LakeError(f"{name} has no key (no primary key, or REPLICA IDENTITY FULL): its rows have no "
                        "identity to follow; it is a multiset of whole rows (read it as of a position instead)")
    unknown = sorted(set(key) - set(keys))
    missing = [k for k in keys if k not in key]
    if unknown or missing:
        raise LakeError(f"{name}: its key is ({', '.join(keys)}); "
                        + "; ".join(p for p in (f"not key columns: {', '.join(unknown)}" if unknown else "",
                                                f"missing: {', '.join(missing)}" if missing else "") if p))
    base_version, base = last_load(dt, cfg.stream)
    # the fold starts at the last load's version; a load older than the retention window (its files
    # may be vacuumed) gives way to the window's first version: the key's history from there on
    v0, horizon, _ = retention.table_window(dt, cfg.stream, retention.window_start_ms(cfg))
    if v0 is not None and horizon is not None and base < horizon:
        base_version, base = v0, horizon
    dt.load_as_version(base_version)
    rows = read_dt(dt, uri, opts)
    schema = rows.schema
    wanted = {k: _key_value(name, k, key[k], schema.field(k).type) for k in keys}

    def matching(t):
        mask = None
        for k in keys:
            m = pc.equal(t.column(k).cast(schema.field(k).type), wanted[k])
            mask = m if mask is None else pc.and_(mask, m)
        return t.filter(pc.fill_null(mask, False))

    log = changelog_or_none(cfg, name)
    changes = None
    if log is not None and log.num_rows:
        log = log.filter(pc.greater_equal(log.column("_time"), base))
        changes = matching(log).drop_columns(["_commit_date"])
    return fold_versions(matching(rows), base, changes, keys)


def _key_value(table: str, column: str, value: Any, lake_type):
    """``value`` (a key column's value, text from the command line) as a scalar of the column's lake
    type; a value that is none (``--key id=abc`` of an integer key) is a `LakeError` naming both."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        if isinstance(value, str):
            return pc.cast(pa.array([value]), lake_type)[0]
        return pa.scalar(value).cast(lake_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, TypeError, ValueError) as exc:
        raise LakeError(f"{table}: key column {column} holds {lake_type} values; {value!r} is not one "
                        f"({' '.join(str(exc).split())})") from None


def last_load(dt, stream: str) -> tuple[int, int]:
    """(version, frontier) of the table's newest snapshot load (else its first Tidemark version)."""
    ours = tidemark_commits(dt, stream)
    if not ours:
        raise LakeError("the table has no Tidemark commit yet")
    version, m = ([o for o in ours if o[1].get("operation") == "snapshot"] or ours[:1])[-1]
    return version, int(m["frontier"])


# -- the history tables the consolidation keeps (stream file: ``history:``) ------------------------------
def read_history(cfg: StreamConfig, table: str | TableRef, *, current: bool | None = None):
    """The SCD type 2 history table of ``table`` (`tidemark.consolidate.history`) as one Arrow table:
    the row's columns (every column the table has had; null where a version's row lacked it), then
    ``_valid_from_lsn``, ``_valid_to_lsn``, ``_valid_from``, ``_valid_to``, ``_is_current``,
    ``_deleted``; sorted by key and ``_valid_from_lsn``. ``current``: only the current versions
    (True) or only the closed ones (False); the current versions are in their own files, so reading
    them alone costs about one read of the table. It holds the changes below its frontier, which the
    consolidation keeps at the changelog's."""
    from urllib.parse import unquote

    import pyarrow as pa
    import pyarrow.parquet as pq

    name = resolved_name(table)
    if not any(t.qualified == name for t in cfg.history):
        raise LakeError(f"{name} has no history table: add it to history: in the stream file of {cfg.stream}")
    opts = storage_options(cfg)
    uri = history_uri(cfg, name)
    dt = open_delta(uri, opts)
    if dt is None:
        raise LakeError(f"{uri}: no history table yet (it is written by the next consolidation)")
    schema = lake_schema(dt)
    fs = filesystem(uri, opts)
    root = strip_scheme(uri).rstrip("/")
    parts = []
    for a in pa.table(dt.get_add_actions(flatten=True)).column("path").to_pylist():
        is_open = a.rsplit("/", 1)[-1].startswith("open-")
        if current is not None and is_open != current:
            continue
        parts.append(conform(pq.read_table(root + "/" + unquote(a), filesystem=fs), schema))
    rows = pa.concat_tables(parts) if parts else schema.empty_table()
    keys = table_info(dt).get("keys") or []
    return rows.sort_by([(k, "ascending") for k in keys + ["_valid_from_lsn"]]) if rows.num_rows else rows
