"""Which streams the status page shows a user: those whose DAGs the auth manager lets the user read,
all of them (`tidemark_status.access`); nothing of another stream reaches the rendered page.

The auth manager is the one the live test configures (tests/dags/stream_scoped_auth.py: Airflow's
SimpleAuthManager with per-DAG grants), called through Airflow's auth-manager interface."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))
sys.path.insert(0, str(ROOT / "tests" / "dags"))

from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser  # noqa: E402
from stream_scoped_auth import StreamScopedAuthManager  # noqa: E402
from tidemark_status.access import (file_problems, readable_streams, stream_dag_ids,  # noqa: E402
                                    stream_of_dag)
from tidemark_status.page import render_page  # noqa: E402

NOW = dt.datetime(2026, 11, 24, 12, 0, tzinfo=dt.timezone.utc)


def cfg(name: str, feed: bool = False):
    return SimpleNamespace(stream=name, source=SimpleNamespace(is_feed=feed))


def overview_of(c) -> dict:
    """What `overview` returns for a registered stream, every value marked with the stream's name."""
    n = c.stream
    return {"stream": n, "registered": True, "state": "capturing", "slot": f"slot_{n}", "publication": f"pub_{n}",
            "frontier": 1, "landed_upper": 2, "current_segment": 3, "committed_segment": 2, "last_segment_at": NOW,
            "slot_lag_bytes": 5, "slot_lag_seconds": 1.0, "metrics_at": NOW,
            "incidents": [{"id": 1, "kind": "gap", "opened_at": NOW, "detail": {"reason": f"reason_{n}"}}],
            "segments": [{"seq": 1, "lower_lsn": 0, "upper_lsn": 1, "record_count": 1, "txn_count": 1,
                          "byte_size": 1, "status": "landed", "origin": f"origin_{n}", "created_at": NOW}],
            "history": [{"at": NOW, "slot_lag_bytes": 1, "slot_lag_seconds": 1.0, "changes_per_second": 1.0}],
            "tables": [{"table": f"public.table_{n}", "state": "captured", "since_lsn": None, "position": 1,
                        "meaning": "captured"}]}


def viewer(name: str = "u") -> SimpleAuthManagerUser:
    return SimpleAuthManagerUser(username=name, role="viewer")


def test_a_stream_is_read_with_all_of_its_dags():
    demo, feed = cfg("demo"), cfg("prices", feed=True)
    assert stream_dag_ids(demo) == [f"tidemark_demo_{k}" for k in ("snapshot", "drain", "consolidate", "changelog", "maintain")]
    assert stream_dag_ids(feed) == [f"tidemark_prices_{k}" for k in ("drain", "consolidate", "changelog", "maintain")]
    every_demo_dag = stream_dag_ids(demo)
    am = StreamScopedAuthManager({"u": every_demo_dag + ["tidemark_prices_consolidate"]})
    assert readable_streams([demo, feed], user=viewer(), auth_manager=am) == [demo]
    # one DAG of the stream is not enough: not its consolidate DAG, not three of four
    for granted in (["tidemark_demo_consolidate"], every_demo_dag[1:], every_demo_dag[:-1]):
        am = StreamScopedAuthManager({"u": granted})
        assert readable_streams([demo], user=viewer(), auth_manager=am) == []
    # a user the grants do not name is SimpleAuthManager's: a viewer reads every DAG
    am = StreamScopedAuthManager({"other": []})
    assert readable_streams([demo, feed], user=viewer(), auth_manager=am) == [demo, feed]
    assert readable_streams([demo, feed], user=SimpleAuthManagerUser(username="x", role=None),
                            auth_manager=am) == []


def test_the_team_of_each_dag_is_handed_to_the_auth_manager():
    seen = []

    class Recording:
        def batch_is_authorized_dag(self, requests, *, user):
            seen.extend((r["method"], r["details"].id, r["details"].team_name) for r in requests)
            return True

    readable_streams([cfg("demo")], user=viewer(), auth_manager=Recording(),
                     team_names={"tidemark_demo_drain": "blue"})
    assert ("GET", "tidemark_demo_drain", "blue") in seen and ("GET", "tidemark_demo_snapshot", None) in seen
    assert len(seen) == 5         # snapshot, drain, consolidate, changelog, maintain


NAMES = st.sampled_from(["alpha", "beta", "gamma", "delta", "eps", "zeta"])


@settings(max_examples=150, deadline=None)
@given(streams=st.lists(st.tuples(NAMES, st.booleans()), min_size=1, max_size=5, unique_by=lambda t: t[0]),
       data=st.data())
def test_the_page_holds_exactly_the_streams_whose_dags_are_all_readable(streams, data):
    configs = [cfg(n, feed) for n, feed in streams]
    every = [d for c in configs for d in stream_dag_ids(c)]
    granted = data.draw(st.sets(st.sampled_from(every)), label="granted")
    am = StreamScopedAuthManager({"u": sorted(granted)})
    visible = readable_streams(configs, user=viewer(), auth_manager=am)
    assert [c.stream for c in visible] == [c.stream for c in configs if set(stream_dag_ids(c)) <= granted]
    dag_id = data.draw(st.sampled_from(every), label="dag_id")
    owner = stream_of_dag(dag_id, configs)
    assert dag_id in stream_dag_ids(owner)
    page = render_page([overview_of(c) for c in visible], now=NOW, dag_id=dag_id,
                       dag_stream_hidden=owner not in visible)
    for c in configs:
        n = c.stream
        marks = [f'data-stream="{n}"', f"slot_{n}", f"pub_{n}", f"reason_{n}", f"origin_{n}", f"public.table_{n}",
                 f"chart-lag-bytes-{n}", f"tidemark_{n}_"]
        if c in visible:
            assert all(m in page for m in marks), n
        else:   # nothing of it; the DAG the user asked for (and may read) is the only mention allowed
            rest = page.replace(dag_id, "") if owner is c else page
            assert n not in rest, (n, [m for m in marks if m in rest])
    if owner not in visible:
        assert "is not shown: it is shown to users who may read all of its DAGs" in page


def test_broken_stream_files_are_detailed_only_for_who_sees_every_stream():
    errors = {"/s/secret.yaml": ValueError("/s/secret.yaml: stream 'secret': bad key")}
    assert file_problems(errors, detailed=True) == ["/s/secret.yaml: stream 'secret': bad key"]
    (line,) = file_problems(errors, detailed=False)
    assert "secret" not in line and line.startswith("1 stream file(s) could not be read")
    assert file_problems({}, detailed=False) == []
