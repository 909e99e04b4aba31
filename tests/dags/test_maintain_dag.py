"""The ``tidemark_<stream>_maintain`` DAG's task path: dags/tidemark_streams.py parsed over a stream
file, its ``maintain`` task (`TidemarkMaintainOperator`) executed against a real control database
and lake after a few batches. Checked: it compacts and vacuums (its report says so, the XCom is
plain data), the lake still equals the source, and a re-run is harmless."""

from __future__ import annotations

import json
import sys
import time

import pytest
import yaml

from tidemark.capture.snapshot import snapshot_stream
from tidemark.lake import open_delta, storage_options, table_uri

from airflow_env import ROOT
from oracle import assert_lake_equals_source, consolidate, drain_until_current

pytestmark = [pytest.mark.airflow, pytest.mark.spark]
TABLE = "public.md_items"


def _maintain_task(stream_dir, stream: str, monkeypatch):
    """The ``maintain`` task of the stream's maintain DAG, as dags/tidemark_streams.py builds it over
    ``stream_dir`` (the module run as a DAG file is, without a DAG processor: a stream file's broken
    line is then an error here, not an import error)."""
    import importlib.util

    monkeypatch.setenv("TIDEMARK_STREAMS_DIR", str(stream_dir))
    monkeypatch.syspath_prepend(str(ROOT / "plugins"))
    spec = importlib.util.spec_from_file_location("tidemark_streams_under_test", ROOT / "dags" / "tidemark_streams.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    files, errors = module.scan_stream_dir(stream_dir)
    assert not errors, errors
    dag = getattr(module, f"tidemark_{stream}_maintain")
    assert dag.max_active_runs == 1 and "maintain" in dag.tags, dag
    return dag.get_task("maintain")


def test_the_maintain_dags_task_compacts_and_vacuums(make_stream, source_conn, spark, tmp_path, monkeypatch):
    with source_conn, source_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {TABLE} SELECT i, 'v' FROM generate_series(1, 300) i")
    cfg = make_stream([TABLE], consolidate={"buckets": 2}, lake={"retention": "3 seconds"})
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for i in range(4):
        with source_conn, source_conn.cursor() as cur:
            cur.execute(f"UPDATE {TABLE} SET v = v || %s WHERE id %% 5 = %s", (str(i), i))
            cur.execute(f"INSERT INTO {TABLE} VALUES (%s, 'n')", (1000 + i,))
        drain_until_current(cfg)
        consolidate(cfg, spark)
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    task = _maintain_task(streams, cfg.stream, monkeypatch)
    assert type(task).__name__ == "TidemarkMaintainOperator"
    files_before = len(open_delta(table_uri(cfg, TABLE), storage_options(cfg)).file_uris())
    time.sleep(4)          # every batch's version falls out of the 3-second window: the vacuum has work
    result = task.execute(context={})
    json.dumps(result)                                      # the XCom is plain data
    assert result["stream"] == cfg.stream and result["retention_seconds"] == 3, result
    tables = {(t["table"], t["kind"]): t for t in result["tables"]}
    assert tables[(TABLE, "table")]["vacuumed"] > 0, result
    assert any(t["compacted"] for t in result["tables"]), result
    assert len(open_delta(table_uri(cfg, TABLE), storage_options(cfg)).file_uris()) <= files_before
    assert_lake_equals_source(cfg, TABLE)
    again = task.execute(context={})                        # idempotent: nothing left to compact
    assert not any(t["compacted"] for t in again["tables"]), again
    assert_lake_equals_source(cfg, TABLE)
    print(json.dumps(result), file=sys.stderr)
