"""Snapshot-copy: create the stream's slot with an exported snapshot and copy tables under it, in page
ranges, in parallel (how: docs/internals/capture.md). The chunks, their SQL and CSV are
`tidemark.capture.chunks`; the planning and the parallel copy `tidemark.capture.table_copy` (with the
landing layout); a resend's key-range comparison `tidemark.capture.ranges`. The manifest (and the
``tidemark.snapshots`` row) gives each table's row count, files and shape.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Callable, Iterable

from psycopg2 import sql

from tidemark.capture import ranges
from tidemark.capture.chunks import Chunk, SnapshotError, row_filter_sql
from tidemark.capture.source import apply_stream, connect_replication, drop_slot, slot_info
from tidemark.capture.table_copy import copy_all, discard_files, manifest_key, plan_tables
from tidemark.config import NO_FILTER, StreamConfig, TableRef
from tidemark.control import Control, open_control
from tidemark.landing.store import Store, landing_store, put_if_absent
from tidemark.lsn import format_lsn, parse_lsn
from tidemark.pgtypes import TableSchema, arrow_schema

log = logging.getLogger(__name__)

MODES = ("initial", "resend", "add", "table")
__all__ = ["Chunk", "SnapshotError", "SnapshotResult", "add_tables", "load_manifest", "read_snapshot_table",
           "refiltered_tables", "resnapshot_refiltered", "row_filter_sql", "snapshot_stream"]


@dataclass(frozen=True)
class SnapshotResult:
    snapshot_id: str
    lsn: int
    tables: dict[str, int]            # schema.table -> rows copied
    manifest_uri: str = ""           # the manifest lists each table's files and shape
    waiting: list[str] = field(default_factory=list)   # stream tables not copied: they wait for `--mode add`
    copies: dict[str, dict] = field(default_factory=dict)  # schema.table -> `ranges.summary` (a resend)


def refiltered_tables(cfg: StreamConfig, ctl: Control) -> dict[str, str]:
    """{table: why} of the stream's captured tables whose column list or row filter in the stream file
    differs from the one their lake copy was taken with (the latest snapshot that copied them): the
    lake holds other columns or rows than the publication now sends, so that table is re-snapshotted
    alone while the stream runs (`stream apply` does it right away, the gap sensor's resend step
    finds any left)."""
    states = ctl.table_states(cfg.stream)
    entries = ctl.last_table_snapshots(cfg.stream)
    out = {}
    for ref in cfg.source.tables:
        entry = entries.get(ref.qualified)
        if entry is None or states.get(ref.qualified, ("capturing",))[0] in ("awaiting_snapshot", "frozen"):
            continue
        was = entry.get("published") or NO_FILTER.as_dict()
        now = cfg.source.filter_of(ref).as_dict()
        if was != now:
            changed = [f"{k} {was.get(k)!r} -> {now[k]!r}" for k in ("columns", "where") if was.get(k) != now[k]]
            out[ref.qualified] = f"its column list or row filter changed ({'; '.join(changed)})"
    return out


def resnapshot_refiltered(cfg: StreamConfig) -> SnapshotResult | None:
    """Re-snapshot (mode ``table``, online) the tables whose column list or row filter changed since
    their copy (`refiltered_tables`); None when none did or the stream is not capturing yet."""
    with open_control(cfg) as ctl:
        if ctl.stream(cfg.stream).consistent_lsn is None:
            return None
        tables = sorted(refiltered_tables(cfg, ctl))
    if not tables:
        return None
    return snapshot_stream(cfg, tables=tables, mode="table")


def _select_tables(cfg: StreamConfig, tables: Iterable[str | TableRef] | None) -> list[TableRef]:
    if tables is None:
        return list(cfg.source.tables)
    out = []
    for t in tables:
        ref = t if isinstance(t, TableRef) else TableRef.parse(t)
        if ref not in cfg.source.tables:
            raise SnapshotError(f"stream {cfg.stream}: table {ref} is not one of the stream's tables "
                                f"({', '.join(str(r) for r in cfg.source.tables)})")
        if ref not in out:
            out.append(ref)
    return out


# -- the public face -----------------------------------------------------------------------------

def snapshot_stream(cfg: StreamConfig, *, tables: Iterable[str | TableRef] | None = None, mode: str = "initial",
                    chunk_pages: int | None = None, parallelism: int | None = None,
                    progress: Callable[[dict], None] | None = None,
                    chunk_hook: Callable[[Chunk, int], None] | None = None) -> SnapshotResult:
    """Create the stream's slot at a new consistent point and copy ``tables`` as of that point.

    ``tables=None`` copies every table of the stream; ``tables=[]`` only creates the slot and records
    the consistent point. ``mode="initial"`` refuses a stream that already has a consistent point and
    a slot; ``mode="resend"`` drops the slot and starts over at a new consistent point (the frontier is
    left alone) and must copy every table of the stream (a subset is refused: the other tables would
    silently miss their changes between the last landed segment and the new point).
    ``chunk_hook(chunk, attempt)`` runs in the worker before each chunk is copied (tests use it to
    slow a copy or make one fail). Raises `StreamBusy` if another snapshot runs.
    """
    if mode not in MODES:
        raise SnapshotError(f"unknown snapshot mode {mode!r} (use one of {', '.join(MODES)})")
    refs = _select_tables(cfg, tables)
    if mode == "add" or (mode == "initial" and tables is not None and _awaiting(cfg, refs)):
        return add_tables(cfg, refs, chunk_pages=chunk_pages, parallelism=parallelism, progress=progress,
                          chunk_hook=chunk_hook)
    if mode == "table" or (mode == "resend" and set(refs) != set(cfg.source.tables) and slot_info(cfg) is not None):
        # one table again while the stream's slot is intact: online, the others go on
        return add_tables(cfg, refs, mode="table", chunk_pages=chunk_pages, parallelism=parallelism,
                          progress=progress, chunk_hook=chunk_hook)
    if mode == "resend" and set(refs) != set(cfg.source.tables):
        # The slot is recreated at a new consistent point: whatever the other tables changed since the
        # last landed segment would never be captured. Refuse rather than lose it silently.
        missing = sorted(t.qualified for t in set(cfg.source.tables) - set(refs))
        raise SnapshotError(f"stream {cfg.stream}: a resend recreates the slot at a new consistent point, so "
                            f"every table of the stream must be re-snapshotted; {', '.join(missing)} would "
                            "lose the changes made since the last landed segment. Run the resend with all "
                            "tables (tables=None)")
    chunk_pages, parallelism = _sizes(cfg, chunk_pages, parallelism)
    apply_stream(cfg)
    with open_control(cfg) as ctl, contextlib.ExitStack() as locks:
        leases = [locks.enter_context(ctl.stream_lock(cfg.stream, "snapshot"))]
        if mode == "resend":   # the slot is replaced: no drain may hold it meanwhile
            leases.append(locks.enter_context(ctl.stream_lock(cfg.stream, "drain")))
        _prepare_slot(cfg, ctl, mode)
        return _take(cfg, ctl, refs, mode, chunk_pages, parallelism, progress, chunk_hook, leases)


def add_tables(cfg: StreamConfig, refs: list[TableRef], *, mode: str = "add", chunk_pages: int | None = None,
               parallelism: int | None = None, progress: Callable[[dict], None] | None = None,
               chunk_hook: Callable[[Chunk, int], None] | None = None) -> SnapshotResult:
    """Snapshot tables added to a running stream at ONE new consistent point ``L`` of their own (a
    TEMPORARY slot's exported snapshot), while the stream's slot, drains and consolidations go on; the
    stream's positions do not move, the tables are ``capturing`` from ``L``
    (`Control.snapshot_tables_complete`). ``mode="table"``: re-snapshot tables the stream captures, the
    same way (docs/operations/cli.md). Raises `SnapshotError` for a table captured already (mode
    ``add``), a mix of waiting and captured tables (mode ``table``), or a stream without a running slot."""
    if not refs:
        raise SnapshotError(f"stream {cfg.stream}: snapshot mode '{mode}' needs its tables (--tables)")
    chunk_pages, parallelism = _sizes(cfg, chunk_pages, parallelism)
    apply_stream(cfg)       # the tables are in the publication before L: their changes from L on are captured
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "snapshot-add") as lease:
        state = ctl.stream(cfg.stream)
        if state.consistent_lsn is None or slot_info(cfg) is None:
            raise SnapshotError(f"stream {cfg.stream} is not capturing yet (no consistent point or no slot "
                                f"{cfg.source.slot}): take its initial snapshot first (tidemark snapshot "
                                f"{cfg.stream}), or a resend when the slot is lost")
        states = ctl.table_states(cfg.stream)
        captured = [r.qualified for r in refs if states.get(r.qualified, ("capturing",))[0] != "awaiting_snapshot"]
        if mode == "table" and not captured:
            mode = "add"        # every one of them waits for its first snapshot: that is an add
        elif mode == "table" and len(captured) < len(refs):
            waiting = sorted({r.qualified for r in refs} - set(captured))
            raise SnapshotError(f"stream {cfg.stream}: {', '.join(waiting)} wait(s) for a first snapshot: take it "
                                f"first (tidemark snapshot {cfg.stream} --mode add --tables {','.join(waiting)}), "
                                "then re-snapshot the others")
        if captured and mode == "add":
            raise SnapshotError(f"stream {cfg.stream}: {', '.join(captured)} is captured already (mode 'add' is for "
                                "tables added to the stream file and applied since its snapshot); to copy it "
                                f"again while the stream runs: tidemark snapshot {cfg.stream} --mode table --tables "
                                f"{','.join(captured)}")
        return _take(cfg, ctl, refs, mode, chunk_pages, parallelism, progress, chunk_hook, [lease], temporary=True)


def _sizes(cfg: StreamConfig, chunk_pages: int | None, parallelism: int | None) -> tuple[int, int]:
    """The chunk size and parallelism asked for, else the stream's ``snapshot`` settings."""
    chunk_pages = chunk_pages or cfg.snapshot.chunk_pages
    parallelism = parallelism or cfg.snapshot.parallelism
    if chunk_pages < 1 or parallelism < 1:
        raise SnapshotError("chunk_pages and parallelism must be >= 1")
    return chunk_pages, parallelism


def _awaiting(cfg: StreamConfig, refs: list[TableRef]) -> bool:
    """Whether every one of ``refs`` was added to the running stream and waits for its snapshot."""
    with open_control(cfg) as ctl:
        try:
            states = ctl.table_states(cfg.stream)
        except Exception:  # noqa: BLE001 - not registered yet: an initial snapshot
            return False
    return bool(refs) and all(states.get(r.qualified, ("",))[0] == "awaiting_snapshot" for r in refs)


def _prepare_slot(cfg: StreamConfig, ctl: Control, mode: str) -> None:
    """Check the stream's state for ``mode`` and drop a slot that must be recreated."""
    state = ctl.stream(cfg.stream)
    info = slot_info(cfg)
    if mode == "initial" and state.consistent_lsn is not None:
        where = f"{format_lsn(state.consistent_lsn)}"
        if info is not None:
            raise SnapshotError(f"stream {cfg.stream} already has its initial snapshot (consistent point {where}) "
                                f"and slot {cfg.source.slot}; to copy tables again at a new consistent point "
                                "run a resend (snapshot mode 'resend')")
        raise SnapshotError(f"stream {cfg.stream} has a consistent point ({where}) but its slot "
                            f"{cfg.source.slot} is gone; run a resend (snapshot mode 'resend')")
    if info is not None:
        # resend: the old slot is replaced; initial: a leftover of a snapshot that did not finish
        drop_slot(cfg)


def _create_slot(cfg: StreamConfig, *, temporary: bool):
    """Create a slot with an exported snapshot: the stream's, or (``temporary``) one of its own that goes
    with its connection; return (replication connection, lsn, snapshot name, snapshot id)."""
    conn = connect_replication(cfg, application_name=f"tidemark-snapshot-{'add' if temporary else 'slot'}:{cfg.stream}")
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE_REPLICATION_SLOT {} %sLOGICAL pgoutput EXPORT_SNAPSHOT"
                                % ("TEMPORARY " if temporary else "")).format(
                sql.Identifier(f"tm_add_{secrets.token_hex(6)}" if temporary else cfg.source.slot)))
            _, consistent_point, snapshot_name, _ = cur.fetchone()
        lsn = parse_lsn(consistent_point)
    except BaseException:
        conn.close()
        raise
    return conn, lsn, snapshot_name, f"{lsn:016X}-{secrets.token_hex(3)}"


def _take(cfg, ctl, refs, mode, chunk_pages, parallelism, progress, chunk_hook, leases,
          temporary: bool = False) -> SnapshotResult:
    """Create the slot (the stream's; or a temporary one: tables added or re-snapshotted online, the
    stream's positions do not move), copy ``refs`` under its snapshot, write the manifest and complete
    the snapshot; after a failure mark it failed, remove its files (and drop the stream's slot)."""
    store = landing_store(cfg)
    _clear_dead(cfg, ctl, store)
    repl, lsn, snapshot_name, snapshot_id = _create_slot(cfg, temporary=temporary)
    try:
        ctl.snapshot_started(cfg.stream, snapshot_id, lsn, mode)
    except BaseException:
        repl.close()
        if not temporary:
            drop_slot(cfg)
        raise
    try:
        plans = plan_tables(cfg, snapshot_name, refs, chunk_pages) if refs else []
        if mode == "resend":   # the lake is compared with the source by key ranges: only those that differ are copied
            ranges.compare(cfg, snapshot_name, plans, parallelism)
        copy_all(cfg, ctl, store, snapshot_id, snapshot_name, plans, parallelism, progress, chunk_hook)
        repl.close()   # every chunk is copied: the exported snapshot (and a temporary slot) may go
        tables = {p.ref.qualified: {"rows": p.rows, "files": [k for _, k in sorted(p.files.items())],
                                    "table_schema": p.schema.to_json(), "attnums": p.attnums,
                                    "published": p.published, **({"ranges": p.ranges} if p.ranges else {})}
                  for p in plans}
        _check_range_copies(cfg, snapshot_id, tables)
        manifest = {"snapshot_id": snapshot_id, "stream": cfg.stream, "lsn": lsn, "mode": mode, "tables": tables}
        uri, _ = put_if_absent(store, manifest_key(cfg.stream, snapshot_id),
                               json.dumps(manifest, indent=1, sort_keys=True).encode())
        for lease in leases:
            lease.confirm(f"complete snapshot {snapshot_id}")
        left_out = []
        if temporary:       # the tables capture from their own consistent point
            ctl.snapshot_tables_complete(cfg.stream, snapshot_id, lsn, tables)
        else:               # the stream's positions move to the new consistent point
            ctl.snapshot_complete(cfg.stream, snapshot_id, lsn, tables)
            left_out = sorted(t.qualified for t in cfg.source.tables if t.qualified not in tables) if refs else []
        if left_out:      # their rows were not copied: they wait for their own snapshot (mode add)
            ctl.set_table_states(cfg.stream, left_out, "awaiting_snapshot")
    except BaseException as exc:
        repl.close()
        _abandon(cfg, ctl, store, snapshot_id, str(exc), drop=not temporary)
        raise
    return SnapshotResult(snapshot_id=snapshot_id, lsn=lsn, tables={t: d["rows"] for t, d in tables.items()},
                          manifest_uri=uri, waiting=left_out,
                          copies={} if temporary else {t: ranges.summary(d) for t, d in tables.items()})


def _check_range_copies(cfg: StreamConfig, snapshot_id: str, tables: dict) -> None:
    """A table copied by key ranges must have copied exactly the rows its checksums counted there."""
    for table, entry in tables.items():
        r = entry.get("ranges") or {}
        if "copied" in r and r["rows_expected"] != entry["rows"]:
            raise SnapshotError(f"stream {cfg.stream}: snapshot {snapshot_id}: table {table}: the key ranges that "
                                f"differ hold {r['rows_expected']} rows by their checksums but {entry['rows']} were "
                                "copied")


def _abandon(cfg: StreamConfig, ctl: Control, store: Store, snapshot_id: str, reason: str, *, drop: bool) -> None:
    """After a failure: mark the snapshot failed, drop the stream's slot (``drop``), remove its files
    (best effort each, so that the original error is the one raised)."""
    for step in (lambda: ctl.snapshot_failed(cfg.stream, snapshot_id, reason),
                 (lambda: drop_slot(cfg)) if drop else (lambda: None),
                 lambda: discard_files(store, cfg.stream, snapshot_id)):
        with contextlib.suppress(Exception):
            step()


def _clear_dead(cfg: StreamConfig, ctl: Control, store: Store) -> None:
    """Snapshots of the stream a killed process left ``running`` (the caller holds a snapshot lease,
    which excludes every other snapshot of the stream, so none of them is still copying): marked
    failed, their files removed, so the control database and the landing store say what happened."""
    for snapshot_id in ctl.running_snapshots(cfg.stream):
        ctl.snapshot_failed(cfg.stream, snapshot_id, "its process died before it finished (found by the next "
                                                     "snapshot, which starts over)")
        discard_files(store, cfg.stream, snapshot_id)
        log.warning("stream %s: snapshot %s was left running by a process that died: marked failed, its files "
                    "removed", cfg.stream, snapshot_id)


# -- reading a snapshot back (consolidation, tests) ------------------------------------------------

def load_manifest(store: Store, stream: str, snapshot_id: str) -> dict:
    """The manifest of a landed snapshot."""
    return json.loads(store.get(manifest_key(stream, snapshot_id)))


def read_snapshot_table(store: Store, manifest: dict, table: str):
    """All rows of one table of a snapshot as one Arrow table (lake schema); checks the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    entry = manifest["tables"][table]
    schema = arrow_schema(TableSchema.from_json(entry["table_schema"]))
    parts = [pq.read_table(pa.BufferReader(store.get(k))) for k in entry["files"]]
    out = pa.concat_tables(parts).cast(schema) if parts else schema.empty_table()
    if out.num_rows != entry["rows"]:
        raise SnapshotError(f"snapshot {manifest['snapshot_id']}: table {table} has {out.num_rows} rows in its "
                            f"files but the manifest says {entry['rows']}")
    return out
