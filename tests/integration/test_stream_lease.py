"""The stream lease: one lock for every job that moves a stream's positions, with an exclusion matrix.

Each pair of purposes is tried with two real processes: a child process holds the lease for one purpose
while this process asks for the other; the second is refused (`StreamBusy`, naming what runs) exactly
when the matrix says the two exclude each other, and granted otherwise. On the code before this test
the lock was per (stream, purpose): a consolidation, a repair, a resend and a changelog rebuild did not
exclude each other, and these tests failed."""

from __future__ import annotations

import multiprocessing

import pytest

from tidemark.control import Control
from tidemark.control.db import LOCK_PURPOSES, exclusion_matrix, lock_compatible
from tidemark.errors import StreamBusy

CTX = multiprocessing.get_context("spawn")


def _hold(dsn: str, stream: str, purpose: str, held, release) -> None:
    """Child process: hold the stream's lease for ``purpose`` until told to release it."""
    with Control(dsn) as ctl, ctl.stream_lock(stream, purpose):
        held.set()
        release.wait(60)


class Holder:
    def __init__(self, dsn: str, stream: str, purpose: str):
        self.held, self.release = CTX.Event(), CTX.Event()
        self.proc = CTX.Process(target=_hold, args=(dsn, stream, purpose, self.held, self.release), daemon=True)

    def __enter__(self) -> "Holder":
        self.proc.start()
        assert self.held.wait(60), "the holder process did not get the lease"
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.proc.join(30)
        assert self.proc.exitcode == 0


def test_the_matrix_is_symmetric_and_every_purpose_excludes_itself():
    m = exclusion_matrix()
    assert all(m[(a, b)] == m[(b, a)] for a in LOCK_PURPOSES for b in LOCK_PURPOSES)
    assert all(m[(p, p)] for p in LOCK_PURPOSES)
    # the movers the issue names exclude each other
    movers = ("consolidate", "repair", "resend", "changelog", "snapshot")
    assert all(m[(a, b)] for a in movers for b in movers)
    assert m[("sweep", "drain")] and m[("repair", "drain")] and m[("resend", "sweep")]
    assert not m[("drain", "consolidate")] and not m[("sweep", "consolidate")]


@pytest.mark.parametrize("held", LOCK_PURPOSES)
def test_each_pair_with_two_processes(control, control_dsn, make_stream, held):
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    with Holder(control_dsn, cfg.stream, held):
        for asked in LOCK_PURPOSES:
            if lock_compatible(held, asked):
                with control.stream_lock(cfg.stream, asked) as lease:
                    assert lease.held()
            else:
                with pytest.raises(StreamBusy, match=f"stream {cfg.stream}: (another {held} is already running|"
                                                     f"a {held} is running .* and a {asked} cannot run beside it)"):
                    with control.stream_lock(cfg.stream, asked):
                        pass
    for asked in LOCK_PURPOSES:            # everything released: each can be taken again
        with control.stream_lock(cfg.stream, asked):
            pass


def test_two_compatible_holders_do_not_exclude_each_other_nor_let_a_third_in(control, control_dsn, make_stream):
    """A drain and a consolidation share their shared locks; a repair is refused by either."""
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    with Holder(control_dsn, cfg.stream, "consolidate"), Holder(control_dsn, cfg.stream, "drain"):
        with pytest.raises(StreamBusy):
            with control.stream_lock(cfg.stream, "repair"):
                pass
    with Holder(control_dsn, cfg.stream, "drain"):
        with control.stream_lock(cfg.stream, "consolidate"):
            with pytest.raises(StreamBusy, match="a drain is running"):
                with control.stream_lock(cfg.stream, "sweep"):
                    pass


def test_a_job_run_inside_another_is_covered_by_its_lease(control, control_dsn, make_stream):
    """A resend runs a snapshot that takes the drain's lease: in the same thread that is the resend's
    lease; another process still cannot drain."""
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    with control.stream_lock(cfg.stream, "resend") as outer:
        with control.stream_lock(cfg.stream, "snapshot") as snap, control.stream_lock(cfg.stream, "drain") as drain:
            assert snap is outer and drain is outer and drain.held()
        with pytest.raises(StreamBusy, match="another consolidate|a resend is running"):
            with control.stream_lock(cfg.stream, "consolidate"):
                pass
    with Holder(control_dsn, cfg.stream, "resend"):
        with pytest.raises(StreamBusy, match="a resend is running"):
            with control.stream_lock(cfg.stream, "drain"):
                pass


def test_the_jobs_themselves_take_the_lease(stream, control_dsn):
    """While another process consolidates, a repair and a resend are refused (before: each took its own
    lock, and a repair could move a file aside while the consolidation decoded it); a sweep runs."""
    from tidemark import gaps

    cfg = stream[0]
    report = gaps.detect(cfg)
    with Holder(control_dsn, cfg.stream, "consolidate"):
        with pytest.raises(StreamBusy, match="a consolidate is running .* a repair cannot run beside it"):
            gaps.repair(cfg, report)
        with pytest.raises(StreamBusy, match="a resend cannot run beside it"):
            gaps.resend(cfg, force=True)
        assert gaps.sweep(cfg).registered == ()
    with Holder(control_dsn, cfg.stream, "repair"):
        with pytest.raises(StreamBusy, match="a repair is running .* a sweep cannot run beside it"):
            gaps.sweep(cfg)


def test_a_task_waits_for_a_lease_held_for_a_moment_and_names_the_holder_when_it_gives_up(
        control, control_dsn, make_stream, monkeypatch):
    """The Airflow tasks wait (`LOCK_WAIT_ENV`) for a lease a short job holds: a resend is not failed
    by a changelog rebuild of a few seconds. Without the wait (the code before it) the resend below
    raised `StreamBusy` while the rebuild ran, and a live scheduler's backfill could fail a recovery
    through all of its retries."""
    import threading
    import time

    from tidemark.control.db import LOCK_WAIT_ENV

    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    with Holder(control_dsn, cfg.stream, "changelog"):
        t0 = time.monotonic()
        with pytest.raises(StreamBusy, match=r"a changelog is running .*waited 1 s for it"):
            with control.stream_lock(cfg.stream, "resend"):
                pass
        assert 0.9 <= time.monotonic() - t0 < 10
    monkeypatch.setenv(LOCK_WAIT_ENV, "60")
    holder = Holder(control_dsn, cfg.stream, "changelog").__enter__()
    threading.Timer(2.0, holder.__exit__, (None, None, None)).start()
    t0 = time.monotonic()
    with control.stream_lock(cfg.stream, "resend") as lease:
        lease.confirm("the test's commit")
        assert holder.release.is_set(), "granted only after the holder let go"
    assert 1.5 <= time.monotonic() - t0 < 30
    monkeypatch.setenv(LOCK_WAIT_ENV, "soon")
    with pytest.raises(Exception, match=r"TIDEMARK_LOCK_WAIT_SECONDS='soon' is not a number"):
        with control.stream_lock(cfg.stream, "resend"):
            pass
