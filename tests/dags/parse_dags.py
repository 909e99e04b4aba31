"""Parse dags/ with every network connection and Airflow connection lookup forbidden; print a JSON
description of each DAG (run in a child process by test_dag_integrity.py)."""

from __future__ import annotations

import json
import socket
import sys

HEAVY = ("pyspark", "pandas", "deltalake", "pyarrow", "psycopg2", "fastavro", "boto3")
touched: list[str] = []


def forbid(what: str):
    def refuse(*args, **kwargs):
        touched.append(what)
        raise RuntimeError(f"{what} while parsing DAGs")
    return refuse


socket.socket.connect = forbid("socket.connect")
socket.create_connection = forbid("socket.create_connection")

from airflow.dag_processing.dagbag import DagBag  # noqa: E402
from airflow.sdk import BaseHook, Variable  # noqa: E402

BaseHook.get_connection = classmethod(forbid("BaseHook.get_connection"))
Variable.get = staticmethod(forbid("Variable.get"))

before = {m for m in HEAVY if m in sys.modules}
bag = DagBag(dag_folder=sys.argv[1] if len(sys.argv) > 1 else None)
heavy = sorted({m for m in HEAVY if m in sys.modules} - before)


def describe_task(task) -> dict:
    return {
        "type": type(task).__name__,
        "retries": task.retries,
        "upstream": sorted(task.upstream_task_ids),
        "downstream": sorted(task.downstream_task_ids),
        "trigger_rule": str(task.trigger_rule),
        "mode": getattr(task, "mode", None),
        "deferrable": getattr(task, "deferrable", None),
        "outlets": [getattr(o, "name", str(o)) for o in task.outlets],
        "conn_id": getattr(task, "_conn_id", None),
        "application": getattr(task, "application", None),
        "application_args": getattr(task, "application_args", None),
    }


def describe(dag) -> dict:
    schedule = dag.timetable
    return {
        "tags": sorted(dag.tags),
        "doc_md": dag.doc_md,
        "timetable": type(schedule).__name__,
        "schedule_assets": [a.name for a in getattr(getattr(schedule, "asset_condition", None), "objects", [])],
        # the scheduling Assets' watchers: name, trigger class path and arguments
        "schedule_watchers": [[w.name, *w.trigger.serialize()] for a in getattr(getattr(
            schedule, "asset_condition", None), "objects", []) for w in getattr(a, "watchers", [])],
        # an AssetOrTimeSchedule's timed part
        "also_on": getattr(getattr(schedule, "timetable", None), "expression", None),
        "catchup": dag.catchup,
        "params": {k: dag.params.get_param(k).dump() for k in dag.params},
        "tasks": {t.task_id: describe_task(t) for t in dag.tasks},
    }


print(json.dumps({
    "import_errors": bag.import_errors,
    "touched": touched,
    "heavy_imports": heavy,
    "dags": {dag_id: describe(dag) for dag_id, dag in bag.dags.items()},
}, default=str))
