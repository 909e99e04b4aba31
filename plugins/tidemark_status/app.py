"""The FastAPI app of the CDC status page, mounted by the Tidemark plugin at ``/tidemark``.

Every route requires Airflow's authentication (the UI's ``_token`` cookie or a bearer JWT) and the
right to read DAGs (of the DAG named by ``?dag_id=`` when the page is shown as a DAG's tab). Data
comes from `tidemark.control.status.overview` over the configured stream files; connection ids
resolve through Airflow's connections (metadata database, secrets backends) or ``AIRFLOW_CONN_*``.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def streams_dir() -> Path:
    return Path(os.environ.get("TIDEMARK_STREAMS_DIR") or REPO / "include" / "streams")


def airflow_connection_dsn(conn_id: str) -> str | None:
    """A libpq DSN from an Airflow connection of type postgres, or None to fall back to the environment."""
    from airflow.exceptions import AirflowNotFoundException
    from airflow.models.connection import Connection

    from tidemark.connections import connection_dsn

    try:
        conn = Connection.get_connection_from_secrets(conn_id)
    except AirflowNotFoundException:
        return None
    return connection_dsn(conn)


def create_app() -> Any:
    """Build the FastAPI app (imports FastAPI and Airflow's API security only now)."""
    from fastapi import Depends, FastAPI, Query
    from fastapi.responses import HTMLResponse

    from airflow.api_fastapi.core_api.security import requires_access_dag

    app = FastAPI(title="Tidemark CDC status", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/status/", response_class=HTMLResponse, dependencies=[Depends(requires_access_dag("GET"))])
    def status_page(dag_id: str | None = Query(default=None, max_length=250)) -> HTMLResponse:
        from tidemark.config import load_stream_dir
        from tidemark.connections import set_resolver
        from tidemark.control.status import overview

        from tidemark_status.page import render_page

        set_resolver(airflow_connection_dsn)
        configs, problems = [], []
        try:
            configs = load_stream_dir(streams_dir()) if streams_dir().is_dir() else []
        except Exception as exc:  # noqa: BLE001 - a bad stream file is shown on the page, not a 500
            problems.append(f"stream files in {streams_dir()}: {exc}")
        html = render_page(overview(configs), now=dt.datetime.now(dt.timezone.utc), dag_id=dag_id,
                           problems=problems)
        return HTMLResponse(html, headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    return app


class LazyApp:
    """An ASGI app that builds `create_app` on its first request, so that loading the plugin (which every
    Airflow process does, task processes included) imports neither FastAPI nor the API server's code."""

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self._app is None:
            with self._lock:
                if self._app is None:
                    self._app = create_app()
        await self._app(scope, receive, send)


app = LazyApp()
