"""Write cost per batch and storage on the status page, against PostgreSQL itself (real slot, real Spark).

Two keyed tables take three batches; the second table changes in the middle one only. Checked: every
batch records one row per table it changed (none for the untouched table), at the batch's frontier,
whose bytes added and removed are what the table's Delta versions added and removed (worked out here
from the versions' file lists, not from the log entries the recorder reads) and whose changes are the
batch's updates; a consolidation that dies after its commits, before the frontier moves, and is run
again records nothing twice. ``tidemark status`` shows the storage (lake bytes live and on disk with
the Delta log's share, files, landing bytes, the oldest readable position) as the files on disk say,
the write amplification per table (latest, median), a lagging subscriber's held-back bytes and the
last maintenance run; the status page plots the amplification per table as a sparkline.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from tidemark.capture.snapshot import snapshot_stream
from tidemark.control import open_control
from tidemark.lake import changelog_uri, open_delta, storage_options, table_uri

from oracle import consolidate, drain_until_current

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))

TABLES = ["public.wc_a", "public.wc_b"]


def _setup(source_conn):
    with source_conn, source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.wc_a (id int PRIMARY KEY, v text)")
        cur.execute("CREATE TABLE public.wc_b (id int PRIMARY KEY, v text)")
        cur.execute("INSERT INTO public.wc_a SELECT i, repeat('a', 50) FROM generate_series(1, 300) i")
        cur.execute("INSERT INTO public.wc_b SELECT i, repeat('b', 50) FROM generate_series(1, 100) i")


def _sql(source_conn, *statements):
    with source_conn, source_conn.cursor() as cur:
        for s in statements:
            cur.execute(s)


def _costs(cfg) -> dict[str, list[dict]]:
    with open_control(cfg) as ctl:
        return ctl.write_costs(cfg.stream)


def _files_at(dt, version: int) -> dict[str, int]:
    dt.load_as_version(version)
    t = pa.table(dt.get_add_actions(flatten=True))
    return dict(zip(t.column("path").to_pylist(), t.column("size_bytes").to_pylist()))


def _delta_figures(cfg, table: str, v_from: int, v_to: int) -> dict[str, int]:
    """What versions ``v_from..v_to`` of the lake table did to its files, from the file lists."""
    dt = open_delta(table_uri(cfg, table), storage_options(cfg))
    before = _files_at(dt, v_from - 1) if v_from > 0 else {}
    after = _files_at(dt, v_to)
    added = {p: s for p, s in after.items() if p not in before}
    removed = {p: s for p, s in before.items() if p not in after}
    return {"added_files": len(added), "added_bytes": sum(added.values()), "removed_files": len(removed),
            "removed_bytes": sum(removed.values()), "live_bytes": sum(after.values())}


@pytest.fixture
def stream(make_stream, source_conn, spark):
    _setup(source_conn)
    cfg = make_stream(TABLES, consolidate={"buckets": 2})
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    return cfg


def test_each_batch_records_its_write_cost_per_changed_table(stream, source_conn, spark, monkeypatch):
    cfg = stream
    batches = [
        ("UPDATE public.wc_a SET v = v || 'x' WHERE id % 10 = 0", "INSERT INTO public.wc_a VALUES (1001, 'n')"),
        ("UPDATE public.wc_a SET v = 'y' WHERE id <= 5", "DELETE FROM public.wc_b WHERE id <= 3",
         "INSERT INTO public.wc_b VALUES (500, 'n')"),
        ("DELETE FROM public.wc_a WHERE id BETWEEN 100 AND 103",),
    ]
    # the table's updates each batch holds: an UPDATE is two records (the old row out, the new one in)
    expected_records = [{"public.wc_a": 2 * 30 + 1}, {"public.wc_a": 2 * 5, "public.wc_b": 3 + 1},
                        {"public.wc_a": 4}]
    before = _costs(cfg)
    frontiers = []
    for statements in batches:
        _sql(source_conn, *statements)
        drain_until_current(cfg)
        consolidate(cfg, spark)
        with open_control(cfg) as ctl:
            frontiers.append(ctl.stream(cfg.stream).frontier)
    costs = _costs(cfg)
    new = {t: [r for r in rows if r not in before.get(t, [])] for t, rows in costs.items()}
    # one row per batch per changed table, at the batch's frontier; none for wc_b's untouched batches
    assert [r["frontier"] for r in new["public.wc_a"]] == frontiers
    assert [r["frontier"] for r in new["public.wc_b"]] == [frontiers[1]]
    for i, want in enumerate(expected_records):
        for table, records in want.items():
            row = next(r for r in new[table] if r["frontier"] == frontiers[i])
            assert row["change_records"] == records, (table, i, row)
            assert row["change_bytes"] > 0 and row["frontier_before"] == (frontiers[i - 1] if i else row["frontier_before"])
            assert not row["snapshot_load"]
            # the bytes added and removed are what the Delta versions did to the table's files
            figures = _delta_figures(cfg, table, row["version_from"], row["version_to"])
            assert {k: row[k] for k in figures} == figures, (table, i)
            assert row["added_bytes"] > 0 and row["removed_files"] >= 1
            # the changelog's new files for the batch
            log = open_delta(changelog_uri(cfg, table), storage_options(cfg))
            assert row["changelog_bytes"] > 0 and row["changelog_bytes"] <= sum(
                pa.table(log.get_add_actions(flatten=True)).column("size_bytes").to_pylist())

    # a consolidation that dies after its commits, before the frontier moves: run again, nothing twice
    from tidemark.consolidate import consolidate_stream
    from tidemark.control.db import Control

    _sql(source_conn, "UPDATE public.wc_a SET v = 'z' WHERE id <= 20")
    drain_until_current(cfg)
    real = Control.advance_frontier

    def dies(self, *a, **k):
        raise RuntimeError("killed before the frontier moved")

    monkeypatch.setattr(Control, "advance_frontier", dies)
    with pytest.raises(Exception, match="killed before the frontier moved"):
        consolidate_stream(cfg, spark=spark)
    monkeypatch.setattr(Control, "advance_frontier", real)
    once = _costs(cfg)
    consolidate(cfg, spark)
    again = _costs(cfg)
    assert again == once
    last = again["public.wc_a"][-1]
    with open_control(cfg) as ctl:
        assert last["frontier"] == ctl.stream(cfg.stream).frontier
    assert last["change_records"] == 2 * 20
    assert len([r for r in again["public.wc_a"] if r["frontier"] == last["frontier"]]) == 1
    assert {k: last[k] for k in ("added_bytes", "removed_bytes")} == {
        k: v for k, v in _delta_figures(cfg, "public.wc_a", last["version_from"], last["version_to"]).items()
        if k in ("added_bytes", "removed_bytes")}
    # and the recorder called again for the same frontier adds nothing
    from tidemark.consolidate import writecost

    with open_control(cfg) as ctl:
        assert ctl.record_write_costs(cfg.stream, [{**last}]) == 0
    assert _costs(cfg) == again
    assert "public.wc_b" not in writecost.batch_costs(cfg, [], frontiers[-1], last["frontier"], ["public.wc_b"])


def _disk(path: str) -> tuple[int, int, int, int]:
    """(bytes, files, of them the Delta log's bytes, files) under a directory, walked here."""
    total = files = log_bytes = log_files = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            size = os.path.getsize(os.path.join(d, f))
            total, files = total + size, files + 1
            if "_delta_log" in os.path.relpath(d, path).split(os.sep):
                log_bytes, log_files = log_bytes + size, log_files + 1
    return total, files, log_bytes, log_files


def test_status_shows_storage_write_cost_and_maintenance(stream, source_conn, spark, monkeypatch, capsys):
    from tidemark import cli
    from tidemark.lake.retention import oldest_readable
    from tidemark.maintain import maintain
    from tidemark.status import stream_overview, stream_status
    from tidemark_status.page import render_page

    cfg = stream
    with open_control(cfg) as ctl:
        ctl.add_subscriber(cfg.stream, "slowpoke", ctl.stream(cfg.stream).frontier)
    for i in range(3):
        _sql(source_conn, f"UPDATE public.wc_a SET v = v || '{i}' WHERE id % 7 = {i}",
             *(["UPDATE public.wc_b SET v = 'c' WHERE id = 1"] if i == 1 else []))
        drain_until_current(cfg)
        consolidate(cfg, spark)
    maintain(cfg)
    status = stream_status(cfg)
    st = status["storage"]
    assert status["storage_error"] is None
    for table in TABLES:
        for kind, sub in (("table", "tables"), ("changelog", "changelog")):
            uri = {"table": table_uri, "changelog": changelog_uri}[kind](cfg, table)
            fig = st["tables"][table][kind]
            total, files, log_bytes, log_files = _disk(uri)
            assert (fig["disk_bytes"], fig["disk_files"], fig["log_bytes"], fig["log_files"]) == (
                total, files, log_bytes, log_files), (table, kind)
            dt = open_delta(uri, storage_options(cfg))
            live = [os.path.getsize(u[len("file://"):] if u.startswith("file://") else u) for u in dt.file_uris()]
            assert (fig["live_bytes"], fig["live_files"]) == (sum(live), len(live)), (table, kind)
            assert 0 < fig["log_bytes"] <= fig["disk_bytes"]
    lake = st["lake"]
    assert lake["disk_bytes"] == sum(f["disk_bytes"] for k in st["tables"].values() for f in k.values())
    assert lake["live_bytes"] <= lake["disk_bytes"]
    land_root = Path(cfg.landing.url) / cfg.stream
    seg_bytes = sum(p.stat().st_size for p in (land_root / "segments").rglob("*") if p.is_file())
    all_bytes = sum(p.stat().st_size for p in land_root.rglob("*") if p.is_file())
    assert st["landing"]["segment_bytes"] == seg_bytes > 0 and st["landing"]["bytes"] == all_bytes
    assert st["oldest_readable"] == oldest_readable(cfg)
    assert st["retention"] == "7 days"
    # the lagging subscriber's held-back bytes, the write cost and the last maintenance run
    slow = next(s for s in status["subscribers"] if s["name"] == "slowpoke")
    assert slow["lagging"] and slow["held_bytes"] > 0
    wc = status["write_cost"]["public.wc_a"]
    rows = _costs(cfg)["public.wc_a"]
    amps = [r["added_bytes"] / r["change_bytes"] for r in rows if not r["snapshot_load"] and r["change_bytes"]]
    assert wc["batches"] == len(rows) >= 3 and wc["latest"] == pytest.approx(amps[-1])
    assert wc["median"] == pytest.approx(sorted(amps)[len(amps) // 2] if len(amps) % 2 else
                                         sum(sorted(amps)[len(amps) // 2 - 1:len(amps) // 2 + 1]) / 2)
    run = status["last_maintenance"]
    assert run is not None and run["report"]["stream"] == cfg.stream and len(run["report"]["tables"]) >= 4

    # `tidemark status` prints them
    monkeypatch.setattr(cli, "find_stream", lambda name, where: cfg)
    assert cli.main(["status", cfg.stream]) == 0
    out = capsys.readouterr().out
    assert f"{lake['live_files']:,} files" in out and "Delta log" in out
    assert "write amp. public.wc_a: latest" in out and "median" in out
    assert "subscriber slowpoke" in out and "of landing files back" in out
    assert "last maintenance: " in out and "never" not in out.split("last maintenance: ")[1].splitlines()[0]

    # the page (from the control database only) shows the storage as recorded and one sparkline per table
    with open_control(cfg) as ctl:
        data = stream_overview(ctl, cfg.stream, tables=TABLES, cfg=cfg)
    assert data["storage"]["lake"] == {**status["storage"]["lake"], **data["storage"]["lake"]}
    page = render_page([data], now=data["storage"]["at"])
    assert page.count('class="sparkline"') == len(data["write_costs"]) == 2
    wc_a = page.split('data-table="public.wc_a"')[1].split("</tr>")[0]
    points = wc_a.split('points="')[1].split('"')[0].split()
    assert len(points) == len(amps)
    assert "Delta log" in page and "last maintenance: " in page and "oldest readable position" in page
