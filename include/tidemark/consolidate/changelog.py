"""The consolidated changelog: every committed change at its own time, with full row images
(docs/segment-format.md: "The changelog feed", "Snapshots, the lake and the changelog").

Per table, the same rows in two forms: a Delta table ``{lake}/{stream}/changelog/{table}`` (the
table's columns plus ``_time``, ``_diff``, ``_commit_ts`` and the partition ``_commit_date``) and a
Materialize CDC file per committed range in the landing store (`cdc_file`, `feed_files`, `bases`).
Each range ``[lo, F)`` is committed once with ``(stream, F)``, ``lo`` the changelog's own committed
frontier, so a re-run never adds a time twice; its CDC file is published only after that commit.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pyarrow.compute as pc

from tidemark.consolidate import feed_files
from tidemark.consolidate.bases import feed_base, has_new_base, may_have_new_base
from tidemark.consolidate.cdc_file import Written, write_feed_file
from tidemark.consolidate.feed_files import changelog_key
from tidemark.consolidate.log_evolution import (RESTART_OPERATION, UNREAD, evolve_log_schema, log_type_change,
                                               write_log_files)
from tidemark.errors import ChangelogError
from tidemark.lake import changelog_uri, committed_frontier, exact_schema, open_delta, table_uri, writer as _commit
from tidemark.lake.scd2 import log_schema
from tidemark.landing.store import landing_store


def commit_changelog(cfg, table: str, target, rows, lower: int, frontier: int, *, options=None,
                     base: str | None = None, store=None, lake_at=UNREAD, dt=UNREAD,
                     written: Written | None = None, run: str | None = None, renamed: dict | None = None) -> int:
    """Commit a batch's exact changelog once: the times in ``[lo, frontier)``, ``lo`` = the
    changelog's own committed frontier (or ``lower``), as one Delta commit with the application
    transaction ``(stream, frontier)`` (also when empty, so ``lo`` always is where the previous
    commit ended) and the Materialize CDC file of the range, published only after that commit.
    Return the rows committed (0: already done).

    The rows come either as ``rows`` (an Arrow table on the driver) or as ``written`` by the
    executors (Parquet files and CDC parts, framed into the file one part at a time). ``store``: the
    landing store (opened here if None); ``lake_at``: the lake table's committed frontier and ``dt``:
    the changelog Delta table (None: none yet), when the caller has just read them (`UNREAD`: read
    here); ``run``: the attempt whose parts are in use (other attempts' parts are deleted);
    ``renamed``: columns renamed in the source before this range (old -> new), said in the CDC file's
    header (``tidemark.renamed``)."""
    uri = changelog_uri(cfg, table)
    if dt is UNREAD:
        dt = open_delta(uri, options)
    if store is None:
        store = landing_store(cfg)
    done = committed_frontier(dt, cfg.stream)
    waiting = feed_files.settle(store, cfg.stream, table, done, keep_run=run)
    if done is not None and done >= frontier:
        return 0
    restart = log_type_change(dt, target)
    if restart is not None and base is None and not has_new_base(cfg, table, done, options, lake_at):
        restart = None      # no snapshot load to restart at: `evolve_log_schema` says what is wrong
    if restart is None:
        dt = evolve_log_schema(uri, options, dt, target, table)
    lo = lower if done is None else max(lower, done)
    if written is not None and written.lo != lo:
        raise ChangelogError(f"table {table}: the executors wrote the changelog from {written.lo}, but it is "
                             f"committed up to {lo} now (another consolidation ran meanwhile?)")
    meta = _feed_meta(lo, frontier, base if base is not None else "" if dt is None else None, renamed,
                      restart and f"{restart}: the changelog restarts at this base with the table's new types; its "
                      f"rows before {lo} are in Delta version {dt.version()} (time travel)")
    may = bool(waiting) or may_have_new_base(cfg, table, done, options, lake_at)
    since, feed_lo, head, key_lo, wait = feed_base(cfg, table, target, options, done=done, lo=lo, frontier=frontier,
                                                   waiting=waiting, restart=restart is not None, may=may)
    key = changelog_key(cfg.stream, table, key_lo, frontier)
    feed_files.discard_uncommitted_cdc(store, cfg.stream, table, done, keep=key)
    if written is None:
        rows = rows.filter(pc.greater_equal(rows.column("_time"), lo))
        files = write_log_files(uri, options, rows, tag=f"{frontier:016X}-{uuid.uuid4().hex[:12]}")
        n_rows = rows.num_rows
    else:
        files = list(written.files)
        n_rows = int(np.sum(written.counts)) if written.counts is not None and len(written.counts) else 0
    pending = feed_files.pending_key(cfg.stream, table, key_lo, frontier)
    if wait is not None:
        store.put(feed_files.base_marker(cfg.stream, table, wait), b"")
    try:
        write_feed_file(store, pending, table, target, rows=rows if written is None else None,
                        written=written, head=head, lower=feed_lo, upper=frontier, since=since,
                        metadata=meta,
                        codec=written.codec if written is not None else cfg.landing.codec)
        _commit.commit_files(uri, options, dt, log_schema(target), files, stream=cfg.stream, frontier=frontier,
                             partition="_commit_date", overwrite=restart is not None,
                             operation="changelog" if restart is None else RESTART_OPERATION)
    except BaseException:   # delete only what no committed version references (the commit may have happened)
        _commit.discard_uncommitted(uri, options, files, stream=cfg.stream, frontier=frontier)
        raise
    feed_files.publish(store, pending, key)
    # a base marked pending is in this file now (its time is below the frontier), unless a newer base
    # waits for the next range (a resend loaded before the earlier base reached any file): that one is
    # then the difference from what the feed holds, so the earlier marker says where the feed stands
    for at in waiting if wait is None else ():
        if at < frontier:
            store.delete(feed_files.base_marker(cfg.stream, table, at))
    if written is not None:
        for part in written.parts:
            store.delete(part)
    return n_rows


def _feed_meta(lo: int, frontier: int, base: str | None, renamed: dict | None, restart: str | None) -> dict:
    """The CDC file's header of the range ``[lo, frontier)``: ``base`` (None: none; "": the lake version
    at ``lo``, the changelog's start), the columns ``renamed`` before it, and why it ``restart``s."""
    meta = {"tidemark.lower": str(lo), "tidemark.upper": str(frontier)}
    if base is not None:
        meta["tidemark.base"] = base or (f"the lake version at {lo}: rows present then (its snapshot) are not "
                                         "in this changelog")
    if renamed:
        meta["tidemark.renamed"] = json.dumps(renamed, sort_keys=True)
    if restart:
        meta["tidemark.restart"] = restart
    return meta


def advance_feeds(cfg, frontier: int, *, options=None, frontiers: dict[str, int] | None = None,
                  committed=(), opened: dict | None = None) -> list[str]:
    """Commit an empty changelog (progress only) to ``frontier`` for every captured table whose lake
    table exists but whose changelog is behind (idle in this batch, or only its snapshot loaded), so
    every table's feed advances on every batch. Return the tables advanced. ``frontiers``: each
    table's own frontier (an external feed's tables), instead of ``frontier``; ``committed``: tables
    whose lake table and changelog this run committed at their frontier (nothing to look at);
    ``opened``: lake tables the caller opened and nothing has committed to since (not reopened)."""
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
        commit_changelog(cfg, table, target, log_schema(target).empty_table(), at, upto, options=options)
        done.append(table)
    return done
