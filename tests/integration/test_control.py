"""The control database: migrations, manifest, frontier, locks."""

import pytest

from tidemark.control import Control, Segment
from tidemark.errors import StreamBusy, TidemarkError


def test_migrate_is_idempotent(control_dsn):
    with Control(control_dsn) as ctl:
        assert ctl.migrate() == []


def test_manifest_registration_is_idempotent_and_checked(control, make_stream):
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    seg = Segment(cfg.stream, 0, 100, 200, "file:///x", 3, 1, 10, "abc")
    assert control.register_segment(seg) is True
    assert control.register_segment(seg) is False          # retry: no change
    with pytest.raises(TidemarkError, match="already registered"):
        control.register_segment(Segment(cfg.stream, 0, 100, 300, "file:///y", 3, 1, 10, "abd"))
    state = control.stream(cfg.stream)
    assert (state.landed_upper, state.next_seq) == (200, 1)


def test_frontier_never_moves_back(control, make_stream):
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    control.advance_frontier(cfg.stream, 500)
    control.advance_frontier(cfg.stream, 400)
    assert control.stream(cfg.stream).frontier == 500
    assert control.subscriber_checkpoint(cfg.stream, "consolidate") == 500


def test_second_lock_holder_is_refused(control, make_stream):
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    with control.stream_lock(cfg.stream, "drain"):
        with pytest.raises(StreamBusy, match="another drain is already running"):
            with control.stream_lock(cfg.stream, "drain"):
                pass
    with control.stream_lock(cfg.stream, "drain"):   # released: can be taken again
        pass
