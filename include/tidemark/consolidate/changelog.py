"""The consolidated changelog: every committed change at its own time, with full row images.

What it contains, per table (the same rows in two forms):

* **updates** ``(data, time, diff)``: ``time`` is the source commit LSN, ``data`` the FULL row
  (all columns, lake types). A ``-1`` whose segment record is key-only (``image="key"``: deletes
  and updates of a keyed table) or whose columns are unchanged TOAST takes the missing values from
  the row's previous image — the newest image earlier at a smaller ``(time, position)``, followed
  across key changes, else the lake row before the batch. TRUNCATE at ``t`` is a ``-1`` at ``t`` of
  every row present just before it. Pre-consolidated per ``(data, time)``: diffs of identical rows
  at one time are summed and zero sums dropped (an update that changes nothing, a delete and
  re-insert of the same row in one transaction), so there is at most one diff per ``(data, time)``.
  Tables without a key (REPLICA IDENTITY FULL) carry whole rows already; their multiset diffs add up.
* **where it starts**: a table's changelog starts at the lake version of its snapshot load; the
  snapshot's rows are NOT in it (a consumer starts from that version, or from the snapshot files).
  A resend snapshot is such a start too. The Delta commit metadata (``tidemark.base_snapshot_lsn``)
  and the Avro header (``tidemark.base``) say so.

Forms:

1. a **Delta table** ``{lake}/{stream}/changelog/{table}`` with the table's columns plus ``_time``,
   ``_diff``, ``_commit_ts`` and the partition ``_commit_date`` (UTC date of ``_commit_ts``). Each
   consolidation commits the rows of times in ``[lo, F)`` with the application transaction
   ``(stream, F)``, where ``lo`` is the changelog's own committed frontier, so a re-run after a
   crash between the changelog commit and the table commit never adds a time twice;
2. a **Materialize CDC file** per table and committed range in the landing store at
   ``{stream}/changelog/{table}/{lo:016X}_{F:016X}.avro``: together, one standard feed per table in
   the seed's format (readable with its reader schema): arrays of ``{data, time, diff}`` then the
   progress record ``{lower: [lo], upper: [F], counts}`` where ``counts`` per time is the number of
   distinct ``(data, time, diff)`` updates (identical rows pre-consolidated into one update with
   ``diff = n``). The table's first file starts with the progress ``{lower: [0], upper: [S]}`` and
   holds its snapshot's rows as updates at ``S`` (a resend: the difference between the lake before
   and after the new snapshot, at its LSN); a batch ending at ``S`` itself writes only the progress
   ``[0, S)`` and marks the base pending (``_pending/S.base``) for the first range past ``S``
   (`base_buckets`: read and written one bucket at a time); every batch writes a file for every
   table, idle ones included (`advance_feeds`). Field names are the source's columns (`feed_field_names` for those
   Avro cannot hold; each field's ``doc`` is the real name). Values are in their lake form: dates as
   ``int`` ``date``, timestamps as ``long`` ``timestamp-micros``/``local-timestamp-micros``,
   numerics as ``bytes`` ``decimal``.

`write_changelog(cfg, start=, end=)` rebuilds the Delta rows of the commits in ``[start, end)``
(commit time) from the retained segments (see its docstring).
"""

from __future__ import annotations

import contextlib
import io
import uuid
from dataclasses import dataclass, field
from typing import Any

from tidemark.errors import ChangelogError
from tidemark.pgtypes import avro_name
from tidemark.landing.segments import PROGRESS_SCHEMA


def _avro_type(t) -> Any:
    import pyarrow as pa

    if pa.types.is_boolean(t):
        base: Any = "boolean"
    elif pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_int32(t):
        base = "int"
    elif pa.types.is_integer(t):
        base = "long"
    elif pa.types.is_float32(t):
        base = "float"
    elif pa.types.is_floating(t):
        base = "double"
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        base = "string"
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        base = "bytes"
    elif pa.types.is_decimal(t):
        base = {"type": "bytes", "logicalType": "decimal", "precision": t.precision, "scale": t.scale}
    elif pa.types.is_date32(t):
        base = {"type": "int", "logicalType": "date"}
    elif pa.types.is_timestamp(t):
        base = {"type": "long", "logicalType": "timestamp-micros" if t.tz else "local-timestamp-micros"}
    elif pa.types.is_list(t):
        base = {"type": "array", "items": _avro_type(t.value_type)}
    else:
        base = "string"
    return ["null", base]


_AVRO_FIELD = __import__("re").compile(r"[A-Za-z_][A-Za-z0-9_]*")


def feed_field_names(names: list[str]) -> list[str]:
    """The Avro field name of each column in the feed: the column's own name when Avro can hold it
    (``[A-Za-z_][A-Za-z0-9_]*``); otherwise every other character replaced by ``_`` and a leading
    ``_`` before a digit (`avro_name`); a name that then collides with an earlier one gets ``_<i>``
    appended (``i`` = the column's position, from 0) until unique. Each field's ``doc`` is the
    column's real name."""
    out: list[str] = []
    taken = {n for n in names if _AVRO_FIELD.fullmatch(n)}
    for i, n in enumerate(names):
        if _AVRO_FIELD.fullmatch(n) and n not in out:
            out.append(n)
            continue
        cand = avro_name(n)
        while cand in out or (cand != n and cand in taken):
            cand = f"{cand}_{i}"
        out.append(cand)
    return out


def cdc_schema(table: str, schema) -> list:
    """The Avro writer schema of one table's changelog file (updates array + progress)."""
    names = feed_field_names(list(schema.names))
    fields = [{"name": n, "type": _avro_type(f.type), "doc": f.name} for n, f in zip(names, schema)]
    data = {"type": "record", "name": "data", "namespace": "com.materialize.cdc", "fields": fields,
            "doc": "columns: " + ", ".join(f.name for f in schema)}
    update = {"type": "record", "name": "update", "namespace": "com.materialize.cdc",
              "fields": [{"name": "data", "type": data}, {"name": "time", "type": "long"},
                         {"name": "diff", "type": "long"}]}
    return [{"type": "array", "items": update}, PROGRESS_SCHEMA]


def encode_updates(schema, rows, times, diffs, chunk: int = 10_000) -> list[bytes]:
    """The update-array datums (union branch 0, up to ``chunk`` updates each) of ``rows`` as they
    are (not consolidated), encoded column by column (`avro_columns`)."""
    import pyarrow as pa

    from tidemark.consolidate import avro_columns as AC
    from tidemark.consolidate.layout import conform

    data = conform(rows.select(schema.names), schema)
    encoded = AC.encode_rows([(data.column(i), True) for i in range(data.num_columns)]
                             + [(pa.array(_ints(times)), False), (pa.array(_ints(diffs)), False)])
    return AC.array_datums(encoded, branch=0, chunk=chunk)


def _ints(v):
    import numpy as np
    import pyarrow as pa

    if isinstance(v, (pa.Array, pa.ChunkedArray)):
        return np.asarray(v.cast(pa.int64()).to_numpy(zero_copy_only=False), np.int64)
    return np.asarray(v, np.int64)


def cdc_bytes(table: str, schema, rows, times, diffs, lower: int, upper: int,
              chunk: int = 10_000, metadata: dict[str, str] | None = None,
              since: int | None = None, encoded: list[tuple[int, bytes]] | None = None,
              codec: str = "zstandard") -> bytes:
    """One changelog file: update arrays, pre-consolidated (`layout.consolidated_updates`: identical
    ``(data, time)`` summed into one update with ``diff = n``, zero sums dropped), in time order
    (with ``encoded``: in the order given; the format orders nothing within a file), then the
    progress record ``[lower, upper)`` whose counts per time are the distinct updates.
    ``since`` (not None) first writes the progress ``{lower: [since], upper: [lower], counts: []}``
    (a feed's first file: ``since = 0``). ``times``/``diffs``: one per row (lists or arrays).

    The updates are encoded column by column from Arrow (`avro_columns`), byte for byte what
    fastavro writes for the `cdc_schema`. ``encoded``: the updates of ``rows`` already encoded
    (`encode_updates` of consolidated rows, as ``(number of datums, their bytes)`` groups, e.g. one
    per bucket of the batch path): they are framed as they are; only the progress counts come
    from ``times``. Blocks are compressed under ``codec`` (as the committed feed's files are)."""
    import fastavro
    import numpy as np
    import pyarrow as pa

    from tidemark.consolidate import avro_columns as AC
    from tidemark.consolidate.layout import conform, consolidated_updates

    parsed = fastavro.parse_schema(cdc_schema(table, schema))
    t = _ints(times)
    if encoded is None:
        data = conform(rows.select(schema.names), schema)
        keep, sums = consolidated_updates(data, t, _ints(diffs))
        data = data.take(pa.array(keep))
        t = t[keep]

    def union_datum(rname, rec) -> bytes:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, (rname, rec))
        return buf.getvalue()

    datums = []
    if since is not None and since < lower:
        datums.append(union_datum("com.materialize.cdc.progress", {"lower": [since], "upper": [lower], "counts": []}))
    if encoded is None:
        datums += encode_updates(schema, data, t, sums, chunk=chunk)
    else:
        datums += [group for group in encoded if group[0]]
    times_u, counts = np.unique(t, return_counts=True)
    datums.append(union_datum("com.materialize.cdc.progress", {
        "lower": [lower], "upper": [upper],
        "counts": [{"time": int(a), "count": int(c)} for a, c in zip(times_u.tolist(), counts.tolist())]}))
    return AC.container(parsed, datums, metadata={"tidemark.table": table, **(metadata or {})}, codec=codec)


def changelog_key(stream: str, table: str, lower: int, upper: int) -> str:
    from tidemark.landing.store import stream_keys

    return f"{stream_keys(stream)['changelog']}{table}/{lower:016X}_{upper:016X}.avro"


def read_cdc(data: bytes) -> tuple[list[dict], dict]:
    """Decode a changelog file: (updates, its last progress record)."""
    updates, progress = read_cdc_all(data)
    return updates, progress[-1] if progress else None


def read_cdc_all(data: bytes) -> tuple[list[dict], list[dict]]:
    """Decode a changelog file: (updates, every progress record in order)."""
    import fastavro

    updates, progress = [], []
    for datum in fastavro.reader(io.BytesIO(data), return_record_name=True):
        if isinstance(datum, list):
            updates.extend(datum)
        else:
            progress.append(datum[1])
    return updates, progress


# -- exact per-time changes (Spark) ------------------------------------------------------------------



def log_schema(target):
    """The changelog's Arrow schema (without the partition): the table's columns + meta columns."""
    import pyarrow as pa

    return pa.schema(list(target) + [pa.field("_time", pa.int64()), pa.field("_diff", pa.int64()),
                                     pa.field("_commit_ts", pa.timestamp("us", tz="UTC"))])


# -- committing a batch's changelog ------------------------------------------------------------------

UNREAD = object()


@dataclass
class Written:
    """A batch's changelog as the executors wrote it (`merge.merge_group`), for `commit_changelog`:
    the Parquet files' add actions, the keys of the CDC parts (container blocks framed with
    ``sync``, compressed under ``codec``) in the landing store, and the number of updates per time
    (``times``, ``counts``)."""

    lo: int
    sync: bytes
    codec: str = "zstandard"
    files: list = field(default_factory=list)
    parts: list = field(default_factory=list)
    times: Any = None
    counts: Any = None


def parts_prefix(stream: str, table: str, run: str) -> str:
    """Where the executors of one consolidation attempt put a table's CDC parts."""
    return f"{_feed_prefix(stream, table)}_parts/{run}/"


def _feed_prefix(stream: str, table: str) -> str:
    return changelog_key(stream, table, 0, 0).rsplit("/", 1)[0] + "/"


def _pending_key(stream: str, table: str, lower: int, upper: int) -> str:
    """A changelog file written before its Delta commit: not a feed file (no ``.avro`` name) until
    `_settle` publishes it under `changelog_key` once the commit is there."""
    return f"{_feed_prefix(stream, table)}_pending/{lower:016X}_{upper:016X}.avro.pending"


def commit_changelog(cfg, table: str, target, rows, lower: int, frontier: int, *, options=None,
                     base: str | None = None, store=None, lake_at=UNREAD, dt=UNREAD,
                     written: Written | None = None, run: str | None = None, renamed: dict | None = None) -> int:
    """Commit a batch's exact changelog once: the times in ``[lo, frontier)``, ``lo`` = the
    changelog's own committed frontier (or ``lower``), as one Delta commit with the application
    transaction ``(stream, frontier)`` (also when empty, so ``lo`` always is where the previous
    commit ended) and the Materialize CDC file of the range, published only after that commit.
    Return the rows committed (0: already done).

    The rows come either as ``rows`` (an Arrow table on the driver: small, e.g. an idle table's
    none) or as ``written`` by the executors (Parquet files and CDC parts; the driver only frames
    the parts into the file, streaming, never holding more than one part). ``store``: the landing
    store, opened once by a caller committing many tables; ``lake_at``: the lake table's committed
    frontier, when the caller has just read it (else it is read here); ``dt``: the changelog Delta
    table (or None: none yet) as the caller opened it, under the stream's lease (else it is opened
    here); ``run``: the attempt whose parts are in use (other attempts' parts are deleted);
    ``renamed``: columns renamed in the source before this range (old -> new: RENAME COLUMN), said in
    the CDC file's header (``tidemark.renamed``), its fields having the new names from here on."""
    import json

    import numpy as np
    import pyarrow.compute as pc

    from tidemark.lake import writer as _commit
    from tidemark.lake import changelog_uri, committed_frontier, open_delta
    from tidemark.landing.store import landing_store

    uri = changelog_uri(cfg, table)
    if dt is UNREAD:
        dt = open_delta(uri, options)
    if store is None:
        store = landing_store(cfg)
    done = committed_frontier(dt, cfg.stream)
    waiting = _settle(store, cfg.stream, table, done, keep_run=run)
    if done is not None and done >= frontier:
        return 0
    restart = log_type_change(dt, target)
    if restart is not None and base is None and not _has_new_base(cfg, table, done, options, lake_at):
        restart = None      # no snapshot load to restart at: `evolve_log_schema` says what is wrong
    if restart is None:
        dt = evolve_log_schema(uri, options, dt, target, table)
    lo = lower if done is None else max(lower, done)
    if written is not None and written.lo != lo:
        raise ChangelogError(f"table {table}: the executors wrote the changelog from {written.lo}, but it is "
                             f"committed up to {lo} now (another consolidation ran meanwhile?)")
    meta = {"tidemark.lower": str(lo), "tidemark.upper": str(frontier)}
    if base is not None or dt is None:
        meta["tidemark.base"] = base or (f"the lake version at {lo}: rows present then (its snapshot) are not "
                                         "in this changelog")
    if renamed:
        meta["tidemark.renamed"] = json.dumps(renamed, sort_keys=True)
    if restart is not None:
        meta["tidemark.restart"] = (f"{restart}: the changelog restarts at this base with the table's new types; "
                                    f"its rows before {lo} are in Delta version {dt.version()} (time travel)")
    # the standard feed (Materialize CDC files) also carries each base: the first file starts with
    # the progress [0, S) and holds the snapshot's rows as updates at S; a later snapshot (resend)
    # is the difference between the lake's state before it and its rows, at its LSN. The base's
    # updates are at S: a range ending at S (a consolidation right after the snapshot, before any
    # drain) cannot hold them; it declares [0, S) (or [done, S)) and leaves a marker
    # (``_pending/S.base``) so that the first range past S carries the base, whatever ran between
    since, feed_lo, head, key_lo, wait = None, lo, None, lo, None
    may = bool(waiting) or _may_have_new_base(cfg, table, done, options, lake_at)
    based = (table_base(cfg, table, target, options, pending=[w for w in waiting if w < frontier],
                        restart=restart is not None) if may else None)
    if based is not None and (done is None or done <= based[0]):
        if based[0] >= frontier:
            since = 0 if done is None else done
            key_lo, wait = min(since, lo), based[0]
        elif based[0] <= lo:
            feed_lo, since, head = based[0], (0 if done is None else done), based[1]
    key = changelog_key(cfg.stream, table, key_lo, frontier)
    _discard_uncommitted_cdc(store, cfg.stream, table, done, keep=key)
    if written is None:
        rows = rows.filter(pc.greater_equal(rows.column("_time"), lo))
        files = write_log_files(uri, options, rows, tag=f"{frontier:016X}-{uuid.uuid4().hex[:12]}")
        n_rows = rows.num_rows
    else:
        files = list(written.files)
        n_rows = int(np.sum(written.counts)) if written.counts is not None and len(written.counts) else 0
    pending = _pending_key(cfg.stream, table, key_lo, frontier)
    if wait is not None:
        store.put(_base_marker(cfg.stream, table, wait), b"")
    try:
        _write_feed_file(store, pending, table, target, rows=rows if written is None else None, written=written,
                         head=head, lower=feed_lo, upper=frontier, since=since, metadata=meta,
                         codec=written.codec if written is not None else cfg.landing.codec)
        _commit.commit_files(uri, options, dt, log_schema(target), files, stream=cfg.stream, frontier=frontier,
                             partition="_commit_date", overwrite=restart is not None,
                             operation="changelog" if restart is None else RESTART_OPERATION)
    except BaseException:   # delete only what no committed version references (the commit may have happened)
        _commit.discard_uncommitted(uri, options, files, stream=cfg.stream, frontier=frontier)
        raise
    _publish(store, pending, key)
    for at in waiting:      # a base marked pending is in this file now (its time is below the frontier)
        if at < frontier and at != wait:
            store.delete(_base_marker(cfg.stream, table, at))
    if written is not None:
        for part in written.parts:
            store.delete(part)
    return n_rows


def _base_marker(stream: str, table: str, at: int) -> str:
    """The marker of a base at ``at`` that no feed file holds yet (see `commit_changelog`)."""
    return f"{_feed_prefix(stream, table)}_pending/{at:016X}.base"


def _write_feed_file(store, key: str, table: str, target, *, rows, written: Written | None, head, lower: int,
                     upper: int, since: int | None, metadata: dict, codec: str) -> None:
    """Write one changelog file to ``key``: the header, the ``since`` progress, the ``head`` rows (a
    snapshot base: `base_buckets`, consolidated and encoded here one bucket at a time) and either
    ``rows`` (encoded here) or the executors' parts (copied as they are, one at a time), then the
    progress record with every update's time counted. Its blocks are compressed under ``codec`` (the
    stream's ``landing.codec``, zstandard by default, as its segments are; the executors' parts were
    compressed with the same codec)."""
    import os
    import tempfile

    import fastavro
    import numpy as np
    import pyarrow as pa

    from tidemark.consolidate import avro_columns as AC
    from tidemark.consolidate.layout import conform, consolidated_updates

    parsed = fastavro.parse_schema(cdc_schema(table, target))
    sync = written.sync if written is not None else os.urandom(16)

    def union_datum(rname, rec) -> bytes:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, (rname, rec))
        return buf.getvalue()

    def consolidated(t):
        data = conform(t.select(target.names), target)
        keep, sums = consolidated_updates(data, _ints(t.column("_time")), _ints(t.column("_diff")))
        data = data.take(pa.array(keep))
        times = _ints(t.column("_time"))[keep]
        return encode_updates(target, data, times, sums), times

    times = [np.zeros(0, np.int64)]
    counts = [np.zeros(0, np.int64)]
    fd, tmp = tempfile.mkstemp(prefix="tidemark-cdc-", suffix=".avro")
    store.delete(key)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(AC.header(parsed, metadata={"tidemark.table": table, **metadata}, sync=sync, codec=codec))
            if since is not None and since < lower:
                for block in AC.blocks([union_datum("com.materialize.cdc.progress",
                                                    {"lower": [since], "upper": [lower], "counts": []})], sync,
                                    codec=codec):
                    out.write(block)
            for t in [*(head or ()), rows]:     # the base one bucket at a time, then the rows
                if t is not None and t.num_rows:
                    datums, tt = consolidated(t)
                    for block in AC.blocks(datums, sync, codec=codec):
                        out.write(block)
                    times.append(tt)
                    counts.append(np.ones(len(tt), np.int64))
            if written is not None:
                for part in written.parts:
                    out.write(store.get(part))
                if written.times is not None:
                    times.append(np.asarray(written.times, np.int64))
                    counts.append(np.asarray(written.counts, np.int64))
            t_all, c_all = np.concatenate(times), np.concatenate(counts)
            uniq, inv = np.unique(t_all, return_inverse=True)
            per_time = np.bincount(inv, weights=c_all, minlength=len(uniq)).astype(np.int64) if len(uniq) else c_all
            progress = union_datum("com.materialize.cdc.progress", {
                "lower": [lower], "upper": [upper],
                "counts": [{"time": int(a), "count": int(c)} for a, c in zip(uniq.tolist(), per_time.tolist())]})
            for block in AC.blocks([progress], sync, codec=codec):
                out.write(block)
        store.put_file(key, tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _publish(store, pending: str, key: str) -> None:
    """Make a committed range's file visible under its feed name (then drop the pending copy)."""
    local = getattr(store, "local_path", None)
    if local is not None:
        import os

        dst = local(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(local(pending), dst)
        return
    store.put(key, store.get(pending))
    store.delete(pending)


def _settle(store, stream: str, table: str, done: int | None, keep_run: str | None = None) -> list[int]:
    """Finish what an interrupted attempt left: a pending file whose range the changelog's Delta log
    has committed is published (the attempt stopped between its commit and the publication); any
    other pending file, and every other attempt's CDC parts, are deleted (never committed). Return
    the times of the bases marked pending (`_base_marker`)."""
    prefix = _feed_prefix(stream, table)
    waiting = []
    for key in list(store.list(prefix + "_pending/")):
        name = key.rsplit("/", 1)[-1]
        if name.endswith(".base"):
            with contextlib.suppress(ValueError):
                waiting.append(int(name[:-len(".base")], 16))
            continue
        try:
            lo_s, up_s = name.split(".", 1)[0].split("_")
            lo, up = int(lo_s, 16), int(up_s, 16)
        except ValueError:
            continue
        if done is not None and lo < done and up <= done:
            _publish(store, key, changelog_key(stream, table, lo, up))
        else:
            store.delete(key)
    keep = parts_prefix(stream, table, keep_run) if keep_run else None
    for key in list(store.list(prefix + "_parts/")):
        if keep is None or not key.startswith(keep):
            store.delete(key)
    return sorted(waiting)


RESTART_OPERATION = "changelog_restart"     # the Delta commit that restarts a changelog (`log_type_change`)


def log_type_change(dt, target) -> str | None:
    """What keeps the changelog Delta table ``dt`` from holding rows of ``target``: a column whose
    type changed (ALTER COLUMN TYPE), or None. At a base (a snapshot of the table loaded: a resend, a
    re-snapshot that replaces the table) the changelog then restarts: that commit overwrites it with
    the new schema (operation ``changelog_restart``), its earlier rows stay readable in the Delta
    versions before it (`tidemark.lake.changelog_between` stitches them), and the CDC feed restarts
    too: its base is the snapshot's rows alone, in a file whose header says ``tidemark.restart`` (a
    subscriber drops what it holds of the table and takes them)."""
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
    now): a column added in the source (ADD COLUMN) is added to the changelog as a nullable column
    (earlier rows read null); a dropped column stays (earlier rows keep their values, later rows
    read null). The changelog's schema is thus the union of every column the table has had, in the
    order they first appeared. A column that comes back with another type is refused (its earlier
    values could not be read). Return the table as reopened (``dt`` itself if unchanged)."""
    import pyarrow as pa
    from deltalake import Schema

    from tidemark.lake import writer as _commit
    from tidemark.lake import open_delta

    if dt is None:
        return dt
    have = {f.name: f.type for f in dt.schema().fields}
    added = []
    for f in target:
        if f.name not in have:
            added.append(f.with_nullable(True))
        elif Schema.from_arrow(pa.schema([f])).fields[0].type != have[f.name]:
            raise ChangelogError(f"table {table}: column {f.name} has type {f.type} now but {have[f.name]} "
                                 f"in the changelog {uri}; the changelog cannot hold both: a re-snapshot of the "
                                 "table (mode table, or a resend) restarts it with the new type")
    if not added:
        return dt
    _commit.add_columns(dt, added)
    return open_delta(uri, options)


def write_log_files(uri: str, options, rows, *, tag: str) -> list[dict]:
    """Write changelog rows as one Parquet file per ``_commit_date``; return their add actions."""
    import json
    import os

    import pyarrow as pa
    import pyarrow.compute as pc

    from tidemark.consolidate import layout

    if rows.num_rows == 0:
        return []
    dates = pc.cast(pc.cast(rows.column("_commit_ts"), pa.timestamp("us")), pa.date32())
    fs = layout.filesystem(uri, options)
    base = layout.fs_path(uri)
    out = []
    days = sorted(pc.unique(dates).to_pylist())
    for d in days:
        part = rows if len(days) == 1 else rows.filter(pc.equal(dates, pa.scalar(d, pa.date32())))
        rel = f"_commit_date={d.isoformat()}/part-{tag}.parquet"
        if not uri.startswith("s3://"):
            os.makedirs(os.path.dirname(base + "/" + rel), exist_ok=True)
        size = layout.write_parquet(part, base + "/" + rel, fs)
        out.append({"target": "changelog", "op": "add", "path": rel, "size": size,
                    "rows": part.num_rows, "stats": json.dumps({"numRecords": part.num_rows}),
                    "partition": d.isoformat()})
    return out


def _discard_uncommitted_cdc(store, stream: str, table: str, done: int | None, keep: str) -> None:
    """Delete CDC files of attempts whose Delta commit never happened (their lower is at or past
    the committed frontier), so the files of a table always tile its committed ranges."""
    prefix = changelog_key(stream, table, 0, 0).rsplit("/", 1)[0] + "/"
    for key in list(store.list(prefix)):
        name = key[len(prefix):] if key.startswith(prefix) else key.rsplit("/", 1)[-1]
        if "/" in name or not name.endswith(".avro") or key == keep:
            continue
        try:
            lo = int(name.split("_", 1)[0], 16)
        except ValueError:
            continue
        if done is None or lo >= done:
            store.delete(key)


# -- the standard feed: bases and idle tables --------------------------------------------------------

def _version_buckets(uri: str, options, version: int, schema):
    """(a reader, {bucket: the version's data files}) of one Delta version of a lake table: the reader
    gives a list of its files' rows in ``schema`` (missing columns null; columns renamed since under
    their names now). Every file of a lake table lies in its bucket's ``_bucket=N`` directory."""
    import re

    import pyarrow as pa
    import pyarrow.dataset as ds
    from deltalake import DeltaTable, Schema

    from tidemark.consolidate.layout import conform
    from tidemark.lake import data_files, exact_schema, filesystem, open_delta, table_info
    from tidemark.lake.delta import renames_since

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


def snapshot_versions(dt) -> list[tuple[int, int]]:
    """(Delta version, snapshot LSN) of every snapshot load in a lake table's history, oldest first."""
    import json

    out = []
    for h in dt.history():
        meta = h.get("tidemark") or {}
        if isinstance(meta, str):
            meta = json.loads(meta)
        if meta.get("operation") == "snapshot":
            out.append((int(h["version"]), int(meta["frontier"])))
    return sorted(out)


def base_changes(uri: str, options, version: int, lsn: int, target, before: int | None = None):
    """A snapshot load (Delta ``version`` at ``lsn``) as changelog rows at ``lsn``, all at once (a
    reader's call: `tidemark.subscribers`): `base_buckets` pre-consolidated, a row in both versions
    cancelled and identical rows one update with their count, so a resend gives only the rows that
    differ (correction deltas)."""
    import pyarrow as pa

    parts = [_net(rows) for rows in base_buckets(uri, options, version, lsn, target, before)]
    parts = [p for p in parts if p.num_rows]
    return pa.concat_tables(parts) if parts else _stamped(target.empty_table(), lsn, 1)


def base_buckets(uri: str, options, version: int, lsn: int, target, before: int | None = None):
    """A snapshot load (Delta ``version`` at ``lsn``) as changelog rows at ``lsn``, one bucket at a
    time (the memory of one bucket of each version, never the table's): +1 of its rows and -1 of the
    rows of the version it replaced (none for the first); ``before``: the version to take out instead
    (the feed's state when an earlier base never reached it). Not consolidated: the feed's writer
    consolidates each bucket's rows (`layout.consolidated_updates`: a row in both versions cancels,
    identical rows are one update with their count, so a resend records only the rows that differ).
    Identical rows of one version share a bucket; a row whose bucket moved (the key changed) is a -1
    and a +1 of it, which sum to nothing."""
    import pyarrow as pa

    sides = []
    for v, diff in ((version, 1), (version - 1 if before is None else before, -1)):
        if v >= 0:
            sides.append((diff, *_version_buckets(uri, options, v, target)))
    for b in sorted({b for _, _, buckets in sides for b in buckets}):
        parts = [_stamped(read(buckets[b]), lsn, diff) for diff, read, buckets in sides if b in buckets]
        yield parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def _stamped(rows, lsn: int, diff: int):
    """``rows`` with the changelog's ``_time`` (``lsn``), ``_diff`` and a null ``_commit_ts``."""
    import pyarrow as pa

    n = rows.num_rows
    return (rows.append_column("_time", pa.array([lsn] * n, pa.int64()))
            .append_column("_diff", pa.array([diff] * n, pa.int64()))
            .append_column("_commit_ts", pa.nulls(n, pa.timestamp("us", tz="UTC"))))


def _net(rows):
    """``rows`` (data, ``_time``, ``_diff``, ``_commit_ts`` null) with the diffs of identical (data,
    time) summed and zero sums dropped; as given when a column's type cannot be grouped (a list)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    keys = [n for n in rows.column_names if n not in ("_diff", "_commit_ts")]
    try:
        summed = rows.group_by(keys, use_threads=False).aggregate([("_diff", "sum")])
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        return rows
    summed = summed.filter(pc.not_equal(summed.column("_diff_sum"), 0))
    out = summed.select(keys).append_column("_diff", summed.column("_diff_sum").cast(pa.int64()))
    out = out.append_column("_commit_ts", pa.nulls(out.num_rows, pa.timestamp("us", tz="UTC")))
    return out.select(rows.column_names).cast(rows.schema)


def _may_have_new_base(cfg, table: str, done: int | None, options, at=UNREAD) -> bool:
    """Cheap gate before reading a table's history: a changelog not started yet, or a lake table
    whose own frontier (``at``, read here if not given) is past the changelog's (a snapshot loaded
    since: only a load moves it so)."""
    from tidemark.lake import committed_frontier, open_delta, table_uri

    if done is None:
        return True
    if at is UNREAD:
        at = committed_frontier(open_delta(table_uri(cfg, table), options), cfg.stream)
    return at is not None and at > done


def _has_new_base(cfg, table: str, done: int | None, options, lake_at=UNREAD) -> bool:
    """Whether the lake table's newest commit is a snapshot load the changelog (at ``done``) has not
    taken yet: a base, also when the run that loaded it failed before its changelog commit."""
    from tidemark.lake import committed_frontier, open_delta, table_uri

    if not _may_have_new_base(cfg, table, done, options, lake_at):
        return False
    dt = open_delta(table_uri(cfg, table), options)
    snaps = snapshot_versions(dt) if dt is not None else []
    return bool(snaps) and committed_frontier(dt, cfg.stream) == snaps[-1][1] and (done is None or done <= snaps[-1][1])


def table_base(cfg, table: str, target, options=None, pending: list[int] = (), restart: bool = False):
    """(S, its rows one bucket at a time: `base_buckets`) of the table's newest snapshot load while
    the lake table holds nothing after it (its application transaction is still the snapshot's
    LSN), else None. ``pending``: LSNs of earlier
    bases marked pending (`_base_marker`: in no feed file yet); the rows are then the difference from
    the lake before the oldest of them, what the feed holds. ``restart``: the changelog restarts at
    this base (a column's type changed: the rows it replaced have no value in the new type), so the
    rows are the snapshot's alone and the feed file says ``tidemark.restart``."""
    from tidemark.lake import committed_frontier, open_delta, table_uri

    uri = table_uri(cfg, table)
    dt = open_delta(uri, options)
    if dt is None:
        return None
    snaps = snapshot_versions(dt)
    if not snaps or committed_frontier(dt, cfg.stream) != snaps[-1][1]:
        return None
    version, lsn = snaps[-1]
    before = -1 if restart else next((v - 1 for v, at in snaps if pending and at == min(pending)), None)
    return lsn, base_buckets(uri, options, version, lsn, target, before=before)


def advance_feeds(cfg, frontier: int, *, options=None, frontiers: dict[str, int] | None = None,
                  committed=(), opened: dict | None = None) -> list[str]:
    """Commit an empty changelog (progress only) to ``frontier`` for every captured table whose lake
    table exists but whose changelog is behind (idle in this batch, or only its snapshot loaded), so
    every table's feed advances on every batch. Return the tables advanced. ``frontiers``: each
    table's own frontier (an external feed's tables), instead of ``frontier``; ``committed``: tables
    whose lake table and changelog this run committed at their frontier (nothing to look at);
    ``opened``: lake tables the caller opened and nothing has committed to since (not reopened)."""
    from tidemark.lake import committed_frontier, exact_schema, open_delta, table_uri

    done = []
    skip = set(committed)
    for ref in cfg.source.tables:
        table = ref.qualified
        if table in skip:
            continue
        upto = (frontiers or {}).get(table, frontier)
        dt = (opened or {}).get(table) or open_delta(table_uri(cfg, table), options)
        at = committed_frontier(dt, cfg.stream)
        if dt is None or at is None or at > upto:
            continue
        target = exact_schema(dt)
        if commit_changelog(cfg, table, target, log_schema(target).empty_table(), at, upto, options=options):
            pass
        done.append(table)
    return done
