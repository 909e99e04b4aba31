"""The status page's renderer: everything from the control database and the request is escaped, LSNs
are printed as PostgreSQL does, and a chart has one point per sample that has a value."""

from __future__ import annotations

import datetime as dt
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))

from tidemark_status.page import incident_reason, render_page, svg_chart  # noqa: E402

NOW = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.timezone.utc)
EVIL = '"><script>alert(1)</script><img src=x onerror=alert(2)>'


def _stream(**kw) -> dict:
    base = {"stream": "demo", "registered": True, "state": "capturing", "slot": "tidemark_demo",
            "publication": "tidemark_demo", "frontier": 0x16B3748, "landed_upper": (1 << 32) | 0xA2F000,
            "current_segment": 7, "committed_segment": 5, "last_segment_at": NOW, "slot_lag_bytes": 2048,
            "slot_lag_seconds": 95.0, "metrics_at": NOW, "incidents": [], "segments": [], "history": []}
    base.update(kw)
    return base


def test_values_from_the_database_and_the_request_are_escaped():
    page = render_page([_stream(
        state=EVIL, slot=EVIL,
        incidents=[{"id": 1, "kind": EVIL, "opened_at": NOW, "detail": {"reason": EVIL}}],
        segments=[{"seq": 1, "lower_lsn": 0, "upper_lsn": 1, "record_count": 2, "txn_count": 1, "byte_size": 3,
                   "status": EVIL, "origin": EVIL, "created_at": NOW}]),
        {"stream": "other", "registered": False, "error": EVIL}], now=NOW, dag_id=EVIL, problems=[EVIL])
    assert "<script" not in page and "<img" not in page
    # state, slot, kind, reason, status, origin, error, a stream-file problem, the request's dag_id: escaped
    assert page.count("&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;") == 9
    assert not re.search(r"<(?!/?(html|head|meta|title|style|body|h1|h2|h3|div|p|section|span|a|table|tr|th|td|svg|"
                         r"text|line|polyline|circle)\b)[a-z]", page, re.I)


def test_positions_in_postgresql_notation_and_the_selected_stream():
    page = render_page([_stream(), _stream(stream="other")], now=NOW, dag_id="tidemark_demo_consolidate")
    assert ">0/16B3748<" in page and ">1/A2F000<" in page
    assert '<section id="stream-demo" class="stream current"' in page
    assert '<section id="stream-other" class="stream"' in page
    assert "7 / 5" in page and "95.0 s" in page and "2,048 B (2.0 KiB)" in page
    assert 'href="../../dags/tidemark_demo_drain"' in page


def test_a_chart_has_one_point_per_sample_with_a_value():
    samples = [(NOW + dt.timedelta(seconds=10 * i), v) for i, v in enumerate([None, 1.0, 4.0, None, 2.0])]
    svg = svg_chart(samples, title="changes/s", fmt=str, css_id="c")
    assert svg.count("<circle") == 3
    points = re.search(r'points="([^"]+)"', svg).group(1).split()
    assert len(points) == 3
    xs = [float(p.split(",")[0]) for p in points]
    ys = [float(p.split(",")[1]) for p in points]
    assert xs == sorted(xs) and ys[1] < ys[2] < ys[0]                 # 4.0 highest on screen, then 2.0, then 1.0
    assert "no samples yet" in svg_chart([(NOW, None)], title="t", fmt=str, css_id="d")


def test_incident_reason_falls_back_to_the_detail():
    assert incident_reason("gap", {"reason": "lost"}) == "lost"
    assert incident_reason("counts_unmet", {"time": 5, "expected": 3, "seen": 1}) == "time=5, expected=3, seen=1"


def test_an_incident_shows_its_table_count_and_last_seen():
    later = NOW + dt.timedelta(minutes=7)
    page = render_page([_stream(incidents=[{"id": 4, "kind": "consolidate_failed", "table": "public.orders",
                                            "opened_at": NOW, "count": 3, "last_seen_at": later,
                                            "detail": {"reason": "ValueError: bad row"}}])], now=NOW)
    row = re.search(r'<tr class="incident">.*?</tr>', page).group(0)
    assert '<td class="num count">3</td>' in row
    assert '<td class="last-seen">2026-11-22 12:07:00 UTC</td>' in row
    assert "<td>public.orders</td>" in row and "<th>times seen</th>" in page


def test_each_table_shows_its_own_state_and_position():
    page = render_page([_stream(tables=[
        {"table": "public.a", "state": "captured", "since_lsn": None, "position": 0x16B3748, "meaning": "captured"},
        {"table": "public.b", "state": "awaiting_snapshot", "since_lsn": None, "position": None, "meaning": "loading"},
        {"table": "public.c", "state": "frozen", "since_lsn": 0x1000, "position": 0x1000, "meaning": "frozen"}])],
        now=NOW)
    rows = re.findall(r'<tr class="table-state" data-state="([a-z_]+)"><td>([^<]+)</td><td>[^<]+</td>'
                      r'<td class="lsn">([^<]+)</td>', page)
    assert rows == [("captured", "public.a", "0/16B3748"), ("awaiting_snapshot", "public.b", "-"),
                    ("frozen", "public.c", "0/1000")]


def test_a_lagging_subscriber_shows_the_landing_bytes_it_holds():
    page = render_page([_stream(subscribers=[
        {"name": "billing", "checkpoint": 0x1000, "lag_bytes": 4096, "lagging": True, "held_bytes": 3 * 1024 * 1024},
        {"name": "audit", "checkpoint": 0x16B3748, "lag_bytes": 0, "lagging": False, "held_bytes": 0}])], now=NOW)
    row = re.search(r'<tr class="subscriber lagging">.*?</tr>', page).group(0)
    assert "<td>billing</td>" in row and ">0/1000<" in row
    assert '<td class="num held">3,145,728 B (3.0 MiB)</td>' in row
    assert '<tr class="subscriber"><td>audit</td>' in page and "landing bytes it holds" in page
