"""The source watcher: an Airflow 3 event trigger that fires when the stream's tables have new committed
changes, so that the drain DAG runs on new work instead of on a cron minute.

It runs in the triggerer (asynchronous: one small catalog query every ``poll_seconds`` on one kept
connection, in a thread so the event loop never blocks): `tidemark.capture.watch.change_signature`
reads the tables' change counters, and `tidemark.capture.watch.Debouncer` fires at once after a quiet
spell and at most once per ``min_interval_seconds`` while changes keep coming. An idle source costs one
query per poll and starts nothing. The drain DAG is scheduled on the watched Asset *or* its timed
safety run (`tidemark.schedules.DRAIN_SAFETY_CRON`), which also covers what the counters cannot see
(``track_counts`` off, a watcher that is down). The triggerer loads it from the plugins folder
(``tidemark_airflow.triggers``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

log = logging.getLogger(__name__)

CLASSPATH = "tidemark_airflow.triggers.TidemarkSourceChangesTrigger"


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _reloaded(path: str, cfg):
    """The stream file read again and its tables, logged when they changed."""
    from tidemark.capture.watch import stream_tables
    from tidemark.config import load_config

    new = load_config(path)
    if stream_tables(new) != stream_tables(cfg):
        log.info("stream %s: the stream file changed; watching %s", new.stream, ", ".join(stream_tables(new)))
    return new, stream_tables(new)


class TidemarkSourceChangesTrigger(BaseEventTrigger):
    """Fire a ``{"stream", "events"}`` event when the stream's tables changed (see the module).

    A lost connection is retried every ``poll_seconds`` (logged once per outage): the trigger never
    exits on its own, a source that is down just fires nothing (the safety run's drain reports it).
    The stream file is read again when it changes, so tables added to a running stream are watched."""

    def __init__(self, *, stream_file: str, poll_seconds: float = 2.0, min_interval_seconds: float = 5.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream_file = stream_file
        self.poll_seconds = float(poll_seconds)
        self.min_interval_seconds = float(min_interval_seconds)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return CLASSPATH, {"stream_file": self.stream_file, "poll_seconds": self.poll_seconds,
                           "min_interval_seconds": self.min_interval_seconds}

    async def _dsn(self, conn_id: str) -> str:
        """The source's DSN: ``AIRFLOW_CONN_*`` / ``TIDEMARK_CONN_*`` first, else Airflow's connection
        (looked up asynchronously, as the triggerer requires)."""
        from tidemark.connections import connection_dsn, resolve_dsn
        from tidemark.errors import TidemarkError

        try:
            return resolve_dsn(conn_id)
        except TidemarkError:
            from airflow.sdk import BaseHook

            return connection_dsn(await BaseHook.aget_connection(conn_id))

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import psycopg2

        from tidemark.capture.watch import Debouncer, change_signature, counts_tracked, stream_tables
        from tidemark.config import load_config
        from tidemark.connections import with_connect_timeout
        from tidemark.errors import TidemarkError

        cfg = load_config(self.stream_file)
        tables, seen = stream_tables(cfg), _mtime(self.stream_file)
        debounce = Debouncer(min_interval=self.min_interval_seconds)
        conn, down_since = None, None
        try:
            while True:
                if _mtime(self.stream_file) != seen:
                    # the stream file changed (tables added or removed on the running stream): watch
                    # what it says now; a broken edit keeps the tables watched so far (the DAG file
                    # processor reports the file's error)
                    seen = _mtime(self.stream_file)
                    try:
                        cfg, tables = _reloaded(self.stream_file, cfg)
                    except Exception as exc:  # noqa: BLE001 - any error of a half-written file
                        log.warning("stream %s: the stream file %s could not be read again (%s); watching its "
                                    "tables as before", cfg.stream, self.stream_file, exc)
                try:
                    if conn is None or conn.closed:
                        dsn = await self._dsn(cfg.source.connection)
                        conn = await asyncio.to_thread(psycopg2.connect, with_connect_timeout(dsn),
                                                       application_name=f"tidemark-watch-{cfg.stream}")
                        conn.autocommit = True
                        if not await asyncio.to_thread(counts_tracked, conn):
                            log.warning("stream %s: the source has track_counts off: no change counters to watch; "
                                        "the drain runs on its timed safety schedule only", cfg.stream)
                        if down_since is not None:
                            log.info("stream %s: the source answers again", cfg.stream)
                            down_since = None
                    signature = await asyncio.to_thread(change_signature, conn, tables)
                except (psycopg2.Error, TidemarkError) as exc:   # down, or its connection undefined: retried
                    if down_since is None:
                        down_since = asyncio.get_running_loop().time()
                        log.warning("stream %s: the source cannot be read (%s); retrying every %.0f s", cfg.stream,
                                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                                    self.poll_seconds)
                    if conn is not None:
                        conn.close()
                    conn = None
                else:
                    if debounce.observe(signature):
                        yield TriggerEvent({"stream": cfg.stream, "events": debounce.events})
                await asyncio.sleep(self.poll_seconds)
        finally:
            if conn is not None:
                conn.close()
