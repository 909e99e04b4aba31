"""Register Tidemark with Airflow: the CDC status page (a FastAPI app behind Airflow's login, at
``/tidemark/status/``), its entry in the UI's navigation (Browse → CDC status) and a "CDC status" tab
on every DAG (it highlights the stream of a Tidemark DAG). Operators, sensor and hook live in the
``tidemark_airflow`` package."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from tidemark_status.app import app as status_app

STATUS_PREFIX = "/tidemark"


class TidemarkPlugin(AirflowPlugin):
    """The Tidemark plugin."""

    name = "tidemark"
    fastapi_apps = [{"app": status_app, "url_prefix": STATUS_PREFIX, "name": "Tidemark CDC status"}]
    external_views = [
        {"name": "CDC status", "href": "tidemark/status/", "destination": "nav", "category": "browse",
         "url_route": "tidemark_status"},
        {"name": "CDC status", "href": "tidemark/status/?dag_id={DAG_ID}", "destination": "dag",
         "url_route": "tidemark_status_dag"},
    ]
