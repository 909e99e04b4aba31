"""`source.advance_slot` after a committed consolidation: a drain that takes the slot between the
check and the advance (a real walsender on the slot) does not fail the run. On the code before this
test the advance raised psycopg2's ``ObjectInUse`` ("replication slot ... is active for PID ...")."""

from __future__ import annotations

import logging


from tidemark.capture import source
from tidemark.capture.source import advance_slot, connect_replication, connect_source, slot_info


def _write(cfg) -> int:
    """Commit a change in the source; return the WAL position after it."""
    conn = connect_source(cfg)
    try:
        with conn.cursor() as cur:
            cur.execute("SET synchronous_commit = on")
            cur.execute("INSERT INTO public.items (id, v) VALUES (1000 + (random() * 1e6)::int, 'x')")
            cur.execute("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::numeric::bigint")
            return cur.fetchone()[0]
    finally:
        conn.close()


def _walsender(cfg):
    """A walsender on the stream's slot, as a drain holds it."""
    rep = connect_replication(cfg, application_name="test-drain")
    rep.cursor().start_replication(slot_name=cfg.source.slot, decode=False,
                                   options={"proto_version": "1", "publication_names": cfg.source.publication})
    return rep


def _wait_active(cfg, active: bool) -> None:
    import time

    for _ in range(100):
        if slot_info(cfg).active == active:
            return
        time.sleep(0.1)
    raise AssertionError(f"slot active never became {active}")


def test_a_drain_between_check_and_advance_leaves_the_slot_and_reports_done(stream, monkeypatch, caplog):
    cfg, start, _ = stream
    target = _write(cfg)
    before = slot_info(cfg).confirmed_flush_lsn
    held = []
    real = source.slot_info

    def check_then_drain_starts(c, conn=None):
        info = real(c, conn)
        if not held:                       # the check sees an idle slot; then the drain takes it
            held.append(_walsender(cfg))
            _wait_active(cfg, True)
        return info

    monkeypatch.setattr(source, "slot_info", check_then_drain_starts)
    try:
        with caplog.at_level(logging.WARNING, logger="tidemark.capture.source"):
            confirmed = advance_slot(cfg, target)
        assert confirmed == before < target        # not advanced, no error: the run is done
        assert "not advanced" in caplog.text and "active for PID" in caplog.text
    finally:
        monkeypatch.setattr(source, "slot_info", real)
        for rep in held:
            rep.close()
    _wait_active(cfg, False)
    assert advance_slot(cfg, target) == target       # the next consolidation advances it


def test_an_active_walsender_when_asked_is_not_an_error(stream):
    cfg, start, _ = stream
    target = _write(cfg)
    rep = _walsender(cfg)
    try:
        _wait_active(cfg, True)
        assert advance_slot(cfg, target) == slot_info(cfg).confirmed_flush_lsn < target
    finally:
        rep.close()
