"""The snapshot bases of the changelog feed: a snapshot load (a first snapshot, a resend) as changelog
rows at its LSN — the loaded version's rows as ``+1`` and the rows of the version it replaced as ``-1``,
read one bucket at a time (`base_buckets`, from one Delta version of the lake table: `version_buckets`)
— and whether a table has a base the feed has not taken yet (`table_base`, from its snapshot loads:
`snapshot_versions`, which a subscriber's catch-up reads too). The Delta changelog does not hold a
base; the CDC feed does (`changelog`).
"""

from __future__ import annotations

import re

import pyarrow as pa

from tidemark.consolidate.log_evolution import UNREAD
from tidemark.consolidate.preconsolidate import cancel_zero
from tidemark.lake import committed_frontier, data_files, exact_schema, filesystem, open_delta, table_info, table_uri
from tidemark.lake.delta import conform, renames_since, tidemark_commits


def base_changes(uri: str, options, version: int, lsn: int, target, before: int | None = None):
    """`base_buckets` all at once (a reader's call: `tidemark.subscribers`), pre-consolidated: a row in
    both versions cancels and identical rows are one update with their count."""
    parts = [cancel_zero(rows) for rows in base_buckets(uri, options, version, lsn, target, before)]
    parts = [p for p in parts if p.num_rows]
    return pa.concat_tables(parts) if parts else stamped(target.empty_table(), lsn, 1)


def base_buckets(uri: str, options, version: int, lsn: int, target, before: int | None = None):
    """A snapshot load (Delta ``version`` at ``lsn``) as changelog rows at ``lsn``, one bucket at a
    time (the memory of one bucket of each version, never the table's): +1 of its rows and -1 of the
    rows of the version it replaced (none for the first); ``before``: the version to take out instead
    (the feed's state when an earlier base never reached it). Not consolidated (the feed's writer
    does it per bucket: identical rows share a bucket; a row whose bucket moved is a -1 and a +1 of
    it, which sum to nothing)."""
    sides = []
    for v, diff in ((version, 1), (version - 1 if before is None else before, -1)):
        if v >= 0:
            sides.append((diff, *version_buckets(uri, options, v, target)))
    for b in sorted({b for _, _, buckets in sides for b in buckets}):
        parts = [stamped(read(buckets[b]), lsn, diff) for diff, read, buckets in sides if b in buckets]
        yield parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def stamped(rows, lsn: int, diff: int):
    """``rows`` with the changelog's ``_time`` (``lsn``), ``_diff`` and a null ``_commit_ts``."""
    n = rows.num_rows
    return (rows.append_column("_time", pa.array([lsn] * n, pa.int64()))
            .append_column("_diff", pa.array([diff] * n, pa.int64()))
            .append_column("_commit_ts", pa.nulls(n, pa.timestamp("us", tz="UTC"))))


def may_have_new_base(cfg, table: str, done: int | None, options, at=UNREAD) -> bool:
    """Cheap gate before reading a table's history: a changelog not started yet, or a lake table
    whose own frontier (``at``, read here if not given) is past the changelog's (a snapshot loaded
    since: only a load moves it so)."""
    if done is None:
        return True
    if at is UNREAD:
        at = committed_frontier(open_delta(table_uri(cfg, table), options), cfg.stream)
    return at is not None and at > done


def has_new_base(cfg, table: str, done: int | None, options, lake_at=UNREAD) -> bool:
    """Whether the lake table's newest commit is a snapshot load the changelog (at ``done``) has not
    taken yet: a base, also when the run that loaded it failed before its changelog commit."""
    if not may_have_new_base(cfg, table, done, options, lake_at):
        return False
    load = _newest_load(cfg, table, options)
    return load is not None and (done is None or done <= load[2])


def table_base(cfg, table: str, target, options=None, pending: list[int] = (), restart: bool = False):
    """(S, its rows one bucket at a time: `base_buckets`) of the table's newest snapshot load while
    the lake table holds nothing after it (`_newest_load`), else None. ``pending``: LSNs of earlier
    bases marked pending (`feed_files.base_marker`: in no feed file yet); the rows are then the
    difference from the lake before the oldest of them, what the feed holds. ``restart``: the
    changelog restarts at this base (a column's type changed), so the rows are the snapshot's alone."""
    load = _newest_load(cfg, table, options)
    if load is None:
        return None
    snaps, version, lsn = load
    before = -1 if restart else next((v - 1 for v, at in snaps if pending and at == min(pending)), None)
    return lsn, base_buckets(table_uri(cfg, table), options, version, lsn, target, before=before)


def _newest_load(cfg, table: str, options):
    """(its snapshot loads, the version and LSN of the newest) while the lake table holds nothing
    after that load (its application transaction is still the snapshot's LSN), else None."""
    dt = open_delta(table_uri(cfg, table), options)
    snaps = snapshot_versions(dt, cfg.stream) if dt is not None else []
    if not snaps or committed_frontier(dt, cfg.stream) != snaps[-1][1]:
        return None
    return snaps, *snaps[-1]


def feed_base(cfg, table: str, target, options, *, done: int | None, lo: int, frontier: int, waiting: list[int],
              restart: bool, may: bool):
    """Where the range ``[lo, frontier)``'s feed file puts the table's snapshot base, if it has one the
    feed has not taken (`table_base`; ``may``: `may_have_new_base` or a base marked pending, else none
    is looked for): (``since``: the progress to declare first, or None; the file's lower bound; the
    base's rows (`base_buckets`) or None; the lower bound of its key; the LSN of a base to mark
    pending, or None). A base's updates are at its LSN S: a range ending at S (a consolidation right
    after the snapshot, before any drain) cannot hold them; it declares [0, S) (or [done, S)) and
    marks the base pending, so that the first range past S carries it, whatever ran between."""
    since, feed_lo, head, key_lo, wait = None, lo, None, lo, None
    based = (table_base(cfg, table, target, options, pending=[w for w in waiting if w < frontier], restart=restart)
             if may else None)
    if based is not None and (done is None or done <= based[0]):
        if based[0] >= frontier:
            since = 0 if done is None else done
            key_lo, wait = min(since, lo), based[0]
        elif based[0] <= lo:
            feed_lo, since, head = based[0], (0 if done is None else done), based[1]
    return since, feed_lo, head, key_lo, wait


def version_buckets(uri: str, options, version: int, schema):
    """(a reader, {bucket: the version's data files}) of one Delta version of a lake table: the reader
    gives a list of its files' rows in ``schema`` (missing columns null; columns renamed since under
    their names now). Every file of a lake table lies in its bucket's ``_bucket=N`` directory."""
    import pyarrow.dataset as ds
    from deltalake import DeltaTable, Schema

    dt = DeltaTable(uri, version=version, storage_options=options)
    own = exact_schema(dt)
    # a load that changed a column's type records the table's new shape (its description) in a commit
    # right after its files: where the version's own Delta type differs, that type is the files'
    delta = {f.name: f.type for f in dt.schema().fields}
    logical = pa.schema(dt.schema().to_arrow())
    own = pa.schema([f if f.name not in delta or Schema.from_arrow(pa.schema([f])).fields[0].type == delta[f.name]
                     else pa.field(f.name, logical.field(f.name).type) for f in own])
    renames = renames_since(table_info(dt), table_info(open_delta(uri, options)))   # RENAME COLUMN since
    fs = filesystem(uri, options)

    def read(files: list[str]):
        rows = (ds.dataset(files, format="parquet", schema=own, filesystem=fs).to_table(columns=own.names)
                if files else own.empty_table())
        if renames:
            rows = rows.rename_columns([renames.get(n, n) for n in rows.column_names])
        return conform(rows, schema)

    buckets: dict[int, list[str]] = {}
    for f in data_files(dt, uri):
        m = re.search(r"(?:^|/)_bucket=(-?\d+)/", f)
        buckets.setdefault(int(m.group(1)) if m else -1, []).append(f)
    return read, buckets


def snapshot_versions(dt, stream: str) -> list[tuple[int, int]]:
    """(Delta version, snapshot LSN) of every snapshot load in a lake table's history, oldest first."""
    return [(v, int(m["frontier"])) for v, m in tidemark_commits(dt, stream) if m.get("operation") == "snapshot"]
