"""The one lake writer: every write to the lake goes through this module (`tests/unit/test_one_writer.py`
checks that no other module calls ``deltalake``'s write or transaction API): the tables' commits, loads
and restarts, the changelog's and the histories' commits, ADD COLUMN, the interval changelog's
replacement of a day's rows, and maintenance. Each commit carries the application transaction
``(stream, frontier)`` (`tidemark.lake.committed_frontier` reads it back) and its ``tidemark`` commit
metadata. Executors have already written the Parquet files; the driver adds and removes them in one
transaction, and `discard_uncommitted` deletes a failed attempt's files. `LakeWriter` is this module's
shape, as a second lake format would implement it.
"""

from __future__ import annotations

import contextlib
import json
import math
import time as _time
from typing import Protocol
from urllib.parse import unquote

import pyarrow as pa

from tidemark.errors import LakeFull, says_no_space
from tidemark.lake.delta import BUCKET_COLUMN, committed_frontier, filesystem, open_delta, strip_scheme
from tidemark.landing.store import open_store
from tidemark.lsn import format_lsn


class LakeWriter(Protocol):
    """What a lake format's writer does for the consolidation and maintenance (this module is the
    Delta Lake one). ``actions``: dicts with ``op`` (add/remove), ``path`` (relative to the table),
    ``size``, ``partition`` and ``stats``, as the merge's executors return them; ``dt`` is the
    format's handle of the table as read at the batch's start (None: no table yet)."""

    def commit_files(self, uri: str, options: dict | None, dt, schema, actions: list[dict], *, stream: str,
                     frontier: int, desc: str | None = None, partition: str = BUCKET_COLUMN,
                     overwrite: bool = False, operation: str = "consolidate", meta: dict | None = None,
                     data_change: bool = True, change_data: bool = False) -> int:
        """Commit ``actions`` as one version carrying ``(stream, frontier)``; return the version."""

    def add_columns(self, dt, fields) -> None:
        """Extend the table's schema with new nullable columns."""

    def replace_where(self, uri: str, options: dict | None, rows, predicate: str) -> None:
        """Replace the rows matching ``predicate`` with ``rows`` in one version."""

    def discard_uncommitted(self, uri: str, options: dict | None, actions: list[dict], *, stream: str,
                            frontier: int) -> list[str]:
        """Delete the files of a failed attempt that no committed version references."""

    def checkpoint_and_vacuum(self, dt, *, retention_hours: int, keep_versions: list[int]) -> list[str]:
        """Table maintenance: checkpoint, delete unreferenced old files and log entries."""

    def set_log_retention(self, dt, seconds: float) -> None:
        """Keep the table's log entries at least ``seconds``."""


def full_schema(schema, partition: str = BUCKET_COLUMN):
    """The Delta schema: the source columns plus the partition column."""
    part_type = pa.int32() if partition == BUCKET_COLUMN else pa.date32()
    return pa.schema(list(schema) + [pa.field(partition, part_type)])


def commit_files(uri: str, options: dict | None, dt, schema, actions: list[dict], *, stream: str, frontier: int,
                 desc: str | None = None, partition: str = BUCKET_COLUMN, overwrite: bool = False,
                 operation: str = "consolidate", meta: dict | None = None, data_change: bool = True,
                 change_data: bool = False) -> int:
    """Commit ``actions`` (dicts with op/path/size/partition/stats) as one Delta version; return it.
    ``meta``: more of what the version did, in its commit metadata beside the operation;
    ``data_change=False``: the version rearranges files and changes no row (a compaction);
    ``change_data``: the actions' ``cdc`` entries (`_change_data` files the merge wrote) are every
    row the version changes (Delta's change data feed, `CHANGE_FEED`, on for every table partitioned
    by ``_bucket``), written by `log_commit` (deltalake's transaction API takes no ``cdc`` action).
    A full disk is a `tidemark.errors.LakeFull` naming the table."""

    try:
        if change_data and dt is not None and not overwrite:
            return _commit_changes(uri, options, dt, schema, actions, stream=stream, frontier=frontier, desc=desc,
                                   partition=partition, operation=operation, meta=meta)
        cdc = [a for a in actions if a["op"] == "cdc"]
        if cdc:     # a new table's first version: its rows are its files' (inserts); an overwrite's likewise
            discard_files(uri, options, [a["path"] for a in cdc])
            actions = [a for a in actions if a["op"] != "cdc"]
        return _commit_files(uri, options, dt, schema, actions, stream=stream, frontier=frontier, desc=desc,
                             partition=partition, overwrite=overwrite, operation=operation, meta=meta,
                             data_change=data_change)
    except Exception as exc:
        if isinstance(exc, LakeFull) or not says_no_space(exc):
            raise
        raise LakeFull.at(uri, what="a Delta commit of") from exc


def _commit_files(uri: str, options: dict | None, dt, schema, actions: list[dict], *, stream: str, frontier: int,
                  desc: str | None, partition: str, overwrite: bool, operation: str, meta: dict | None,
                  data_change: bool) -> int:
    from deltalake import Schema
    from deltalake.transaction import (AddAction, CommitProperties, RemoveAction, Transaction,
                                       create_table_with_add_actions)

    ts = int(_time.time() * 1000)
    adds = [AddAction(a["path"], int(a["size"]), {partition: a["partition"]}, ts, data_change, a["stats"] or "{}")
            for a in actions if a["op"] == "add"]
    removes = [RemoveAction(a["path"], data_change, ts, int(a["size"]) if a["size"] is not None else None,
                            {partition: a["partition"]}) for a in actions if a["op"] == "remove"]
    props = CommitProperties(app_transactions=[Transaction(stream, frontier)],
                             custom_metadata={"tidemark": {"stream": stream, "frontier": frontier,
                                                           "operation": operation, **(meta or {})}})
    full = full_schema(schema, partition)
    if dt is None:
        create_table_with_add_actions(uri, Schema.from_arrow(full), adds, mode="error", partition_by=[partition],
                                      description=desc, storage_options=options, commit_properties=props,
                                      configuration=CHANGE_FEED if partition == BUCKET_COLUMN else None)
    else:
        if partition == BUCKET_COLUMN:
            enable_change_feed(dt)
        if desc is not None and dt.metadata().description != desc and not overwrite:
            dt.alter.set_table_description(desc)
        if overwrite:
            dt.create_write_transaction(adds, mode="overwrite", schema=full, partition_by=[partition],
                                        commit_properties=props)
            if desc is not None:
                dt = open_delta(uri, options)
                if dt.metadata().description != desc:
                    dt.alter.set_table_description(desc)
        else:
            dt.create_write_transaction([*adds, *removes], mode="append", schema=full, partition_by=[partition],
                                        commit_properties=props)
            dt.update_incremental()       # the log's new entries only (a concurrent writer's too)
            return dt.version()
    return open_delta(uri, options).version()


# -- Delta's change data feed ------------------------------------------------------------------------------
# On for every table partitioned by ``_bucket``. A version whose rows changed carries them as ``cdc``
# actions: `_change_data` Parquet files (the table's columns and ``_change_type``: insert /
# update_preimage / update_postimage / delete) written by the merge beside the table's files.
CHANGE_FEED = {"delta.enableChangeDataFeed": "true"}
CHANGE_DIR = "_change_data"
LOG_CHECKPOINT_EVERY = 100       # a checkpoint every this many versions (deltalake's default interval)


class CommitConflict(Exception):
    """Another writer's version took the one this commit meant to write and touches what it touches."""


def enable_change_feed(dt) -> None:
    """Turn Delta's change data feed on for a table written before it was (deltalake raises the
    table's protocol to writer version 4, which it needs): a version of its own, before the batch's."""
    if (dt.metadata().configuration or {}).get("delta.enableChangeDataFeed") != "true":
        dt.alter.set_table_properties(CHANGE_FEED)
        dt.update_incremental()


def _commit_changes(uri: str, options: dict | None, dt, schema, actions: list[dict], *, stream: str, frontier: int,
                    desc: str | None, partition: str, operation: str, meta: dict | None) -> int:
    """A batch's version with its change data (`log_commit`): add, remove and cdc actions, the
    application transaction, the commit info and, for a new description or schema, the metadata."""
    from deltalake import Schema

    enable_change_feed(dt)
    ts = int(_time.time() * 1000)
    changed = any(a["op"] == "cdc" for a in actions)    # no cdc file: the rewrites changed no row
    entries: list[dict] = []
    full = Schema.from_arrow(full_schema(schema, partition))
    m = dt.metadata()
    new_columns = [f.name for f in full.fields] != [f.name for f in dt.schema().fields]
    if (desc is not None and m.description != desc) or new_columns:
        entries.append({"metaData": {
            "id": m.id, "name": m.name, "description": desc if desc is not None else m.description,
            "format": {"provider": "parquet", "options": {}},
            "schemaString": (full if new_columns else dt.schema()).to_json(),
            "partitionColumns": list(m.partition_columns), "createdTime": m.created_time,
            "configuration": dict(m.configuration or {})}})
    entries.append({"txn": {"appId": stream, "version": int(frontier), "lastUpdated": ts}})
    for a in actions:
        pv = {partition: a["partition"]}
        if a["op"] == "add":
            entries.append({"add": {"path": a["path"], "partitionValues": pv, "size": int(a["size"]),
                                    "modificationTime": ts, "dataChange": changed, "stats": a["stats"] or "{}"}})
        elif a["op"] == "remove":
            rm = {"path": a["path"], "deletionTimestamp": ts, "dataChange": changed, "extendedFileMetadata": True,
                  "partitionValues": pv}
            if a["size"] is not None:
                rm["size"] = int(a["size"])
            entries.append({"remove": rm})
        elif a["op"] == "cdc":
            entries.append({"cdc": {"path": a["path"], "partitionValues": pv, "size": int(a["size"]),
                                    "dataChange": False}})
    info = {"timestamp": ts, "operation": "MERGE", "operationParameters": {"predicate": json.dumps(operation)},
            "readVersion": dt.version(), "isolationLevel": "Serializable", "isBlindAppend": False,
            "engineInfo": "tidemark", "operationMetrics": {
                "numTargetFilesAdded": sum(a["op"] == "add" for a in actions),
                "numTargetFilesRemoved": sum(a["op"] == "remove" for a in actions),
                "numCdcFiles": sum(a["op"] == "cdc" for a in actions)},
            "tidemark": {"stream": stream, "frontier": frontier, "operation": operation, **(meta or {})}}
    version = log_commit(uri, options, dt.version() + 1, [{"commitInfo": info}, *entries], stream=stream,
                         frontier=frontier)
    dt.update_incremental()
    if version % LOG_CHECKPOINT_EVERY == 0:
        dt.create_checkpoint()
    return version


def log_commit(uri: str, options: dict | None, version: int, entries: list[dict], *, stream: str,
               frontier: int) -> int:
    """Write ``entries`` (Delta log actions) as the table's version ``version`` (or, if another writer
    took it and touched nothing this commit touches, the next free one); return the version written.

    The entry is put only if absent (`Store.create`: atomic, locally and on S3). A lost race re-reads
    the winner: our own commit of ``(stream, frontier)`` (a retried put that went through) is this one;
    a winner that changes the table's metadata or protocol, carries this stream's application
    transaction, removes a file this commit removes, or changes rows of a partition this commit
    writes is a `CommitConflict`; any other one is passed over (docs/reading-the-lake.md)."""
    body = ("\n".join(json.dumps(e, separators=(",", ":")) for e in entries) + "\n").encode()
    removed = {e["remove"]["path"] for e in entries if "remove" in e}
    parts = {json.dumps(e[k]["partitionValues"], sort_keys=True) for e in entries for k in ("add", "remove", "cdc")
             if k in e}
    for _ in range(1000):
        name = f"_delta_log/{version:020d}.json"
        if _put_if_absent(uri, options, name, body):
            return version
        winner = [json.loads(line) for line in _log_store(uri, options).get(name).decode().splitlines()
                  if line.strip()]
        txn = next((e["txn"] for e in winner if "txn" in e and e["txn"].get("appId") == stream), None)
        if txn is not None and int(txn["version"]) >= frontier:
            return version                    # this commit, put before (a retry after a lost answer)
        why = None
        for e in winner:
            if "metaData" in e or "protocol" in e:
                why = "changed the table's metadata or protocol"
            elif txn is not None:
                why = f"committed stream {stream!r} to frontier {format_lsn(txn['version'])}"
            elif "remove" in e and e["remove"]["path"] in removed:
                why = f"removed {e['remove']['path']}, which this commit removes too"
            elif any(k in e and e[k].get("dataChange", True) and
                     json.dumps(e[k]["partitionValues"], sort_keys=True) in parts for k in ("add", "remove")):
                why = "changed rows of a partition this commit writes"
            if why:
                raise CommitConflict(f"lake table {uri}: version {version} was written by another writer while "
                                     f"stream {stream!r} committed frontier {format_lsn(frontier)} (it {why}); only the "
                                     "stream's lease holder writes its tables: is a second consolidation running?")
        version += 1
    raise CommitConflict(f"lake table {uri}: no free version found after {version}")


def _log_store(uri: str, options: dict | None):
    """The table's directory as a store (`tidemark.landing.store`), with the lake's endpoint and region."""
    opts = options or {}
    return open_store(uri, endpoint_url=opts.get("AWS_ENDPOINT_URL"), region=opts.get("AWS_REGION"))


def _put_if_absent(uri: str, options: dict | None, name: str, body: bytes) -> bool:
    """Put ``body`` at ``name`` under the table unless something is there (atomically: `Store.create`);
    whether it was put."""
    return _log_store(uri, options).create(name, body)


def discard_files(uri: str, options: dict | None, paths: list[str]) -> None:
    """Delete files (relative to the table) that no version references (best effort: a vacuum
    removes what is left)."""
    fs = filesystem(uri, options)
    base = strip_scheme(uri)
    for path in paths:
        with contextlib.suppress(OSError):
            fs.delete_file(base + "/" + path)


def checkpoint_and_vacuum(dt, *, retention_hours: int, keep_versions: list[int]) -> list[str]:
    """Table maintenance (`tidemark.maintain`): write a checkpoint of the current version, delete the
    files that neither the current version, nor a version removed less than ``retention_hours`` ago,
    nor any of ``keep_versions`` references (VACUUM, full: files no version lists are deleted too,
    once older than the retention: a killed attempt's), and the log entries older than the table's
    log retention (``delta.logRetentionDuration``, 30 days unless set) that a checkpoint makes unneeded.
    Return the deleted files (relative paths). The caller holds the stream's lease: nothing else writes
    the table meanwhile."""
    dt.create_checkpoint()
    gone = dt.vacuum(retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False, full=True,
                     keep_versions=sorted(set(keep_versions)) or None)
    dt.cleanup_metadata()
    return list(gone)


def set_log_retention(dt, seconds: float) -> None:
    """Keep the table's log entries at least ``seconds`` (``delta.logRetentionDuration``): a version
    inside the retention window must stay loadable after a log clean-up."""
    want = f"interval {math.ceil(seconds)} seconds"
    if (dt.metadata().configuration or {}).get("delta.logRetentionDuration") != want:
        dt.alter.set_table_properties({"delta.logRetentionDuration": want})


def add_columns(dt, fields) -> None:
    """Extend the table's schema with new (nullable) columns (ADD COLUMN in the source)."""
    from deltalake import Schema

    delta_fields = Schema.from_arrow(pa.schema(fields)).fields
    dt.alter.add_columns(list(delta_fields))


def replace_where(uri: str, options: dict | None, rows, predicate: str) -> None:
    """Replace the rows of the table at ``uri`` that ``predicate`` (a SQL condition) matches with
    ``rows`` (a `pyarrow.Table` in the table's schema) in one Delta version: the interval changelog's
    rebuild of a day's rows (`tidemark.consolidate.interval`)."""
    from deltalake import write_deltalake

    write_deltalake(uri, rows, mode="overwrite", predicate=predicate, storage_options=options)


def discard_uncommitted(uri: str, options: dict | None, actions: list[dict], *, stream: str,
                        frontier: int) -> list[str]:
    """After a failed attempt, delete the files it added that no committed version references.

    The Delta log is re-read first: if the attempt's commit went through (the table's application
    transaction for ``stream`` reached ``frontier``) nothing is deleted, and neither is any file the
    current version references. If the log cannot be read, nothing is deleted (unreferenced files are
    invisible to readers; a vacuum removes them). Return the deleted paths."""
    added = [a["path"] for a in actions if a["op"] in ("add", "cdc")]
    if not added:
        return []
    try:
        dt = open_delta(uri, options)
        done = committed_frontier(dt, stream)
        if done is not None and done >= frontier:
            return []
        keep = set(pa.table(dt.get_add_actions(flatten=True)).column("path").to_pylist() if dt is not None else [])
    except Exception:   # noqa: BLE001 - the log is unreadable now: deleting anything could lose a commit
        return []
    keep |= {unquote(p) for p in keep}
    fs = filesystem(uri, options)
    base = strip_scheme(uri)
    gone = []
    for path in added:
        if path in keep or unquote(path) in keep:
            continue
        with contextlib.suppress(OSError):
            fs.delete_file(base + "/" + path)
            gone.append(path)
    return gone


@contextlib.contextmanager
def discard_on_failure(uri: str, options, actions: list[dict], *, stream: str, frontier: int):
    """If anything fails, delete the files this attempt added that no committed version references
    (`discard_uncommitted` re-reads the Delta log first: an exception raised after the commit went
    through — a later read, an interrupt, a storage hiccup — must not delete committed files)."""
    try:
        yield
    except BaseException:
        discard_uncommitted(uri, options, actions, stream=stream, frontier=frontier)
        raise
