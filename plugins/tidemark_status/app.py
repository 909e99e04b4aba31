"""The FastAPI app of the CDC status page, mounted by the Tidemark plugin at ``/tidemark``.

Every route requires Airflow's authentication (the UI's ``_token`` cookie or a bearer JWT) and the
right to read DAGs (of the DAG named by ``?dag_id=`` when the page is shown as a DAG's tab: 403 for
a DAG the user may not read). The page shows only the streams whose DAGs the user may all read
(`tidemark_status.access`); a hidden stream's control data is not even read. Data comes from
`tidemark.status.overview` over the configured stream files; connection ids
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

    from airflow.api_fastapi.core_api.security import get_user, requires_access_dag

    app = FastAPI(title="Tidemark CDC status", docs_url=None, redoc_url=None, openapi_url=None)

    # requires_access_dag("GET") checks the ``dag_id`` query parameter when there is one (403 for a
    # DAG the user may not read), else that the user may read DAGs at all; which streams are shown
    # is then decided per stream (tidemark_status.access). ``user`` has no annotation: this module's
    # annotations are strings, which FastAPI could not resolve to get_user's type imported here.
    @app.get("/status/", response_class=HTMLResponse, dependencies=[Depends(requires_access_dag("GET"))])
    def status_page(dag_id: str | None = Query(default=None, max_length=250),
                    user=Depends(get_user)) -> HTMLResponse:  # noqa: B008 - FastAPI's dependency
        from airflow.api_fastapi.app import get_auth_manager

        from tidemark.config import scan_stream_dir
        from tidemark.connections import set_resolver
        from tidemark.status import overview

        from tidemark_status.access import (file_problems, may_see_import_errors, readable_streams,
                                            stream_dag_ids, stream_of_dag)
        from tidemark_status.page import render_page

        set_resolver(airflow_connection_dsn)
        auth_manager = get_auth_manager()
        configs, errors, problems = [], {}, []
        try:
            if streams_dir().is_dir():
                configs, errors = scan_stream_dir(streams_dir())
        except Exception as exc:  # noqa: BLE001 - an unreadable streams dir is shown on the page, not a 500
            problems.append(f"stream files in {streams_dir()}: {exc}")
        teams = dag_teams([d for cfg in configs for d in stream_dag_ids(cfg)])
        visible = readable_streams(configs, user=user, auth_manager=auth_manager, team_names=teams)
        problems += file_problems(errors, detailed=len(visible) == len(configs)
                                  and may_see_import_errors(user=user, auth_manager=auth_manager))
        dag_stream = stream_of_dag(dag_id, configs)
        html = render_page(overview(visible), now=dt.datetime.now(dt.timezone.utc), dag_id=dag_id,
                           problems=problems, dag_stream_hidden=dag_stream is not None
                           and dag_stream.stream not in {c.stream for c in visible})
        return HTMLResponse(html, headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    return app


def dag_teams(dag_ids: list[str]) -> dict[str, str | None]:
    """The team of each DAG id (multi-team Airflow; empty otherwise), as ``requires_access_dag`` asks it."""
    if not dag_ids:
        return {}
    from airflow.models.dag import DagModel

    return DagModel.get_dag_id_to_team_name_mapping(dag_ids)


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
