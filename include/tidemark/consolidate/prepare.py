"""Prepare: what each table needs before its changes are merged, on the driver.

`bucket_counts` reads the lake tables' bucket counts once, before decoding (the decoding cuts each
table's updates by its lake buckets); `prepare` then brings one table to where its merge
starts: a pending snapshot loaded (`load_snapshot`: the table's state at the snapshot's LSN, its own
Delta version), its shape brought to the batch's newest (`target_shape`, checked; `evolve`: ADD /
DROP COLUMN), its truncates listed, a re-snapshot of a held table turned into a truncate and rows at
its LSN for the merge (`Prepared.reload`). Nothing here reads a change's data: the executors do.
"""

from __future__ import annotations

import json
import logging
import time as _time
from dataclasses import dataclass, field
from typing import Any

from tidemark.config import StreamConfig
from tidemark.consolidate import layout, transform as T
from tidemark.consolidate.changelog import UNREAD
from tidemark.consolidate.decode import RELOAD_POSITION, snapshot_rows
from tidemark.consolidate.layout import effective_keys
from tidemark.errors import ConsolidateError, TableNeedsSnapshot
from tidemark.lake import BUCKET_COLUMN, committed_frontier, open_delta, table_info, table_uri, writer as _commit
from tidemark.lake.delta import missing_values
from tidemark.lsn import format_lsn
from tidemark.pgtypes import TableSchema, arrow_schema, lake_name_problem
from tidemark.sparkconf import default_parallelism

log = logging.getLogger(__name__)

OPEN_THREADS = 4    # Delta tables opened at once (``deltalake`` reads each log without the GIL)


@dataclass
class Prepared:
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
    history: Any = None              # (`history.HistorySpec`, its Delta table): kept by the merge job (`history.in_merge`)
    renames: dict = field(default_factory=dict)  # old name -> new name: RENAME COLUMN (`column_identity`)
    attnums: dict = field(default_factory=dict)  # column -> its attnum in the source, where known


def bucket_counts(cfg, options) -> tuple[dict, dict]:
    """({table: its number of buckets}, {table: its Delta table or None}) for the stream's tables: how
    many buckets the decoding cuts each table's updates into (its lake table's, else the stream's
    ``consolidate.buckets``, which its first version takes), and the tables as opened, for `prepare`
    to reuse."""
    opened = open_all({ref.qualified: table_uri(cfg, ref.qualified) for ref in cfg.source.tables}, options)
    return ({table: int((table_info(dt) if dt is not None else {}).get("buckets") or cfg.consolidate.buckets)
             for table, dt in opened.items()}, opened)


def open_all(uris: dict[str, str], options) -> dict:
    """{name: its Delta table or None} for ``{name: uri}``, opened a few at a time (``deltalake``
    reads each log without the GIL; on S3 each open is several requests)."""
    from concurrent.futures import ThreadPoolExecutor

    if len(uris) < 2:
        return {name: open_delta(uri, options) for name, uri in uris.items()}
    with ThreadPoolExecutor(OPEN_THREADS, thread_name_prefix="tidemark-open") as pool:
        return dict(zip(uris, pool.map(lambda uri: open_delta(uri, options), uris.values())))


def prepare(job, table: str, frontier: int, loadable) -> Prepared:
    """What the merge needs of one table, after the steps that come before its changes: its pending
    snapshot loaded (`load_snapshot`, the table's state at the snapshot's LSN) and its shape
    brought to the batch's newest one (`evolve`: ADD / DROP COLUMN). ``shape`` is None when the
    table has no change to merge (``loaded``: what the snapshot load did)."""
    uri = table_uri(job.cfg, table)
    opened = getattr(job, "lake_tables", {})   # opened before decoding (`bucket_counts`); nothing committed since
    dt = opened.pop(table) if table in opened else open_delta(uri, job.options)
    done = lake_at = committed_frontier(dt, job.cfg.stream) if dt is not None else None
    loaded = (0, None)
    snap = next((s for s in reversed(loadable) if table in s.tables), None)
    reload, reload_cts = None, 0
    if snap is not None and snap.mode == "table" and done is not None and done < snap.lsn \
            and not replaces(snap, table, dt):
        # re-snapshot of a table the lake holds: at its LSN the merge takes every row out and puts the
        # snapshot's in (a truncate, then its rows), so the changelog records only the difference
        reload = snap
        job.loaded[(table, snap.snapshot_id)] = True
    elif snap is not None:
        if done is None or done < snap.lsn:
            version = load_snapshot(job, table, snap, dt)
            job.bases[table] = (f"snapshot {snap.snapshot_id} ({snap.mode}) at {format_lsn(snap.lsn)}: its rows are not "
                                 "in this changelog")
            loaded = (snap.tables[table].get("rows", 0), version)
            dt = open_delta(uri, job.options)
            lake_at = committed_frontier(dt, job.cfg.stream)
        job.loaded[(table, snap.snapshot_id)] = True
        done = max(done or 0, snap.lsn)
    lower = max(job.start, done or 0)
    nothing = Prepared(table, uri, dt, None, None, [], lower, 0, loaded=loaded, frontier=frontier)
    if lower >= frontier:
        return nothing
    shapes = [r for r in job.shapes if r["table"] == table and r["time"] >= lower]
    truncates = [(e["time"], e["position"], json.loads(e["info"]).get("commit_ts", 0)) for e in job.events
                 if e["table"] == table and lower <= e["time"] < frontier
                 and json.loads(e["info"])["kind"] == "truncate"]
    if reload is not None:
        # its rows reach the merge at (L, RELOAD_POSITION), after a truncate at (L, RELOAD_POSITION - 1)
        # and before any change committed at L; the snapshot's shape counts as one of the batch's
        reload_cts = reload_ts()     # one commit time for its -1s and +1s: identical rows cancel
        truncates = sorted(truncates + [(reload.lsn, RELOAD_POSITION - 1, reload_cts)])
        shapes = shapes + [{"table": table, "time": reload.lsn,
                            "info": json.dumps(reload.tables[table]["table_schema"], sort_keys=True)}]
    if not shapes and not truncates:
        return nothing
    shape, ident = target_shape(job, table, shapes, dt, reload)
    if shape is None:                  # a truncate of a table the lake does not hold yet
        return nothing
    dt = evolve(job, table, shape, dt, reload=reload, ident=ident)
    info = table_info(dt) if dt is not None else {}
    keys = effective_keys(shape)
    buckets = int(info.get("buckets") or job.cfg.consolidate.buckets)
    missing = {c: v for c, v in (info.get("missing_values") or {}).items() if c in {x.name for x in shape.columns}}
    return Prepared(table, uri, dt, shape, arrow_schema(shape), keys, lower, buckets, lake_at, truncates=truncates,
                    loaded=loaded, frontier=frontier, reload=reload, reload_cts=reload_cts, missing=missing,
                    fill=fill_values(shape, missing), renames=ident.renames, attnums=ident.attnums)


def fill_values(shape: TableSchema, missing: dict[str, str]) -> dict:
    """{column: pyarrow scalar} of ``missing`` (each value's PostgreSQL text, in its lake type)."""
    return missing_values({"table_schema": shape.to_json(), "missing_values": missing})


def reload_ts() -> int:
    """The commit time (µs) the changelog gives a re-snapshot's corrections: when they are merged."""
    return int(_time.time() * 1_000_000)


def target_shape(job, table: str, shapes, dt, reload=None) -> tuple[TableSchema | None, "Identity"]:
    """The shape the table takes after this batch — the newest one seen, checked against the lake's
    and the batch's others — and how the lake's columns map onto it (`column_identity`: renamed
    columns are checked under their new names)."""
    info = table_info(dt) if dt is not None else {}
    lake = TableSchema.from_json(info["table_schema"]) if info.get("table_schema") else None
    if shapes:
        # the newest: at the greatest time, the last decoded (a DDL inside a transaction: one time, the
        # segments' shapes in the order they appeared)
        newest = max(enumerate(shapes), key=lambda ir: (ir[1]["time"], ir[0]))[1]
        shape = TableSchema.from_json(json.loads(newest["info"]))
    elif lake is not None:
        shape = lake
    else:
        return None, Identity()
    problem = lake_name_problem([c.name for c in shape.columns])
    if problem:     # e.g. ALTER TABLE ... ADD COLUMN "_bucket" after the stream was validated
        raise ConsolidateError(f"stream {job.cfg.stream} table {table}: {problem}")
    # each distinct shape once (a segment's shape is on each of its decoded parts, one per bucket)
    parsed = {i: TableSchema.from_json(json.loads(i)) for i in dict.fromkeys(r["info"] for r in shapes)}
    others = list(parsed.values())
    if reload is not None:     # its rows replace the table's at its LSN, under the attnums of its copy
        ident = reload_identity(
            lake, info.get("attnums") or {}, reload.tables[table], shape,
            [parsed[i] for i in dict.fromkeys(r["info"] for r in shapes if r["time"] < reload.lsn)],
            later=(job.cfg, table, [parsed[i] for i in dict.fromkeys(r["info"] for r in shapes
                                                                     if r["time"] >= reload.lsn)]))
    elif lake is not None:
        ident = column_identity(job.cfg, table, lake, info.get("attnums") or {}, shape, others,
                                recorded=lambda: _recorded_renames(dt, job.cfg.stream, committed_frontier(dt, job.cfg.stream)))
    else:
        ident = Identity()
    for other in others + ([lake] if lake is not None else []):
        _check_types(job.cfg.stream, table, renamed(other, ident.renames), shape)
    return shape, ident


_RESNAPSHOT = ("the table is re-snapshotted alone while the stream runs (the consolidate DAG's resend step does it "
               "by itself; by hand: tidemark snapshot {stream} --mode table --tables {table})")


@dataclass
class Identity:
    """How a lake table's columns map onto its new shape (`column_identity`)."""

    renames: dict = field(default_factory=dict)   # old name -> new name: RENAME COLUMN
    attnums: dict = field(default_factory=dict)   # column of the new shape -> its attnum, where known
    verified: bool = False     # the source's catalog told each renamed, dropped and added column apart


def renamed(shape: TableSchema, renames: dict) -> TableSchema:
    """``shape`` with the columns ``renames`` names under their new names (where it has not the new
    name already: a shape from before the rename)."""
    from dataclasses import replace

    names = {c.name for c in shape.columns}
    if not any(old in names and new not in names for old, new in renames.items()):
        return shape
    return replace(shape, columns=tuple(replace(c, name=renames[c.name]) if c.name in renames and
                                        renames[c.name] not in names else c for c in shape.columns))


def column_identity(cfg: StreamConfig, table: str, old: TableSchema, attnums: dict, new: TableSchema,
                    shapes: list[TableSchema], recorded=dict) -> Identity:
    """Which of the lake's columns (shape ``old``, their source ``attnums`` as recorded at the
    snapshot) were renamed, dropped or kept in ``new`` (the batch's newest shape; ``shapes`` all of
    the batch's). pgoutput's Relation messages carry names, not attnums, so a column that is gone
    by name while another appeared is looked up in the source's catalog by the attnum it had: a
    RENAME COLUMN keeps the attnum, a DROP COLUMN retires it and is never reused. Trusted only when
    the catalog still has exactly ``new``'s columns (no DDL since this batch's changes) and no shape
    of the batch holds both names of a rename; otherwise nothing is renamed and the table is told
    apart by a re-snapshot of its own (the caller's refusal names it). A kept name whose attnum
    changed (DROP and ADD of one name: seen when the name was missing from one of the batch's shapes
    or moved to the end) needs that re-snapshot too, and so does a name that only passed through
    the batch (neither the lake's nor the new shape's: renamed and renamed back) — unless the lake
    table's own rewrite recorded that rename (``recorded()``: a run that renamed the lake and failed
    before its batch committed; the batch's older changes still have the old name)."""
    new_names = [c.name for c in new.columns]
    old_names = [c.name for c in old.columns]
    added = [n for n in new_names if n not in old_names]
    dropped = [n for n in old_names if n not in new_names]
    kept = {n: attnums[n] for n in new_names if n in old_names and n in attnums}
    seen = [{c.name for c in s.columns} for s in shapes]
    passing = set().union(*seen) - set(old_names) - set(new_names)
    done = {a: b for a, b in (recorded() if passing else {}).items() if a in passing and b in new_names}
    passing -= set(done)
    # a column added and dropped within the batch is harmless (its values go with it): the shapes that
    # have it are, without it, the lake's, the newest or another of the batch's; one that is not may
    # hold a lake column under a name that came and went (renamed and renamed back)
    known = [old_names, new_names] + [[c.name for c in s.columns] for s in shapes if not passing & {c.name for c in s.columns}]
    passing = {n for s in shapes if passing & {c.name for c in s.columns}
               and [c.name for c in s.columns if c.name not in passing] not in known
               for n in passing & {c.name for c in s.columns}}
    if passing:
        raise TableNeedsSnapshot(
            f"stream {cfg.stream} table {table}: column(s) {', '.join(sorted(passing))} came and went within one "
            "batch in place of columns the table has (renamed and renamed back?): which rows hold which values "
            f"is not known by name; {_RESNAPSHOT.format(stream=cfg.stream, table=table)}", table=table)
    gone_a_while = [n for n in kept if any(n not in names for names in seen)]
    moved = [n for n in old_names if n in new_names] != [n for n in new_names if n in old_names]
    if not (added or gone_a_while or moved) or any(n not in attnums for n in old_names) or old.oid != new.oid:
        return Identity(done, kept)
    live = _catalog_columns(cfg, new)
    if live is None or [live[a] for a in sorted(live)] != new_names:
        return Identity(attnums=kept)
    now = {name: num for num, name in live.items()}
    replaced = [n for n in kept if now[n] != kept[n]]
    if replaced:
        raise TableNeedsSnapshot(
            f"stream {cfg.stream} table {table}: column(s) {', '.join(replaced)} were dropped and added again "
            "(the source's catalog gives them new attnums); PostgreSQL sends no change for the existing rows: "
            f"{_RESNAPSHOT.format(stream=cfg.stream, table=table)}", table=table)
    renames = {}
    for name in dropped:
        to = live.get(attnums[name])
        if to is None:                 # dropped: its attnum is retired
            continue
        if to not in added:            # e.g. two columns that swapped names in one batch
            return Identity(attnums=kept)
        renames[name] = to
    if any({a, b} <= {c.name for c in s.columns} for s in shapes for a, b in renames.items()):
        return Identity(attnums=kept)  # a shape holds both names: which rows hold which is unknown
    return Identity({**done, **renames}, {n: now[n] for n in new_names}, True)


def _recorded_renames(dt, stream: str, frontier) -> dict:
    """{old: new} of the RENAME COLUMNs the lake table's rewrites at ``frontier`` (its committed
    frontier: before this batch) recorded in their commit metadata (`evolve`). Read back from the
    newest version to the first of another frontier (or the oldest listed): any number of versions
    may follow the rewrites — `tidemark.maintain`'s compactions (at the same frontier), vacuums and
    property changes (no frontier) — so no fixed number of history entries is enough."""
    limit = 16
    while True:
        newest_first = sorted(dt.history(limit=limit), key=lambda h: h["version"], reverse=True)
        found, complete = [], len(newest_first) < limit
        for h in newest_first:
            meta = h.get("tidemark") or {}
            meta = json.loads(meta) if isinstance(meta, str) else meta
            if meta.get("stream") == stream and meta.get("frontier") is not None and meta["frontier"] != frontier:
                complete = True        # the versions of the frontier before: the rewrites at ``frontier`` are all read
                break
            if meta.get("stream") == stream and meta.get("renamed"):
                found.append(meta["renamed"])
        if complete:
            out: dict = {}
            for renamed in reversed(found):        # oldest first: a later rename of the same column wins
                out.update(renamed)
            return out
        limit *= 4


def reload_identity(lake: TableSchema | None, attnums: dict, entry: dict, new: TableSchema,
                    before: list[TableSchema], later: tuple | None = None) -> Identity:
    """`column_identity` for a re-snapshot merged at its LSN (``entry``: its manifest entry): the
    attnums its copy read under its exported snapshot say exactly which lake columns it holds under
    another name, with no catalog read (``before``: the batch's shapes before its LSN, with the lake's
    names). Its rows replace the table's; the renames let the changes before its LSN in the same
    batch, and the changelog and history, keep their values. ``later``: ``(cfg, table, shapes from
    its LSN on)`` — when the batch's newest shape ``new`` is not the copy's (a RENAME COLUMN after the
    copy, in the same batch), `column_identity` tells those renames from the copy's shape and
    attnums, composed with the lake's."""
    nums = dict(entry.get("attnums") or {})
    snap = TableSchema.from_json(entry["table_schema"])
    names = [c.name for c in snap.columns]
    renames = {}
    if lake is not None and nums and not any(c.name not in attnums for c in lake.columns):
        by_num = {num: name for name, num in nums.items()}
        lake_names = {c.name for c in lake.columns}
        renames = {c.name: by_num[attnums[c.name]] for c in lake.columns if c.name not in names
                   and by_num.get(attnums[c.name]) not in (None, *lake_names)}
        if any({a, b} <= {c.name for c in s.columns} for s in before for a, b in renames.items()):
            renames = {}
    if [c.name for c in new.columns] == names or later is None:
        return Identity(renames, nums, True)
    cfg, table, after = later
    more = column_identity(cfg, table, snap, nums, new, after)
    composed = {a: more.renames.get(b, b) for a, b in renames.items()}
    composed.update({a: b for a, b in more.renames.items() if a not in composed})
    return Identity({a: b for a, b in composed.items() if a != b}, more.attnums, more.verified)


def _catalog_columns(cfg: StreamConfig, shape: TableSchema) -> dict[int, str] | None:
    """{attnum: name} of the table's columns in the source's catalog now (as the Relation message
    lists them: no dropped or generated column), or None if relation ``shape.oid`` is not that table."""
    from tidemark.capture.source import connect_source

    conn = connect_source(cfg)
    try:
        with conn.cursor() as cur:
            cur.execute("""SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                            WHERE c.oid = %s""", (shape.oid,))
            if cur.fetchone() != (shape.schema, shape.name):
                return None
            cur.execute("""SELECT attnum, attname FROM pg_attribute
                            WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND attgenerated = ''""",
                        (shape.oid,))
            return {int(num): name for num, name in cur.fetchall()}
    finally:
        conn.close()


def evolve(job, table: str, shape: TableSchema, dt, reload=None, ident: Identity | None = None):
    """Bring the lake table to ``shape`` before its changes are merged; return the table as it is
    now (None: not created yet, the merge's commit creates it). RENAME COLUMN (``ident.renames``)
    renames the column in the table's changelog and history and rewrites the table's files under the
    new name (no copy from the source); ADD COLUMN extends its schema (the rows before hold null);
    ADD COLUMN with a non-volatile DEFAULT rewrites its files with the value PostgreSQL records for
    the rows that existed (``attmissingval``), kept in the table's description so every change image
    without the column takes it too; DROP COLUMN rewrites its files without the column. Under a
    re-snapshot of the table in the same batch (``reload``) its rows replace the lake's at its LSN,
    in the shape its copy had: only the columns added after the copy are checked, and their
    missing value (a DEFAULT's) is what the copied rows take too (`Prepared.fill`); a volatile
    DEFAULT added after the copy is refused as it is without the re-snapshot."""
    if dt is None or not table_info(dt).get("table_schema"):
        return dt
    ident = ident or Identity()
    info = table_info(dt)
    target = arrow_schema(shape)
    old = TableSchema.from_json(info["table_schema"])
    renames = {a: b for a, b in ident.renames.items() if a in {c.name for c in old.columns}}   # not renamed yet
    old_names = [renames.get(c.name, c.name) for c in old.columns]
    new_names = [c.name for c in shape.columns]
    added = [f for f in target if f.name not in old_names]
    dropped = [n for n in old_names if n not in new_names]
    defaults = {}
    if reload is not None:
        # the re-snapshot's rows replace the lake's at its LSN, in the shape of its copy: a column the
        # copy has holds its values there (nothing to fill), one added after the copy (in this batch's
        # segments) is what its copied rows lack, exactly as the lake's rows lack it
        copied = {c.name for c in TableSchema.from_json(reload.tables[table]["table_schema"]).columns}
        after = [f.name for f in added if f.name not in copied]
        if after and (dt.file_uris() or reload.tables[table].get("files")):
            defaults = _added_defaults(job.cfg, table, shape, after, [], at=_first_time(job, table, after))
    elif added and dt.file_uris():
        defaults = _added_defaults(job.cfg, table, shape, [f.name for f in added], [] if ident.verified else dropped,
                                   at=_first_time(job, table, [f.name for f in added]))
    uri = table_uri(job.cfg, table)
    buckets = int(info.get("buckets") or job.cfg.consolidate.buckets)
    if renames:
        rename_logs(job, table, renames, effective_keys(shape))
    if dropped or defaults or renames:
        before = {renames.get(c, c): v for c, v in (info.get("missing_values") or {}).items()}
        missing = {c: v for c, v in {**before, **defaults}.items() if c in new_names}
        _rewrite_columns(job, table, shape, dt, buckets, missing, renames, ident.attnums)
        if defaults:
            log.info("stream %s table %s: column(s) %s added with a DEFAULT: the existing rows take it "
                     "(pg_attribute.attmissingval), no copy", job.cfg.stream, table, ", ".join(sorted(defaults)))
        if renames:
            log.info("stream %s table %s: column(s) renamed in the lake, its changelog and history (no copy): %s",
                     job.cfg.stream, table, ", ".join(f"{a} -> {b}" for a, b in sorted(renames.items())))
        return open_delta(uri, job.options)
    if added:
        _commit.add_columns(dt, added)
        return open_delta(uri, job.options)
    return dt


def rename_logs(job, table: str, renames: dict, keys: list[str]) -> None:
    """Rename columns (old -> new) in the table's changelog and history tables, each as one Delta
    version replacing all of its files with the same rows under the new names, the rename in the
    version's commit metadata. Done before the lake table's own rewrite, which records the rename
    (its shape): a run that stops in between renames what is left next time. A table that already
    has a column of the new name (one dropped earlier) cannot take the rename: that table is
    re-snapshotted, said so, before anything is renamed."""
    from tidemark.lake import changelog_uri, history_uri

    tables = {what: open_delta(uri, job.options) for what, uri in
              (("changelog", changelog_uri(job.cfg, table)), ("history", history_uri(job.cfg, table)))}
    todo = {}
    for what, dt in tables.items():
        have = [f.name for f in dt.schema().fields] if dt is not None else []
        mine = {a: b for a, b in renames.items() if a in have}
        clash = [b for b in mine.values() if b in have]
        if clash:
            raise TableNeedsSnapshot(f"stream {job.cfg.stream} table {table}: column(s) renamed to "
                                     f"{', '.join(clash)}, but its {what} holds a column of that name already (one "
                                     f"dropped earlier); {_RESNAPSHOT.format(stream=job.cfg.stream, table=table)}",
                                     table=table)
        if mine:
            todo[what] = (dt, mine)
    for what, (dt, mine) in todo.items():
        _rename_files(job, dt, mine, keys, what)


def _rename_files(job, dt, renames: dict, keys: list[str], what: str) -> None:
    import pyarrow as pa

    partition = dt.metadata().partition_columns[0]
    acts = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    rows = [(a["path"], str(a[f"partition.{partition}"])) for a in acts]
    uri, options, tag = dt.table_uri, job.options, layout.plan_tag(0)
    out = []
    if rows:
        out = job.spark.createDataFrame(rows, "path string, partition string").repartition(
            max(1, min(len(rows), default_parallelism(job.spark)))).mapInArrow(
            lambda it: layout.rename_files(uri, options, renames, keys, tag, it), layout.ACTIONS_DDL
        ).toArrow().to_pylist()
    schema = pa.schema([pa.field(renames.get(f.name, f.name), f.type, f.nullable, f.metadata)
                        for f in pa.schema(dt.schema().to_arrow()) if f.name != partition])
    _commit.commit_files(uri, options, dt, schema, out, stream=job.cfg.stream,
                         frontier=committed_frontier(dt, job.cfg.stream) or 0, desc=dt.metadata().description,
                         partition=partition, overwrite=True, operation="rename_columns", meta={"renamed": renames})
    log.info("stream %s: %s %s: column(s) renamed, %d files rewritten", job.cfg.stream, what, uri, len(out))


def _files_df(job, files: dict[int, list[dict]]):
    rows = [(f["path"], int(f["size"]), int(f["rows"] or 0), b) for b, fs in files.items() for f in fs]
    return job.spark.createDataFrame(rows, layout.FILES_DDL).repartition(
        max(1, min(len(rows), default_parallelism(job.spark))))


def _rewrite_columns(job, table: str, shape: TableSchema, dt, buckets: int, missing: dict[str, str],
                     renames: dict | None = None, attnums: dict | None = None) -> None:
    """Rewrite every file of the table with exactly ``shape``'s columns (one version): DROP COLUMN
    leaves a column out; a column ``missing`` names (ADD COLUMN ... DEFAULT) holds its value; a
    column ``renames`` names (old -> new) takes its new name. A keyed table's rows stay in their
    buckets (file by file); a table without a key is bucketed by a hash of every column, so its rows
    are bucketed again (the snapshot load's way: every row read, hashed and written per bucket)."""
    target = arrow_schema(shape)
    keys = effective_keys(shape)
    sort = layout.sort_columns(target, keys)
    uri = table_uri(job.cfg, table)
    done = committed_frontier(dt, job.cfg.stream) or 0
    bplan = layout.BucketPlan(table=table, uri=uri, options=job.options, schema=target, keys=keys, sort=sort,
                              files=layout.file_index(dt, sort), target_rows=job.target_rows,
                              tag=layout.plan_tag(done), fill=fill_values(shape, missing), renames=dict(renames or {}))
    acts = []
    if bplan.files and keys:
        acts = _files_df(job, bplan.files).mapInArrow(lambda it: layout.project_files(bplan, it),
                                                     layout.ACTIONS_DDL).toArrow().to_pylist()
    elif bplan.files:
        from pyspark.sql.pandas.types import from_arrow_schema

        rows = _files_df(job, bplan.files).mapInArrow(lambda it: layout.projected_rows(bplan, it),
                                                      from_arrow_schema(target, prefer_timestamp_ntz=True))
        rows, names = T.plain_names(T.with_bucket(rows, [c.name for c in shape.columns], buckets))
        acts = rows.groupBy(BUCKET_COLUMN).applyInArrow(
            lambda t: layout.load_bucket(bplan, next(T.named([t], names))), layout.ACTIONS_DDL).toArrow().to_pylist()
    desc = _commit.description(uri, job.options, job.cfg.stream, table, buckets, shape.to_json(), missing, attnums)
    _commit.commit_files(uri, job.options, dt, target, [a for a in acts if a["op"] == "add"],
                         stream=job.cfg.stream, frontier=done, desc=desc, overwrite=True,
                         operation="rewrite_columns", meta={"renamed": renames} if renames else None)


def load_snapshot(job, table: str, snap, dt) -> int:
    """Write the snapshot's rows as the table's new version (bucketed, sorted), app txn (stream, lsn)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from tidemark.landing.store import landing_store

    entry = snap.tables[table]
    shape = TableSchema.from_json(entry["table_schema"])
    target = arrow_schema(shape)
    keys = effective_keys(shape)
    info = table_info(dt) if dt is not None else {}
    buckets = int(info.get("buckets") or job.cfg.consolidate.buckets)
    uri = table_uri(job.cfg, table)
    store = landing_store(job.cfg)
    uris = [store.uri(k) for k in entry.get("files", [])]
    endpoint = job.cfg.landing.endpoint_url
    sort = layout.sort_columns(target, keys)
    bplan = layout.BucketPlan(table=table, uri=uri, options=job.options, schema=target, keys=keys, sort=sort,
                              target_rows=job.target_rows, tag=layout.plan_tag(snap.lsn))
    acts: list[dict] = []
    spark_schema = from_arrow_schema(target, prefer_timestamp_ntz=True)
    parts = []
    if uris:
        src = job.spark.createDataFrame([(u,) for u in uris], "uri string").repartition(
            min(len(uris), max(1, default_parallelism(job.spark))))
        parts.append(src.mapInArrow(lambda it: snapshot_rows(it, target, endpoint), spark_schema))
    ranged = entry.get("ranges") or {}
    expected = entry.get("rows")
    if "copied" in ranged:
        # a resend by key ranges: the lake's rows of every range that was not copied are kept
        parts += _kept_rows(job, table, snap, dt, shape, keys, ranged, spark_schema)
        expected = ranged["source_rows"]
    if parts:
        rows = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])
        rows, names = T.plain_names(T.with_bucket(rows, keys or [c.name for c in shape.columns], buckets))
        acts = rows.groupBy(BUCKET_COLUMN).applyInArrow(
            lambda t: layout.load_bucket(bplan, next(T.named([t], names))),
            layout.ACTIONS_DDL).toArrow().to_pylist()
    total = sum(a["rows"] for a in acts if a["op"] == "add")
    if total != (total if expected is None else expected):
        what = ("the source held" if "copied" in ranged else "the manifest says")
        raise ConsolidateError(f"stream {job.cfg.stream} snapshot {snap.snapshot_id} table {table}: "
                               f"{total} rows loaded, {what} {expected}")
    if "copied" in ranged:
        log.info("stream %s table %s: resend by key ranges: %d of %d ranges re-copied (%d rows), %d rows kept from "
                 "the lake", job.cfg.stream, table, ranged["ranges_differing"], ranged["ranges"],
                 entry.get("rows", 0), total - entry.get("rows", 0))
    desc = _commit.description(uri, job.options, job.cfg.stream, table, buckets, shape.to_json(),
                               attnums=entry.get("attnums"))
    return _commit.commit_files(uri, job.options, dt, target, acts, stream=job.cfg.stream, frontier=snap.lsn,
                                desc=desc, overwrite=dt is not None, operation="snapshot")


def _kept_rows(job, table: str, snap, dt, shape: TableSchema, keys: list[str], ranged: dict, spark_schema) -> list:
    """The lake's rows outside the key ranges a resend copied (`tidemark.capture.ranges`), as a Spark
    DataFrame in a list (empty: the lake holds no file). The lake must be the Delta version the
    snapshot compared: its other ranges were found equal to the source there."""
    from tidemark.capture import ranges as _ranges

    version = None if dt is None else int(dt.version())
    if version != ranged["lake_version"]:
        raise ConsolidateError(f"stream {job.cfg.stream} snapshot {snap.snapshot_id} table {table}: the resend copied "
                               f"only the key ranges that differed from lake version {ranged['lake_version']}, but "
                               f"the lake table is at version {version} now; take the resend again (tidemark snapshot "
                               f"{job.cfg.stream} --mode resend)")
    files = layout.file_index(dt, [])
    if not files:
        return []
    info = table_info(dt)
    target = arrow_schema(shape)
    plan = layout.BucketPlan(table=table, uri=table_uri(job.cfg, table), options=job.options, schema=target,
                             keys=keys, sort=[], fill=missing_values(info))
    shape_json, bits, copied = shape.to_json(), int(ranged["bits"]), ranged["copied"]
    return [_files_df(job, files).mapInArrow(
        lambda it: _ranges.kept_rows(plan, shape_json, keys, bits, copied, it), spark_schema)]


def _first_time(job, table: str, columns: list[str]) -> int | None:
    """The time of the batch's first decoded part of ``table`` whose shape has one of ``columns``
    (where the batch first holds a change after their ADD COLUMN), or None."""
    times = [r["time"] for r in job.shapes if r["table"] == table and r["time"] is not None
             and set(columns) & {c["name"] for c in json.loads(r["info"])["columns"]}]
    return min(times) if times else None


def _added_defaults(cfg: StreamConfig, table: str, shape: TableSchema, added: list[str],
                    dropped: list[str], at: int | None = None) -> dict[str, str]:
    """{column: text} of the value that the lake's existing rows take for columns added with a
    non-volatile DEFAULT (PostgreSQL's ``attmissingval``: what every row stored before the ADD holds).
    Refuse what PostgreSQL sends no change for and does not record: a volatile DEFAULT (the rows were
    rewritten with values of their own), RENAME COLUMN, and a DEFAULT on a table without a key (its
    rows' identity is the whole row). The error names the per-table remedy; a volatile DEFAULT's
    says what and where only (column, expression, ``at``: the batch's first change with it), the
    remedy is the consolidation failure's own (`job._Where.failed`: printed once)."""
    from tidemark.capture.source import connect_source

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
    conn = connect_source(cfg)
    try:
        with conn.cursor() as cur:
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
    finally:
        conn.close()
    unknown = [(name, expr) for name, has_missing, is_array, _, expr in found if not has_missing or is_array]
    if unknown and keyed:
        # one line of what and where (the remedy is the failure's, `job._Where.failed`); no value is
        # recorded for the existing rows: a volatile DEFAULT rewrote them, a DEFAULT set after the ADD
        # is not theirs, an array's is not read
        name, expr = unknown[0]
        where = f" at {format_lsn(at)}" if at is not None else ""
        more = f" (and {', '.join(n for n, _ in unknown[1:])})" if unknown[1:] else ""
        raise error(f"stream {cfg.stream} table {table}: column {name}{more} added with DEFAULT {_short(expr)}"
                    f"{where}: no value recorded for the rows that existed, and no change sent for them")
    if unknown:
        raise error(f"stream {cfg.stream} table {table}: column(s) {', '.join(n for n, _ in unknown)} were added "
                    "with a DEFAULT whose value for the rows that existed PostgreSQL does not record where "
                    f"Tidemark reads it, and it sends no change for those rows: {remedy}")
    defaults = {name: value for name, _, _, value, _ in found}
    if defaults and not effective_keys(shape):
        raise ConsolidateError(f"stream {cfg.stream} table {table}: column(s) {', '.join(defaults)} were added with a "
                               "DEFAULT; the rows that existed before hold it, but a table without a key is bucketed "
                               f"by its whole rows, which change: {remedy}")
    return defaults


def _short(text: str | None, limit: int = 60) -> str:
    """A DEFAULT's expression for a one-line message (cut at ``limit`` characters)."""
    text = " ".join((text or "?").split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def shape_change(a: TableSchema, b: TableSchema) -> str | None:
    """What keeps rows of shape ``a`` from being merged with rows of shape ``b``: a column whose lake
    type changed (ALTER COLUMN TYPE) or a changed row identity (a primary-key or replica-identity
    change); None when they merge (ADD / DROP COLUMN are `evolve`'s)."""
    from tidemark.pgtypes import arrow_type

    bt = {c.name: c for c in b.columns}
    for c in a.columns:
        if c.name in bt and arrow_type(c) != arrow_type(bt[c.name]):
            return f"column {c.name} changed type from {c.type_name} to {bt[c.name].type_name}"
    if effective_keys(a) != effective_keys(b):
        return f"the row identity changed from {effective_keys(a) or 'whole rows'} to {effective_keys(b) or 'whole rows'}"
    return None


def _check_types(stream: str, table: str, a: TableSchema, b: TableSchema) -> None:
    """Rows of shapes ``a`` and ``b`` must merge (`shape_change`); if not, that table needs a copy of
    its own: a re-snapshot that replaces it (`replaces`), while the stream runs."""
    why = shape_change(a, b)
    if why:
        raise TableNeedsSnapshot(f"stream {stream} table {table}: {why}; the lake table is replaced by a re-snapshot "
                                 "of that table alone while the stream runs (the consolidate DAG's resend step does "
                                 f"it by itself; by hand: tidemark snapshot {stream} --mode table --tables {table})",
                                 table=table)


def replaces(snap, table: str, dt) -> bool:
    """Whether the re-snapshot ``snap`` (mode ``table``) replaces the lake table — loaded at its LSN
    like a first snapshot, the table's changes below it left out, its changelog restarting there
    when a column's type changed — instead of being merged as correction deltas: the lake's rows and
    the snapshot's do not merge (`shape_change`). Until the stream's frontier reaches the snapshot's
    LSN the table waits (`job._waiting`)."""
    info = table_info(dt) if dt is not None else {}
    if not info.get("table_schema"):
        return False
    lake, new = TableSchema.from_json(info["table_schema"]), TableSchema.from_json(snap.tables[table]["table_schema"])
    renames = reload_identity(lake, info.get("attnums") or {}, snap.tables[table], new, []).renames
    return shape_change(renamed(lake, renames), new) is not None