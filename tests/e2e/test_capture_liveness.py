"""Liveness of the drain: a walsender busy decoding a huge transaction is waited for, never cut off;
a walsender that makes no progress at all ends the drain with an error, landing nothing.

The huge transaction is 1 M narrow rows decoded with ``logical_decoding_work_mem = 64kB`` (the
walsender spills it to disk and says nothing for seconds before its first row) while a CPU hog
(two busy processes that exit by themselves) competes for the two cores. The drain's idle timeout is
set far below that silence: under the old rule ("silence ends the drain") it landed a
progress-only segment and the stream was stuck behind the transaction.

Profiles: with ``TIDEMARK_NIGHTLY=1`` all 1 M rows are in the captured table. By default (CI) the
same transaction holds 200 k captured rows and 800 k rows of a table outside the publication: the
walsender decodes and spills all 1 M changes before it sends anything (pgoutput filters by
publication only when it replays the transaction at commit), so its silence is as long as in the
nightly case (measured: about 3 s under the hog either way; 200 k rows alone give under 1 s, too short
for a waiting report), while the drain, the consolidation and the comparison handle 200 k rows."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from adversarial_kit import assert_lake_equals_source, consolidate
from tidemark.capture.drain import drain_stream
from tidemark.capture.snapshot import snapshot_stream
from tidemark.control import Control, control_dsn
from tidemark.errors import DrainStalled
from oracle import insert_lsn

pytestmark = [pytest.mark.slow]

NIGHTLY = os.environ.get("TIDEMARK_NIGHTLY") == "1"
ROWS = 1_000_000 if NIGHTLY else 200_000      # captured rows in the huge transaction
PADDING = 0 if NIGHTLY else 800_000           # uncaptured rows in it: the walsender decodes 1 M changes either way
WORK_MEM = "-c logical_decoding_work_mem=64kB"


def _exec(conn, *stmts):
    with conn.cursor() as cur:
        for s in stmts:
            cur.execute(s)


def cpu_hog(seconds: float, procs: int = 2) -> list[subprocess.Popen]:
    """Busy processes that stop by themselves after ``seconds``."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(procs)]


@pytest.mark.spark
def test_huge_transaction_lands_whole_under_load(make_stream, source_conn, spark):
    _exec(source_conn, "CREATE TABLE big (id int PRIMARY KEY)",        # narrow: the cost is the row count
          "CREATE TABLE pad (id int PRIMARY KEY)")                      # not in the stream's publication
    cfg = make_stream(["public.big"], drain={"idle_timeout_seconds": 0.1, "max_changes": 1000},
                      consolidate={"buckets": 2})
    snapshot_stream(cfg)
    _exec(source_conn, "BEGIN", f"INSERT INTO big SELECT generate_series(1, {ROWS})",
          f"INSERT INTO pad SELECT generate_series(1, {PADDING})", "COMMIT")
    _exec(source_conn, "INSERT INTO big VALUES (0)")      # a later transaction: the drain must pass the big one
    target = insert_lsn(cfg)
    reports: list[dict] = []
    hog = cpu_hog(90)
    try:
        started = time.monotonic()
        res = drain_stream(cfg, extra_options=WORK_MEM, progress=reports.append)
        print(f"drain of {ROWS:,} rows (+{PADDING:,} uncaptured) took {time.monotonic() - started:.1f}s")
    finally:
        for p in hog:
            p.kill()
            p.wait()
    # one drain lands everything committed before it started: the huge transaction whole in one segment,
    # max_changes notwithstanding (a transaction is never split), and the small one after it
    assert res.records == ROWS + 1 and res.txns == 2, res
    assert [(s.records, s.txns) for s in res.segments] == [(ROWS, 1), (1, 1)], res
    waiting = [r for r in reports if "waiting" in r]
    assert waiting, "the drain never reported that it waited for the walsender"
    print(f"waited for the walsender up to {max(r['waiting'] for r in waiting):.1f}s ({len(waiting)} reports)")
    assert max(r["decoded"] for r in waiting) > res.lower, "keepalives did not show the walsender's progress"
    drain_stream(cfg, extra_options=WORK_MEM)                 # the small transaction after it
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.stream(cfg.stream).landed_upper >= target
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)


def _slot_pid(conn, slot: str, deadline: float) -> int:
    while time.monotonic() < deadline:
        with conn.cursor() as cur:
            cur.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,))
            row = cur.fetchone()
        if row and row[0]:
            return row[0]
        time.sleep(0.005)
    raise AssertionError(f"slot {slot} never became active")


def test_walsender_without_progress_fails_the_drain_and_lands_nothing(make_stream, source_conn):
    """The walsender is frozen (SIGSTOP) right after START_REPLICATION: no data, no keepalive. The
    drain gives up after its stall timeout, names where it stood, lands nothing; once the walsender
    runs again a drain lands everything."""
    _exec(source_conn, "CREATE TABLE t (id int PRIMARY KEY)")
    cfg = make_stream(["public.t"], drain={"stall_timeout_seconds": 2})
    snapshot_stream(cfg)
    _exec(source_conn, "INSERT INTO t SELECT generate_series(1, 300000)")
    stopped: list[int] = []

    def freeze():
        pid = _slot_pid(source_conn, cfg.source.slot, time.monotonic() + 30)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    thread = threading.Thread(target=freeze)
    thread.start()
    resume = threading.Timer(5.0, lambda: [os.kill(p, signal.SIGCONT) for p in stopped])
    resume.start()
    try:
        with pytest.raises(DrainStalled) as err:
            drain_stream(cfg)
    finally:
        thread.join()
        resume.join()
        for p in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
    msg = str(err.value)
    assert "made no progress for" in msg and "nothing was landed" in msg and f"walsender pid {stopped[0]}" in msg, msg
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.segments(cfg.stream) == []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:      # the frozen walsender ends once it runs and sees the client gone
        with source_conn.cursor() as cur:
            cur.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (cfg.source.slot,))
            if not cur.fetchone()[0]:
                break
        time.sleep(0.1)
    res = drain_stream(cfg)
    assert res.records == 300000
