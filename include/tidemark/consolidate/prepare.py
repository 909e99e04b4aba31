"""Stage 3 of a batch (`TablePrep`, `prepare_tables`): each table brought to where its merge starts,
on the driver: a pending snapshot loaded (`load_snapshot`), its shape brought to the batch's newest
(`columns.target_shape`; `evolve`), a re-snapshot of a held table turned into a truncate and rows at
its LSN (`Prepared.reload`). Nothing here reads a change's data: the executors do.
"""

from __future__ import annotations

import json
import logging
import time as _time
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Mapping

from tidemark.capture import ranges as _ranges
from tidemark.capture.source import connect_source
from tidemark.consolidate import transform as T
from tidemark.consolidate.columns import RESNAPSHOT, Identity, changelog_conflict, replaces, target_shape
from tidemark.consolidate.decoded import Decoded, Scope, lake_buckets
from tidemark.consolidate.failure import for_table
from tidemark.consolidate.log_evolution import UNREAD
from tidemark.consolidate.plan import phase
from tidemark.consolidate.recut import snapshot_rows
from tidemark.consolidate.work_area import RELOAD_POSITION
from tidemark.errors import ConsolidateError, TableNeedsSnapshot
from tidemark.lake import (BUCKET_COLUMN, changelog_uri, committed_frontier, history_uri, layout, open_delta,
                           table_info, table_uri, writer as _commit)
from tidemark.lake.delta import missing_values, table_description
from tidemark.lake.layout import effective_keys
from tidemark.landing.store import landing_store
from tidemark.lsn import format_lsn
from tidemark.pgtypes import TableSchema, arrow_schema
from tidemark.sparkconf import default_parallelism

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """One table where its merge starts (`prepare`); the merge stage adds its changelog and history
    (`batch._planned`, a copy)."""

    table: str
    uri: str
    dt: Any
    shape: Any
    target: Any
    keys: list[str]
    lower: int
    buckets: int
    lake_at: int | None = None       # the lake table's committed frontier for the stream, as read
    log_dt: Any = UNREAD            # its changelog Delta table (None: none yet), once opened
    log_plan: Any = None             # `LogPlan`: where the executors write its changelog (None: committed)
    truncates: list = field(default_factory=list)    # [(time, position, commit_ts)] in [lower, frontier)
    frontier: int = 0                # where the batch brings it (the stream's, or an external feed table's own)
    reload: Any = None               # a re-snapshot (`PendingSnapshot`, mode table) merged at its LSN
    reload_cts: int = 0              # the commit time (µs) its corrections take in the changelog
    replay: bool = False             # the changelog rows only, nothing written (`replay`)
    loaded: tuple = (0, None)        # (rows, version) of the snapshot load before the changes, if any
    missing: dict = field(default_factory=dict)  # column -> text of the DEFAULT rows lacking it hold
    fill: dict = field(default_factory=dict)     # the same as lake values (pyarrow scalars), for the executors
    history: Any = None              # (`history.HistorySpec`, its Delta table): folded by the merge job
    renames: dict = field(default_factory=dict)  # old name -> new name: RENAME COLUMN (`column_identity`)
    attnums: dict = field(default_factory=dict)  # column -> its attnum in the source, where known
    snapshot: str | None = None      # the pending snapshot this table takes in this batch (loaded or merged)
    base: str | None = None          # the snapshot its changelog restarts from in this batch (its rows are not in it)


@dataclass(frozen=True)
class TablePrep:
    """Stage 3's result: every table of the batch prepared (`prepare`)."""

    decoded: Decoded
    scope: Scope
    tables: Mapping[str, Prepared]            # each table of ``scope.tables``, in order
    merging: tuple[str, ...]                  # those with changes to merge (the others: a snapshot load at most)

    def snapshots_loaded(self) -> list[str]:
        """The loadable snapshots every table of which this batch took."""
        took = {(t, p.snapshot) for t, p in self.tables.items()}
        return [s.snapshot_id for s in self.scope.loadable if all((t, s.snapshot_id) in took for t in s.tables)]


def prepare_tables(dec: Decoded, scope: Scope) -> TablePrep:
    """Prepare each table of ``scope`` (`prepare`), in order; a failure names its table (`for_table`)."""
    t0 = _time.perf_counter()
    out = {}
    for table in scope.tables:
        with for_table(table):
            out[table] = prepare(dec, table, (scope.frontiers or {}).get(table, scope.frontier), scope.loadable)
    phase("plan tables (driver)", _time.perf_counter() - t0)
    return TablePrep(dec, scope, out, tuple(sorted(t for t, p in out.items() if p.shape is not None)))


def prepare(dec: Decoded, table: str, frontier: int, loadable) -> Prepared:
    """What the merge needs of one table, once its pending snapshot is loaded (`load_snapshot`) and its
    shape evolved (`evolve`). ``shape`` is None when it has no change to merge (``loaded``: what the
    snapshot load did)."""
    uri = table_uri(dec.cfg, table)
    # opened before decoding (`decoded.decode`); nothing committed since
    dt = dec.lake_tables[table] if table in dec.lake_tables else open_delta(uri, dec.options)
    done = lake_at = committed_frontier(dt, dec.cfg.stream) if dt is not None else None
    loaded, base = (0, None), None
    snap = next((s for s in reversed(loadable) if table in s.tables), None)
    reload, reload_cts = None, 0
    if snap is not None and snap.mode == "table" and done is not None and done < snap.lsn \
            and not replaces(snap, table, dt, dec.cfg):
        # re-snapshot of a table the lake holds: at its LSN the merge takes every row out and puts the
        # snapshot's in (a truncate, then its rows), so the changelog records only the difference
        reload = snap
    elif snap is not None:
        if done is None or done < snap.lsn:
            version = load_snapshot(dec, table, snap, dt)
            base = (f"snapshot {snap.snapshot_id} ({snap.mode}) at {format_lsn(snap.lsn)}: its rows are not "
                    "in this changelog")
            loaded = (snap.tables[table].get("rows", 0), version)
            dt = open_delta(uri, dec.options)
            lake_at = committed_frontier(dt, dec.cfg.stream)
        done = max(done or 0, snap.lsn)
    took = snap.snapshot_id if snap is not None else None
    lower = max(dec.start, done or 0)
    nothing = Prepared(table, uri, dt, None, None, [], lower, 0, loaded=loaded, frontier=frontier, snapshot=took,
                       base=base)
    if lower >= frontier:
        return nothing
    shapes = [r for r in dec.shapes if r["table"] == table and r["time"] >= lower]
    truncates = dec.truncates(table, lower, frontier)
    if reload is not None:
        # its rows reach the merge at (L, RELOAD_POSITION), after a truncate at (L, RELOAD_POSITION - 1)
        # and before any change committed at L; the snapshot's shape counts as one of the batch's
        reload_cts = int(_time.time() * 1_000_000)     # one commit time for its -1s and +1s: identical rows cancel
        truncates = sorted(truncates + [(reload.lsn, RELOAD_POSITION - 1, reload_cts)])
        shapes = shapes + [{"table": table, "time": reload.lsn,
                            "info": json.dumps(reload.tables[table]["table_schema"], sort_keys=True)}]
    if not shapes and not truncates:
        return nothing
    shape, ident = target_shape(dec.cfg, table, shapes, dt, reload)
    if shape is None:                  # a truncate of a table the lake does not hold yet
        return nothing
    conflict = changelog_conflict(dec.cfg, table, shape, dt) if base is None else None
    if conflict is not None:           # before anything is committed (`evolve` adds the column to the table)
        raise TableNeedsSnapshot(f"stream {dec.cfg.stream} table {table}: {conflict} (a column dropped earlier, "
                                 "added again under its name with another type); the changelog keeps every column "
                                 "the table has had, so it restarts at a re-snapshot of the table that replaces it; "
                                 f"{RESNAPSHOT.format(stream=dec.cfg.stream, table=table)}", table=table)
    dt = evolve(dec, table, shape, dt, reload=reload, ident=ident)
    info = table_info(dt) if dt is not None else {}
    missing = {c: v for c, v in (info.get("missing_values") or {}).items() if c in {x.name for x in shape.columns}}
    return Prepared(table, uri, dt, shape, arrow_schema(shape), effective_keys(shape), lower,
                    lake_buckets(dec.cfg, dt), lake_at, truncates=truncates, loaded=loaded, frontier=frontier,
                    reload=reload, reload_cts=reload_cts, missing=missing,
                    fill=missing_values({"table_schema": shape.to_json(), "missing_values": missing}),
                    renames=ident.renames, attnums=ident.attnums, snapshot=took, base=base)


def evolve(dec: Decoded, table: str, shape: TableSchema, dt, reload, ident: Identity):
    """Bring the lake table to ``shape`` before its changes are merged; return the table as it is
    now (None: not created yet). RENAME COLUMN (``ident.renames``) renames the column in the table,
    its changelog and history (`rename_logs`); ADD COLUMN extends the schema (earlier rows hold null)
    or, with a non-volatile DEFAULT, rewrites the files with PostgreSQL's ``attmissingval``, kept in
    the table's description for change images without the column; DROP COLUMN rewrites the files
    without it. Under a re-snapshot in the same batch (``reload``) only the columns added after its
    copy are checked (`_added_defaults`)."""
    info = table_info(dt) if dt is not None else {}
    if not info.get("table_schema"):
        return dt
    target = arrow_schema(shape)
    old = TableSchema.from_json(info["table_schema"])
    renames = {a: b for a, b in ident.renames.items() if a in {c.name for c in old.columns}}   # not renamed yet
    old_names = [renames.get(c.name, c.name) for c in old.columns]
    new_names = [c.name for c in shape.columns]
    added = [f for f in target if f.name not in old_names]
    dropped = [n for n in old_names if n not in new_names]
    defaults = {}
    if reload is not None:
        # its rows replace the lake's in its copy's shape: they lack only the columns added after the copy
        copied = {c.name for c in TableSchema.from_json(reload.tables[table]["table_schema"]).columns}
        after = [f.name for f in added if f.name not in copied]
        if after and (dt.file_uris() or reload.tables[table].get("files")):
            defaults = _added_defaults(dec, table, shape, after, [])
    elif added and dt.file_uris():
        defaults = _added_defaults(dec, table, shape, [f.name for f in added], [] if ident.verified else dropped)
    uri = table_uri(dec.cfg, table)
    if renames:
        rename_logs(dec, table, renames, effective_keys(shape))
    if dropped or defaults or renames:
        before = {renames.get(c, c): v for c, v in (info.get("missing_values") or {}).items()}
        missing = {c: v for c, v in {**before, **defaults}.items() if c in new_names}
        _rewrite_columns(dec, table, shape, dt, missing, renames, ident.attnums)
        if defaults:
            log.info("stream %s table %s: column(s) %s added with a DEFAULT: the existing rows take it "
                     "(pg_attribute.attmissingval), no copy", dec.cfg.stream, table, ", ".join(sorted(defaults)))
        if renames:
            log.info("stream %s table %s: column(s) renamed in the lake, its changelog and history (no copy): %s",
                     dec.cfg.stream, table, ", ".join(f"{a} -> {b}" for a, b in sorted(renames.items())))
        return open_delta(uri, dec.options)
    if added:
        _commit.add_columns(dt, added)
        return open_delta(uri, dec.options)
    return dt


def rename_logs(dec: Decoded, table: str, renames: dict, keys: list[str]) -> None:
    """Rename columns (old -> new) in the table's changelog and history tables, each as one Delta
    version rewriting all of its files, the rename in its commit metadata; before the lake table's own
    rewrite, so a run that stops in between renames what is left next time. Raises
    `TableNeedsSnapshot`, before anything is renamed, when one already has a column of a new name."""
    tables = {what: open_delta(uri, dec.options) for what, uri in
              (("changelog", changelog_uri(dec.cfg, table)), ("history", history_uri(dec.cfg, table)))}
    todo = {}
    for what, dt in tables.items():
        have = [f.name for f in dt.schema().fields] if dt is not None else []
        mine = {a: b for a, b in renames.items() if a in have}
        clash = [b for b in mine.values() if b in have]
        if clash:
            raise TableNeedsSnapshot(f"stream {dec.cfg.stream} table {table}: column(s) renamed to "
                                     f"{', '.join(clash)}, but its {what} holds a column of that name already (one "
                                     f"dropped earlier); {RESNAPSHOT.format(stream=dec.cfg.stream, table=table)}",
                                     table=table)
        if mine:
            todo[what] = (dt, mine)
    for what, (dt, mine) in todo.items():
        _rename_files(dec, dt, mine, keys, what)


def _rename_files(dec: Decoded, dt, renames: dict, keys: list[str], what: str) -> None:
    import pyarrow as pa

    partition = dt.metadata().partition_columns[0]
    acts = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    rows = [(a["path"], str(a[f"partition.{partition}"])) for a in acts]
    uri, options, tag = dt.table_uri, dec.options, layout.plan_tag(0)
    out = []
    if rows:
        out = _frame(dec, rows, "path string, partition string").mapInArrow(
            lambda it: layout.rename_files(uri, options, renames, keys, tag, it), layout.ACTIONS_DDL
        ).toArrow().to_pylist()
    schema = pa.schema([pa.field(renames.get(f.name, f.name), f.type, f.nullable, f.metadata)
                        for f in pa.schema(dt.schema().to_arrow()) if f.name != partition])
    _commit.commit_files(uri, options, dt, schema, out, stream=dec.cfg.stream,
                         frontier=committed_frontier(dt, dec.cfg.stream) or 0, desc=dt.metadata().description,
                         partition=partition, overwrite=True, operation="rename_columns", meta={"renamed": renames})
    log.info("stream %s: %s %s: column(s) renamed, %d files rewritten", dec.cfg.stream, what, uri, len(out))


def _frame(dec: Decoded, rows: list[tuple], ddl: str):
    """``rows`` as a DataFrame of ``ddl``, spread over the cores."""
    return dec.spark.createDataFrame(rows, ddl).repartition(max(1, min(len(rows), default_parallelism(dec.spark))))


def _files_df(dec: Decoded, files: dict[int, list[dict]]):
    return _frame(dec, [(f["path"], int(f["size"]), int(f["rows"] or 0), b) for b, fs in files.items() for f in fs],
                  layout.FILES_DDL)


def _bucketed(rows, columns: list[str], buckets: int, bplan) -> list[dict]:
    """The file actions of DataFrame ``rows`` cut into ``buckets`` by ``columns`` and written bucket by
    bucket (`layout.load_bucket`)."""
    rows, names = T.plain_names(rows.withColumn(BUCKET_COLUMN, T.bucket_expr(columns, buckets)))
    return rows.groupBy(BUCKET_COLUMN).applyInArrow(lambda t: layout.load_bucket(bplan, next(T.named([t], names))),
                                                    layout.ACTIONS_DDL).toArrow().to_pylist()


def _rewrite_columns(dec: Decoded, table: str, shape: TableSchema, dt, missing: dict[str, str], renames: dict,
                     attnums: dict) -> None:
    """Rewrite every file of the table with exactly ``shape``'s columns (one version), a column of
    ``missing`` holding its value, one of ``renames`` (old -> new) under its new name. A keyed table's
    rows stay in their files' buckets; a table without a key (hashed by every column) is bucketed again."""
    target = arrow_schema(shape)
    keys = effective_keys(shape)
    sort = layout.sort_columns(target, keys)
    uri = table_uri(dec.cfg, table)
    buckets = lake_buckets(dec.cfg, dt)
    done = committed_frontier(dt, dec.cfg.stream) or 0
    bplan = layout.BucketPlan(uri=uri, options=dec.options, schema=target, keys=keys, sort=sort,
                              files=layout.file_index(dt, sort), target_rows=dec.target_rows,
                              tag=layout.plan_tag(done), renames=dict(renames),
                              fill=missing_values({"table_schema": shape.to_json(), "missing_values": missing}))
    acts = []
    if bplan.files and keys:
        acts = _files_df(dec, bplan.files).mapInArrow(lambda it: layout.project_files(bplan, it),
                                                     layout.ACTIONS_DDL).toArrow().to_pylist()
    elif bplan.files:
        from pyspark.sql.pandas.types import from_arrow_schema

        rows = _files_df(dec, bplan.files).mapInArrow(lambda it: layout.projected_rows(bplan, it),
                                                      from_arrow_schema(target, prefer_timestamp_ntz=True))
        acts = _bucketed(rows, [c.name for c in shape.columns], buckets, bplan)
    desc = table_description(uri, dec.options, dec.cfg.stream, table, buckets, shape.to_json(), missing, attnums)
    _commit.commit_files(uri, dec.options, dt, target, [a for a in acts if a["op"] == "add"],
                         stream=dec.cfg.stream, frontier=done, desc=desc, overwrite=True,
                         operation="rewrite_columns", meta={"renamed": renames} if renames else None)


def load_snapshot(dec: Decoded, table: str, snap, dt) -> int:
    """Write the snapshot's rows as the table's new version (bucketed, sorted), app txn (stream, lsn)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    entry = snap.tables[table]
    shape = TableSchema.from_json(entry["table_schema"])
    target = arrow_schema(shape)
    keys = effective_keys(shape)
    buckets = lake_buckets(dec.cfg, dt)
    uri = table_uri(dec.cfg, table)
    store = landing_store(dec.cfg)
    uris = [store.uri(k) for k in entry.get("files", [])]
    endpoint = dec.cfg.landing.endpoint_url
    sort = layout.sort_columns(target, keys)
    bplan = layout.BucketPlan(uri=uri, options=dec.options, schema=target, keys=keys, sort=sort,
                              target_rows=dec.target_rows, tag=layout.plan_tag(snap.lsn))
    acts: list[dict] = []
    spark_schema = from_arrow_schema(target, prefer_timestamp_ntz=True)
    parts = []
    if uris:
        parts.append(_frame(dec, [(u,) for u in uris], "uri string").mapInArrow(
            lambda it: snapshot_rows(it, target, endpoint), spark_schema))
    ranged = entry.get("ranges") or {}
    expected = entry.get("rows")
    if "copied" in ranged:
        # a resend by key ranges: the lake's rows of every range that was not copied are kept
        parts += _kept_rows(dec, table, snap, dt, shape, keys, ranged, spark_schema)
        expected = ranged["source_rows"]
    if parts:
        rows = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])
        acts = _bucketed(rows, keys or [c.name for c in shape.columns], buckets, bplan)
    total = sum(a["rows"] for a in acts if a["op"] == "add")
    if total != (total if expected is None else expected):
        what = ("the source held" if "copied" in ranged else "the manifest says")
        raise ConsolidateError(f"stream {dec.cfg.stream} snapshot {snap.snapshot_id} table {table}: "
                               f"{total} rows loaded, {what} {expected}")
    if "copied" in ranged:
        log.info("stream %s table %s: resend by key ranges: %d of %d ranges re-copied (%d rows), %d rows kept from "
                 "the lake", dec.cfg.stream, table, ranged["ranges_differing"], ranged["ranges"],
                 entry.get("rows", 0), total - entry.get("rows", 0))
    desc = table_description(uri, dec.options, dec.cfg.stream, table, buckets, shape.to_json(),
                             attnums=entry.get("attnums"))
    return _commit.commit_files(uri, dec.options, dt, target, acts, stream=dec.cfg.stream, frontier=snap.lsn,
                                desc=desc, overwrite=dt is not None, operation="snapshot",
                                # array columns held as PostgreSQL's text (a value their lists cannot hold)
                                meta={"held_as_text": shape.held_as_text} if shape.held_as_text else None)


def _kept_rows(dec: Decoded, table: str, snap, dt, shape: TableSchema, keys: list[str], ranged: dict,
               spark_schema) -> list:
    """The lake's rows outside the key ranges a resend copied (`tidemark.capture.ranges`), as a Spark
    DataFrame in a list (empty: no file); the lake must be at the Delta version the resend compared."""
    version = None if dt is None else int(dt.version())
    if version != ranged["lake_version"]:
        raise ConsolidateError(f"stream {dec.cfg.stream} snapshot {snap.snapshot_id} table {table}: the resend copied "
                               f"only the key ranges that differed from lake version {ranged['lake_version']}, but "
                               f"the lake table is at version {version} now; take the resend again (tidemark snapshot "
                               f"{dec.cfg.stream} --mode resend)")
    files = layout.file_index(dt, [])
    if not files:
        return []
    info = table_info(dt)
    target = arrow_schema(shape)
    plan = layout.BucketPlan(uri=table_uri(dec.cfg, table), options=dec.options, schema=target, keys=keys, sort=[],
                             fill=missing_values(info))
    shape_json, bits, copied = shape.to_json(), int(ranged["bits"]), ranged["copied"]
    return [_files_df(dec, files).mapInArrow(
        lambda it: _ranges.kept_rows(plan, shape_json, keys, bits, copied, it), spark_schema)]


def _added_defaults(dec: Decoded, table: str, shape: TableSchema, added: list[str],
                    dropped: list[str]) -> dict[str, str]:
    """{column: text} of the value the lake's existing rows take for columns added with a non-volatile
    DEFAULT (PostgreSQL's ``attmissingval``). Raises `TableNeedsSnapshot` (a table without a key:
    `ConsolidateError`) for what PostgreSQL neither sends a change for nor records: a volatile DEFAULT
    (named with the time of the batch's first decoded part whose shape has an added column), ``dropped``
    columns beside the added ones (RENAME COLUMN), a DEFAULT on a table without a key."""
    cfg = dec.cfg
    keyed = bool(effective_keys(shape))
    remedy = (f"re-snapshot that table while the stream runs (the consolidate DAG's resend step does it by itself; "
              f"by hand: tidemark snapshot {cfg.stream} --mode table --tables {table})" if keyed else
              f"resend the stream (tidemark snapshot {cfg.stream} --mode resend): a table without a key cannot "
              "be corrected by a re-snapshot of its own")
    error = (lambda msg: TableNeedsSnapshot(msg, table=table)) if keyed else ConsolidateError
    if dropped:
        raise error(f"stream {cfg.stream} table {table}: column(s) {', '.join(dropped)} disappeared and "
                    f"{', '.join(added)} appeared in one batch (RENAME COLUMN, or DROP and ADD COLUMN); "
                    f"PostgreSQL sends no change for the existing rows, so their values are unknown: {remedy}")
    with closing(connect_source(cfg)) as conn, conn.cursor() as cur:
        # attmissingval is a one-element array of the column's type; its element's text is the value
        cur.execute("""SELECT a.attname, a.atthasmissing, a.attndims > 0 OR t.typcategory = 'A',
                              (SELECT m FROM unnest(a.attmissingval::text::text[]) m LIMIT 1),
                              pg_get_expr(d.adbin, d.adrelid)
                         FROM pg_attribute a
                         JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
                         JOIN pg_type t ON t.oid = a.atttypid
                         LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                        WHERE n.nspname = %s AND c.relname = %s AND a.attname = ANY(%s) AND NOT a.attisdropped
                          AND (a.atthasmissing OR (a.atthasdef
                               AND pg_get_expr(d.adbin, d.adrelid) !~ '^\\(?NULL\\)?(::.*)?$'))
                        ORDER BY a.attnum""",
                    (shape.schema, shape.name, added))
        found = cur.fetchall()
    unknown = [(name, expr) for name, has_missing, is_array, _, expr in found if not has_missing or is_array]
    if unknown and keyed:
        # one line of what and where (the remedy is the failure's, `failure.Where.failed`)
        name, expr = unknown[0]
        times = [r["time"] for r in dec.shapes if r["table"] == table and r["time"] is not None
                 and set(added) & {c["name"] for c in json.loads(r["info"])["columns"]}]
        where = f" at {format_lsn(min(times))}" if times else ""
        more = f" (and {', '.join(n for n, _ in unknown[1:])})" if unknown[1:] else ""
        expr = " ".join((expr or "?").split())      # one line, cut at 60 characters
        expr = expr if len(expr) <= 60 else expr[:59] + "…"
        raise error(f"stream {cfg.stream} table {table}: column {name}{more} added with DEFAULT {expr}"
                    f"{where}: no value recorded for the rows that existed, and no change sent for them")
    if unknown:
        raise error(f"stream {cfg.stream} table {table}: column(s) {', '.join(n for n, _ in unknown)} were added "
                    "with a DEFAULT whose value for the rows that existed PostgreSQL does not record where "
                    f"Tidemark reads it, and it sends no change for those rows: {remedy}")
    defaults = {name: value for name, _, _, value, _ in found}
    if defaults and not keyed:
        raise ConsolidateError(f"stream {cfg.stream} table {table}: column(s) {', '.join(defaults)} were added with a "
                               "DEFAULT; the rows that existed before hold it, but a table without a key is bucketed "
                               f"by its whole rows, which change: {remedy}")
    return defaults

