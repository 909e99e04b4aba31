"""Stage 5 of a batch (`CommitResult`, `commit_tables`): the merge's outcome committed, a few tables at
a time, each its changelog, then its files (app transaction ``(stream, F)``), then its folded history.
"""

from __future__ import annotations

import time as _time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping

from tidemark.consolidate import history
from tidemark.consolidate.batch import MergeOutcome, _changes
from tidemark.consolidate.cdc_file import Written
from tidemark.consolidate.changelog import commit_changelog
from tidemark.consolidate.failure import for_table
from tidemark.consolidate.plan import phase
from tidemark.consolidate.prepare import Prepared
from tidemark.lake import table_info, writer as _commit
from tidemark.lake.delta import table_description
from tidemark.lake.scd2 import log_schema
from tidemark.landing.store import landing_store

COMMIT_THREADS = 4


@dataclass(frozen=True)
class CommitResult:
    """Stage 5's result: every table of the batch at its frontier."""

    done: Mapping[str, tuple[int, int | None]]   # table -> (rows changed, its new version or None)
    # table -> what its new version did: rows inserted, updated, deleted (and ``snapshot_rows``)
    changes: Mapping[str, Mapping[str, int]]
    history: Mapping[str, int]     # table -> its history's version the merge job committed
    merged: tuple[str, ...]        # the tables whose changelog this batch committed (the others: `advance_feeds`)
    snapshots_loaded: tuple[str, ...]   # the snapshots every table of which this batch took


def commit_tables(outcome: MergeOutcome) -> CommitResult:
    """Commit the merged tables of ``outcome`` (`_commit_tables`); the batch's result."""
    prep = outcome.prep
    done = {t: p.loaded for t, p in prep.tables.items() if p.shape is None}
    kept = {}
    for table, (changed, version, hist) in _commit_tables(outcome).items():
        rows, loaded_version = outcome.tables[table].loaded
        done[table] = (changed + rows, version if version is not None else loaded_version)
        if hist is not None:
            kept[table] = hist
    changes = {t: outcome.changes[t] if t in outcome.changes else _changes([], p.loaded)
               for t, p in prep.tables.items()}
    return CommitResult({t: done[t] for t in prep.tables}, changes, kept, prep.merging,
                        tuple(prep.snapshots_loaded()))


def _commit_tables(outcome: MergeOutcome) -> dict:
    """Commit each merged table (`_commit_table`), several at once; {table: (rows changed, its version,
    its history's)}. Every commit is let finish before the first failed table's error (in batch order,
    naming it: `failure.for_table`) is raised."""
    ready, prepared, run = outcome.acts, outcome.tables, outcome.run
    if not ready:
        return {}
    store = landing_store(outcome.prep.decoded.cfg)
    if len(ready) == 1:
        (table, acts), = ready.items()
        with for_table(table):
            return {table: _commit_table(outcome, prepared[table], acts, store, run)}
    t0 = _time.perf_counter()
    with ThreadPoolExecutor(min(COMMIT_THREADS, len(ready)), thread_name_prefix="tidemark-commit") as pool:
        futures = {t: pool.submit(_commit_table, outcome, prepared[t], acts, store, run, timed=False)
                   for t, acts in ready.items()}
    phase(f"commit tables (changelog + Delta, {min(COMMIT_THREADS, len(ready))} threads)",
          _time.perf_counter() - t0)
    for table, fut in futures.items():
        if fut.exception() is not None:
            with for_table(table):
                raise fut.exception()
    return {t: fut.result() for t, fut in futures.items()}


def _commit_table(outcome: MergeOutcome, p: Prepared, acts: list[dict], store, run: str, timed: bool = True
                  ) -> tuple[int, int | None, int | None]:
    """Commit one table's merged groups: its changelog, then its files, then its folded history; (rows
    changed, its new version or None, its history's or None). Thread-safe; ``timed``: record its phases."""
    import numpy as np

    cfg, options = outcome.prep.decoded.cfg, outcome.prep.decoded.options
    t0 = _time.perf_counter()
    table_acts = [a for a in acts if a["target"] == "table" and a["op"] in ("add", "remove", "cdc")]
    desc = table_description(p.uri, options, cfg.stream, p.table, p.buckets, p.shape.to_json(),
                             missing=p.missing, attnums=p.attnums)
    lp = p.log_plan
    written = None
    if lp is not None:
        parts = [a for a in acts if a["target"] == "cdc" and a["op"] == "part"]
        halves = [np.frombuffer(a["log"], np.int64).reshape(2, -1) for a in parts]     # (times, counts) each
        written = Written(lo=lp.lo, sync=lp.sync, codec=lp.codec, files=[a for a in acts if a["target"] == "changelog"],
                          parts=[a["path"] for a in parts],
                          times=np.concatenate([np.zeros(0, np.int64), *(h[0] for h in halves)]),
                          counts=np.concatenate([np.zeros(0, np.int64), *(h[1] for h in halves)]))
    hist_acts = [a for a in acts if a["target"] == "history"]
    try:
        with _commit.discard_on_failure(p.uri, options, table_acts, stream=cfg.stream,
                                        frontier=p.frontier):
            changed = commit_changelog(cfg, p.table, p.target, log_schema(p.target).empty_table(), p.lower,
                                       p.frontier, options=options, base=p.base, store=store,
                                       lake_at=p.lake_at, dt=p.log_dt, written=written, run=run,
                                       renamed=p.renames)
            if timed:
                phase("changelog commit (CDC file + Delta)", _time.perf_counter() - t0)
            t0 = _time.perf_counter()
            version = None
            if table_acts or p.dt is None or table_info(p.dt).get("table_schema") != p.shape.to_json() \
                    or table_info(p.dt).get("missing_values", {}) != p.missing:
                version = _commit.commit_files(p.uri, options, p.dt, p.target, table_acts,
                                               stream=cfg.stream, frontier=p.frontier, desc=desc,
                                               change_data=True)
                if timed:
                    phase("table commit (Delta)", _time.perf_counter() - t0)
    except BaseException:
        if p.history is not None:     # the history files the merge wrote go with the table's
            _commit.discard_uncommitted(p.history[0].uri, options, hist_acts, stream=cfg.stream,
                                        frontier=p.frontier)
        raise
    kept = None
    if p.history is not None:
        # after the table's and changelog's commits (`history.keep_histories` catches up a history left behind)
        t0 = _time.perf_counter()
        spec, hdt = p.history
        kept = history.commit_merged(cfg, spec, hdt, hist_acts, options)
        if timed:
            phase("history: commit (Delta, folded in the merge job)", _time.perf_counter() - t0)
    return changed, version, kept
