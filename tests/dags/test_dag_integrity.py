"""DAG integrity: every DAG parses with no connection, database or network access and no heavy
imports, and carries tags, docs and retries; the wiring matches the design (branches, Asset, Params)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from airflow_env import ROOT, airflow_env, run_json

pytestmark = pytest.mark.airflow
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> dict:
    """Parse the shipped stream files plus a second stream in a child process."""
    home = tmp_path_factory.mktemp("af-parse")
    streams = home / "streams"
    streams.mkdir()
    shutil.copy(ROOT / "include" / "streams" / "demo.yaml", streams / "demo.yaml")
    (streams / "shop.yaml").write_text(
        "stream: shop\nsource: {connection: shop_src, tables: [public.a, sales.b]}\n"
        "landing: {url: 's3://shop-landing/cdc'}\nlake: {path: /data/lake}\nconsolidate: {check_every_minutes: 0}\n")
    (streams / "prices.yaml").write_text(       # an external feed: no PostgreSQL
        "stream: prices\nsource: {kind: feed, tables: [public.prices, public.items]}\n"
        "control: {connection: prices_control}\nlanding: {url: /data/landing}\nlake: {path: /data/lake}\n")
    env = airflow_env(home, streams_dir=streams, extra={"TIDEMARK_HOME": str(home / "th")})
    return run_json(HERE / "parse_dags.py", env, timeout=180)


def test_every_dag_imports_without_touching_connections_or_the_database(parsed):
    assert parsed["import_errors"] == {}
    assert parsed["touched"] == []
    assert parsed["heavy_imports"] == []
    kinds = ("snapshot", "drain", "consolidate", "changelog", "maintain")
    assert sorted(parsed["dags"]) == sorted([f"tidemark_{s}_{k}" for s in ("demo", "shop") for k in kinds] +
                                            [f"tidemark_prices_{k}" for k in kinds if k != "snapshot"]
                                            + ["example_demo_downstream"])


def test_every_dag_has_tags_docs_and_retries(parsed):
    for dag_id, dag in parsed["dags"].items():
        assert "tidemark" in dag["tags"] and len(dag["tags"]) >= 3, dag_id
        assert dag["doc_md"] and len(dag["doc_md"]) > 40, dag_id
        for task_id, task in dag["tasks"].items():
            assert task["retries"] >= 1, f"{dag_id}.{task_id} has no retries"


def test_drain_publishes_the_asset_the_consolidation_is_scheduled_on(parsed):
    for stream in ("demo", "shop"):
        drain = parsed["dags"][f"tidemark_{stream}_drain"]
        consolidate = parsed["dags"][f"tidemark_{stream}_consolidate"]
        # event-driven: the source watcher's Asset (a trigger in the triggerer), or the timed safety run
        assert drain["timetable"] == "AssetOrTimeSchedule"
        assert drain["schedule_assets"] == [f"tidemark_{stream}_source"]
        assert drain["also_on"] == "*/5 * * * *"
        ((name, classpath, kwargs),) = drain["schedule_watchers"]
        assert name == f"tidemark_{stream}_source_watch"
        assert classpath == "tidemark_airflow.triggers.TidemarkSourceChangesTrigger"
        assert kwargs["stream_file"].endswith(f"{stream}.yaml") and kwargs["poll_seconds"] == 2.0
        assert drain["tasks"]["drain"]["outlets"] == [f"tidemark_{stream}_landing"]
        # one task on the path of a change (sweep, drain and metrics together: a task start costs seconds)
        assert set(drain["tasks"]) == {"drain"}
        assert consolidate["schedule_assets"] == [f"tidemark_{stream}_landing"]
    # demo also runs every 5 minutes (the default), so that a lost slot, which stops the drains and their
    # events, is found and resent unattended; shop turned that off
    assert parsed["dags"]["tidemark_demo_consolidate"]["timetable"] == "AssetOrTimeSchedule"
    assert parsed["dags"]["tidemark_demo_consolidate"]["also_on"] == "*/5 * * * *"
    assert parsed["dags"]["tidemark_shop_consolidate"]["also_on"] is None
    # an external feed has no PostgreSQL to watch: its drain runs every minute
    assert parsed["dags"]["tidemark_prices_drain"]["timetable"] == "CronTriggerTimetable"


def test_an_external_feed_ingests_on_its_drain_and_has_nothing_to_repair_or_resnapshot(parsed):
    drain = parsed["dags"]["tidemark_prices_drain"]["tasks"]
    assert drain["register"]["downstream"] == ["ingest_feed"]
    assert drain["ingest_feed"]["outlets"] == ["tidemark_prices_landing"]
    assert drain["ingest_feed"]["downstream"] == []
    consolidate = parsed["dags"]["tidemark_prices_consolidate"]
    assert consolidate["schedule_assets"] == ["tidemark_prices_landing"]
    tasks = consolidate["tasks"]
    assert set(tasks) == {"wait_for_segments", "consolidate"}
    assert tasks["wait_for_segments"]["downstream"] == ["consolidate"]
    assert "feed" in parsed["dags"]["tidemark_prices_drain"]["doc_md"]


def test_consolidation_branches_to_repair_or_resend_then_consolidates(parsed):
    tasks = parsed["dags"]["tidemark_demo_consolidate"]["tasks"]
    sensor = tasks["wait_for_segments"]
    assert sensor["mode"] == "reschedule" or sensor["deferrable"], "the sensor must not hold a worker slot"
    # the sensor branches (two task starts were one more on the path of every change)
    assert set(tasks) == {"wait_for_segments", "repair", "resend", "consolidate"}
    assert sensor["downstream"] == ["consolidate", "repair", "resend"]
    assert tasks["repair"]["downstream"] == ["consolidate"] and tasks["resend"]["downstream"] == ["consolidate"]
    spark = tasks["consolidate"]
    assert spark["type"] == "TidemarkSparkSubmitOperator" and spark["conn_id"] == "spark_default"
    assert spark["application"] == str(ROOT / "jobs" / "consolidate.py")
    assert spark["trigger_rule"].endswith("NONE_FAILED_MIN_ONE_SUCCESS")


def test_snapshot_form_has_typed_params_with_titles_and_descriptions(parsed):
    dag = parsed["dags"]["tidemark_shop_snapshot"]
    assert dag["timetable"] == "NullTimetable"
    params = dag["params"]
    assert set(params) == {"tables", "mode", "force", "chunk_pages", "parallelism"}
    for name, p in params.items():
        assert p["schema"].get("type") and p["schema"].get("title") and p["description"], name
    assert params["tables"]["value"] == ["public.a", "sales.b"]
    assert params["mode"]["schema"]["enum"] == ["initial", "resend", "add", "table"]
    assert params["force"]["schema"]["type"] == "boolean" and params["force"]["value"] is False


def test_changelog_runs_once_per_hourly_data_interval(parsed):
    dag = parsed["dags"]["tidemark_demo_changelog"]
    assert dag["timetable"] == "CronDataIntervalTimetable"
    assert list(dag["tasks"]) == ["write_changelog"]


def test_maintain_runs_daily_under_its_own_task(parsed):
    dag = parsed["dags"]["tidemark_demo_maintain"]
    assert dag["timetable"] == "CronTriggerTimetable"
    assert list(dag["tasks"]) == ["maintain"]


def test_a_broken_stream_file_is_its_own_import_error_and_the_other_streams_still_load(tmp_path):
    streams = tmp_path / "streams"
    streams.mkdir()
    shutil.copy(ROOT / "include" / "streams" / "demo.yaml", streams / "demo.yaml")
    (streams / "bad.yaml").write_text("stream: bad\nsource: {connection: c, tables: []}\n"
                                      "landing: {url: /x}\nlake: {path: /y}\n")
    (streams / "twin.yml").write_text((streams / "demo.yaml").read_text())   # a second stream named demo
    (streams / "good.yaml").write_text("stream: good\nsource: {connection: c, tables: [public.t]}\n"
                                       "landing: {url: /x}\nlake: {path: /y}\n")
    out = run_json(HERE / "parse_dags.py", airflow_env(tmp_path, streams_dir=streams), timeout=180)
    kinds = ("snapshot", "drain", "consolidate", "changelog", "maintain")
    assert sorted(out["dags"]) == sorted([f"tidemark_{s}_{k}" for s in ("demo", "good") for k in kinds]
                                         + ["example_demo_downstream"])
    (path, error), = out["import_errors"].items()
    assert path.endswith("tidemark_stream_files.py")
    assert f"{streams / 'bad.yaml'}: source.tables: must be a non-empty list" in error
    assert f"{streams / 'twin.yml'}: stream: 'demo' is also defined in {streams / 'demo.yaml'}" in error
    assert "good.yaml" not in error


def test_the_consolidation_updates_its_tables_assets_and_a_downstream_dag_runs_on_one(parsed):
    """The consolidate task's outlet is the stream's table alias (events only for the tables it changed,
    `TidemarkSparkSubmitOperator.publish_tables`); the example downstream DAG is scheduled on the Asset
    of one demo table (`tidemark_airflow.assets.table_asset`)."""
    for stream in ("demo", "shop", "prices"):
        assert parsed["dags"][f"tidemark_{stream}_consolidate"]["tasks"]["consolidate"]["outlets"] == [
            f"tidemark_{stream}_tables"]
    downstream = parsed["dags"]["example_demo_downstream"]
    assert downstream["timetable"] == "AssetTriggeredTimetable"
    assert downstream["schedule_assets"] == ["tidemark_demo_public.orders"]
