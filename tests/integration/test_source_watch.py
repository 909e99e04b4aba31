"""The source watcher behind the event-driven drain (`tidemark_airflow.triggers`, `tidemark.capture.watch`),
against a real PostgreSQL: it fires on a committed change to the stream's tables (a TRUNCATE too), not
while the source is idle nor on WAL that is not the stream's (another table, another database, a
rolled-back transaction's WAL position), and a busy source gets one event per ``min_interval`` rather
than one per transaction."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import psycopg2
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))

from tidemark.capture.watch import Debouncer  # noqa: E402
from tidemark_airflow.triggers import CLASSPATH, TidemarkSourceChangesTrigger  # noqa: E402


def _stream_file(cfg, tmp_path) -> str:
    """The stream file the trigger reads (it takes a path, as the DAG gives it)."""
    doc = {"stream": cfg.stream,
           "source": {"connection": cfg.source.connection, "publication": cfg.source.publication,
                      "slot": cfg.source.slot, "tables": [t.qualified for t in cfg.source.tables]},
           "control": {"connection": cfg.control_connection},
           "landing": {"url": cfg.landing.url}, "lake": {"path": cfg.lake_path}}
    path = tmp_path / f"{cfg.stream}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


class Watch:
    """Run the trigger in a thread's event loop; ``events`` collects what it fires, with times."""

    def __init__(self, trigger):
        import threading

        self.trigger, self.events, self.loop = trigger, [], asyncio.new_event_loop()
        self.task = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        async def consume():
            async for event in self.trigger.run():
                self.events.append((time.monotonic(), event.payload))

        self.task = self.loop.create_task(consume())
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass

    def stop(self):
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)


@pytest.fixture
def watched(make_stream, source_conn, tmp_path):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
        cur.execute("CREATE TABLE other (id int PRIMARY KEY)")
    cfg = make_stream(["public.items"])
    trigger = TidemarkSourceChangesTrigger(stream_file=_stream_file(cfg, tmp_path), poll_seconds=0.3,
                                           min_interval_seconds=2.0)
    watch = Watch(trigger)
    time.sleep(1.0)           # its first look is the baseline
    yield cfg, watch
    watch.stop()


def _wait(watch, count: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(watch.events) >= count:
            return True
        time.sleep(0.1)
    return False


def _commit(dsn: str, statement: str, params=None) -> None:
    """One transaction on a connection of its own (its statistics reach the server when it ends)."""
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(statement, params)
    finally:
        conn.close()


def test_fires_on_a_committed_change_and_not_while_idle(watched, source_db, control_dsn):
    cfg, watch = watched
    # idle, while the cluster's WAL moves for other reasons: another table, another database, a rollback
    _commit(source_db, "INSERT INTO other SELECT generate_series(1, 100)")
    _commit(control_dsn, "CREATE TABLE IF NOT EXISTS watch_noise (x int); INSERT INTO watch_noise VALUES (1)")
    conn = psycopg2.connect(source_db)
    with conn.cursor() as cur:
        cur.execute("SELECT pg_switch_wal()")
    conn.close()
    time.sleep(2.5)
    assert watch.events == [], "the watcher fired on WAL that is not the stream's tables' changes"

    started = time.monotonic()
    _commit(source_db, "INSERT INTO items VALUES (1, 'a')")
    assert _wait(watch, 1, 5.0), "a committed insert into a stream table fired no event within 5 s"
    assert watch.events[0][0] - started < 3.0
    assert watch.events[0][1] == {"stream": cfg.stream, "events": 1}
    time.sleep(2.5)
    assert len(watch.events) == 1, "one change, one event"

    _commit(source_db, "TRUNCATE items")            # no row counter moves: the file node does
    assert _wait(watch, 2, 5.0), "a TRUNCATE of a stream table fired no event"


def test_a_busy_source_is_debounced(watched, source_db):
    cfg, watch = watched
    conn = psycopg2.connect(source_db)
    conn.autocommit = True
    begun = time.monotonic()
    n = 0
    with conn.cursor() as cur:
        while time.monotonic() - begun < 5.0:     # a transaction every ~20 ms for 5 s
            n += 1
            cur.execute("INSERT INTO items VALUES (%s, 'x')", (n,))
            time.sleep(0.02)
    conn.close()
    time.sleep(2.5)
    times = [t for t, _ in watch.events]
    assert n > 100
    # at once on the first change, then at most one per min_interval (2 s): about 4 over ~6 s, not n
    assert 2 <= len(times) <= 5, (len(times), n)
    assert all(b - a >= 1.9 for a, b in zip(times, times[1:])), times


def test_a_table_added_to_the_running_stream_is_watched(watched, source_db, tmp_path):
    """Tables added to a running stream (the stream file edited, then ``snapshot --mode add``): the
    trigger, started before, reads the file again and fires on the new table's changes too."""
    cfg, watch = watched
    _commit(source_db, "INSERT INTO other VALUES (1)")
    time.sleep(1.5)
    assert watch.events == [], "a table outside the stream fired an event"
    path = Path(watch.trigger.stream_file)
    doc = yaml.safe_load(path.read_text())
    doc["source"]["tables"].append("public.other")
    path.write_text(yaml.safe_dump(doc))
    time.sleep(1.5)                 # the reload itself may fire once (the signature gains a table)
    before = len(watch.events)
    time.sleep(2.5)                 # past min_interval
    _commit(source_db, "INSERT INTO other VALUES (2)")
    assert _wait(watch, before + 1, 5.0), "a change to a table added to the stream file fired no event"
    path.write_text("stream: [broken")        # a half-written edit: the tables watched so far stay
    time.sleep(2.5)
    count = len(watch.events)
    _commit(source_db, "INSERT INTO other VALUES (3)")
    assert _wait(watch, count + 1, 5.0), "a broken edit of the stream file stopped the watcher"


def test_the_trigger_serializes_to_its_plugin_class_path():
    trigger = TidemarkSourceChangesTrigger(stream_file="/x/s.yaml", poll_seconds=2, min_interval_seconds=5)
    assert trigger.serialize() == (CLASSPATH, {"stream_file": "/x/s.yaml", "poll_seconds": 2.0,
                                               "min_interval_seconds": 5.0})
    module, name = CLASSPATH.rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[name]), name) is TidemarkSourceChangesTrigger


def test_debouncer_fires_at_once_after_quiet_then_at_most_once_per_interval():
    now = [0.0]
    d = Debouncer(min_interval=5.0, clock=lambda: now[0])
    assert d.observe(("a",)) is False            # baseline
    assert d.observe(("a",)) is False            # idle
    now[0] = 1.0
    assert d.observe(("b",)) is True             # first change: at once
    now[0] = 2.0
    assert d.observe(("c",)) is False            # within the interval: held
    now[0] = 5.9
    assert d.observe(("c",)) is False
    now[0] = 6.0
    assert d.observe(("c",)) is True             # the held change fires when the interval is over
    now[0] = 20.0
    assert d.observe(("c",)) is False            # nothing new
