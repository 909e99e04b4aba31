"""A table's columns across a batch: the shape it takes (`target_shape`), how the lake's columns map
onto it (`column_identity`, `reload_identity`: RENAME COLUMN told from DROP and ADD by attnum), and
whether two shapes' rows merge at all (`shape_change`, `replaces`). Driver-side and Spark-free.
"""

from __future__ import annotations

import json
from contextlib import closing
from dataclasses import dataclass, field, replace

from tidemark.capture.source import connect_source
from tidemark.config import StreamConfig
from tidemark.consolidate.log_evolution import log_type_change
from tidemark.errors import ConsolidateError, TableNeedsSnapshot
from tidemark.lake import changelog_uri, committed_frontier, open_delta, storage_options, table_info
from tidemark.lake.delta import tidemark_meta
from tidemark.lake.layout import effective_keys
from tidemark.pgtypes import Column, TableSchema, arrow_schema, arrow_type, column_attnums, lake_name_problem

def target_shape(cfg: StreamConfig, table: str, shapes, dt, reload=None) -> tuple[TableSchema | None, "Identity"]:
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
        raise ConsolidateError(f"stream {cfg.stream} table {table}: {problem}")
    # each distinct shape once (a segment's shape is on each of its decoded parts, one per bucket)
    parsed = {i: TableSchema.from_json(json.loads(i)) for i in dict.fromkeys(r["info"] for r in shapes)}
    others = list(parsed.values())
    if reload is not None:     # its rows replace the table's at its LSN, under the attnums of its copy
        ident = reload_identity(
            lake, info.get("attnums") or {}, reload.tables[table], shape,
            [parsed[i] for i in dict.fromkeys(r["info"] for r in shapes if r["time"] < reload.lsn)],
            later=(cfg, table, [parsed[i] for i in dict.fromkeys(r["info"] for r in shapes
                                                                     if r["time"] >= reload.lsn)]))
    elif lake is not None:
        ident = column_identity(cfg, table, lake, info.get("attnums") or {}, shape, others,
                                recorded=lambda: recorded_renames(dt, cfg.stream, committed_frontier(dt, cfg.stream)))
    else:
        ident = Identity()
    for other in others + ([lake] if lake is not None else []):
        why = shape_change(renamed(other, ident.renames), shape)
        if why:
            raise TableNeedsSnapshot(f"stream {cfg.stream} table {table}: {why}; the lake table is replaced by a "
                                     "re-snapshot of that table alone while the stream runs (the consolidate DAG's "
                                     "resend step does it by itself; by hand: tidemark snapshot "
                                     f"{cfg.stream} --mode table --tables {table})", table=table)
    return shape, ident


RESNAPSHOT = ("the table is re-snapshotted alone while the stream runs (the consolidate DAG's resend step does it "
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
    names = {c.name for c in shape.columns}
    if not any(old in names and new not in names for old, new in renames.items()):
        return shape
    return replace(shape, columns=tuple(replace(c, name=renames[c.name]) if c.name in renames and
                                        renames[c.name] not in names else c for c in shape.columns))


def column_identity(cfg: StreamConfig, table: str, old: TableSchema, attnums: dict, new: TableSchema,
                    shapes: list[TableSchema], recorded=dict) -> Identity:
    """Which of the lake's columns (shape ``old``, their source ``attnums``) were renamed, dropped or
    kept in ``new`` (the batch's newest shape; ``shapes`` all of the batch's). pgoutput carries names,
    not attnums, so a column gone by name while another appeared is looked up in the source's catalog
    by its attnum (RENAME keeps it, DROP retires it), trusted only when the catalog has exactly
    ``new``'s columns and no shape holds both names of a rename; otherwise nothing is renamed (the
    caller refuses and names a re-snapshot). Raises `TableNeedsSnapshot` for a kept name whose attnum
    changed (DROP and ADD) and a name that only passed through the batch (renamed and renamed back),
    unless the lake's own rewrite recorded that rename (``recorded()``: a run that failed after it)."""
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
            f"is not known by name; {RESNAPSHOT.format(stream=cfg.stream, table=table)}", table=table)
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
        # a column renamed and a new one given its name has its old attnum under the new name
        away = {n: live[kept[n]] for n in replaced if kept[n] in live}
        again = [n for n in replaced if n not in away]
        what = [f"column(s) {', '.join(again)} were dropped and added again"] if again else []
        what += [f"column {n} was renamed {to} and a new column {n} added" for n, to in away.items()]
        raise TableNeedsSnapshot(
            f"stream {cfg.stream} table {table}: {'; '.join(what)} (the source's catalog gives "
            f"{', '.join(replaced)} new attnums); PostgreSQL sends no change for the existing rows: "
            f"{RESNAPSHOT.format(stream=cfg.stream, table=table)}", table=table)
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


def recorded_renames(dt, stream: str, frontier) -> dict:
    """{old: new} of the RENAME COLUMNs the lake table's rewrites at ``frontier`` (its committed
    frontier) recorded in their commit metadata (`evolve`), read back from the newest version to the
    first of another frontier (any number of versions, e.g. compactions, may follow them)."""
    limit = 16
    while True:
        newest_first = sorted(dt.history(limit=limit), key=lambda h: h["version"], reverse=True)
        found, complete = [], len(newest_first) < limit
        for h in newest_first:
            meta = tidemark_meta(h, stream) or {}
            if meta.get("frontier") is not None and meta["frontier"] != frontier:
                complete = True        # the versions of the frontier before: the rewrites at ``frontier`` are all read
                break
            if meta.get("renamed"):
                found.append(meta["renamed"])
        if complete:
            out: dict = {}
            for renamed in reversed(found):        # oldest first: a later rename of the same column wins
                out.update(renamed)
            return out
        limit *= 4


def reload_identity(lake: TableSchema | None, attnums: dict, entry: dict, new: TableSchema,
                    before: list[TableSchema], later: tuple | None = None) -> Identity:
    """`column_identity` for a re-snapshot merged at its LSN (``entry``: its manifest entry), from the
    attnums its copy read, with no catalog read (``before``: the batch's shapes before its LSN).
    ``later``: ``(cfg, table, shapes from its LSN on)``: when ``new`` is not the copy's shape (a RENAME
    after the copy), `column_identity` from the copy's shape, composed with the lake's renames."""
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
    with closing(connect_source(cfg)) as conn:
        with conn.cursor() as cur:
            cur.execute("""SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                            WHERE c.oid = %s""", (shape.oid,))
            if cur.fetchone() != (shape.schema, shape.name):
                return None
        return {num: name for name, num in column_attnums(conn, shape.oid).items()}


def shape_change(a: TableSchema, b: TableSchema) -> str | None:
    """What keeps rows of shape ``a`` from being merged with rows of shape ``b``: a column whose lake
    type changed (ALTER COLUMN TYPE) or a changed row identity (a primary-key or replica-identity
    change); None when they merge (ADD / DROP COLUMN are `evolve`'s)."""
    bt = {c.name: c for c in b.columns}
    for c in a.columns:
        if c.name in bt and arrow_type(c) != arrow_type(bt[c.name]):
            return f"column {c.name} changed type from {c.type_name} to {bt[c.name].type_name}"
        if c.name in bt and _values_rewritten(c, bt[c.name]):
            # one lake type, but ALTER COLUMN TYPE rewrote the rows (json to jsonb, varchar to char(n),
            # timestamptz to timestamptz(0)) and PostgreSQL sends no change for them
            new = bt[c.name]
            mods = f" (type modifier {c.typmod} to {new.typmod})" if c.type_name == new.type_name else ""
            return (f"column {c.name} changed type from {c.type_name} to {new.type_name}{mods}, which rewrote "
                    "its values in the source without sending a change for them")
    if effective_keys(a) != effective_keys(b):
        return f"the row identity changed from {effective_keys(a) or 'whole rows'} to {effective_keys(b) or 'whole rows'}"
    return None


# text and varchar (of any length): ALTER COLUMN TYPE between them keeps every value as it was (a value
# too long for a shorter varchar is refused, not cut)
_SAME_TEXT_TYPES = {25, 1043}


def _values_rewritten(a: Column, b: Column) -> bool:
    """Whether ALTER COLUMN TYPE from column ``a`` to ``b`` (one lake type) may have changed the values
    (another type, or another modifier: a precision, a length that pads): anything but the same type
    and modifier, or a change between text and varchar. Shapes without a type OID (an external feed's,
    and the tests' own) are never taken for rewritten."""
    if not a.type_oid or not b.type_oid or (a.type_oid, a.typmod) == (b.type_oid, b.typmod):
        return False
    return not (a.type_oid in _SAME_TEXT_TYPES and b.type_oid in _SAME_TEXT_TYPES)


def replaces(snap, table: str, dt, cfg: StreamConfig | None = None) -> bool:
    """Whether the re-snapshot ``snap`` (mode ``table``) replaces the lake table, loaded at its LSN like
    a first snapshot, instead of being merged as corrections: the lake's rows and the snapshot's do
    not merge (`shape_change`), or (given ``cfg``) its changelog cannot hold the snapshot's columns
    (`changelog_conflict`: it restarts at such a load)."""
    info = table_info(dt) if dt is not None else {}
    if not info.get("table_schema"):
        return False
    lake, new = TableSchema.from_json(info["table_schema"]), TableSchema.from_json(snap.tables[table]["table_schema"])
    renames = reload_identity(lake, info.get("attnums") or {}, snap.tables[table], new, []).renames
    if shape_change(renamed(lake, renames), new) is not None:
        return True
    return cfg is not None and changelog_conflict(cfg, table, new, dt) is not None


def changelog_conflict(cfg: StreamConfig, table: str, shape: TableSchema, dt) -> str | None:
    """What keeps the table's changelog from taking rows of ``shape``: a column the lake table (``dt``)
    lacks — dropped, the changelog keeps it — back under its name with another lake type
    (`log_type_change`); None when there is none (the changelog is read only for such a column)."""
    info = table_info(dt) if dt is not None else {}
    have = {c["name"] for c in (info.get("table_schema") or {}).get("columns", [])}
    if not any(c.name not in have for c in shape.columns):
        return None
    return log_type_change(open_delta(changelog_uri(cfg, table), storage_options(cfg)), arrow_schema(shape))
