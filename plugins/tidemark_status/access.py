"""Who may see which stream on the status page, asked of Airflow's auth manager.

A stream is shown only to a user who may read (``GET``) **every one of its DAGs** (snapshot, drain,
consolidate, changelog; an external feed has no snapshot DAG), asked as one
``batch_is_authorized_dag`` call per stream. Not "any of its DAGs", nor only the consolidate DAG:
the page gathers what all of them do (the drain's slot lag and segments, the snapshot's and the
consolidation's incidents, the frontier), so a user given one of the DAGs would otherwise see what
the others' logs and runs keep from them. Whatever else the auth manager grants (roles, per-DAG
permissions, teams) it decides; the page only asks it.

A hidden stream is left out before the control database is read, so nothing of it (name, slot,
incidents, segments, tables, charts) reaches the page. A broken stream file names no stream the
page could check, so its error is shown in full only to a user who sees every configured stream and
may see Airflow's import errors (where the same error is reported, as the import error of
``dags/tidemark_stream_files.py``); any other user sees how many files are broken.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

DAG_KINDS = ("snapshot", "drain", "consolidate", "changelog", "maintain")
FEED_DAG_KINDS = ("drain", "consolidate", "changelog", "maintain")       # dags/tidemark_streams.py: a feed has no snapshot


def stream_dag_ids(cfg: Any) -> list[str]:
    """The ids of the DAGs ``dags/tidemark_streams.py`` builds for a stream file."""
    kinds = FEED_DAG_KINDS if cfg.source.is_feed else DAG_KINDS
    return [f"tidemark_{cfg.stream}_{k}" for k in kinds]


def may_read_stream(cfg: Any, *, user: Any, auth_manager: Any,
                    team_names: Mapping[str, str | None] | None = None) -> bool:
    """Whether the auth manager lets ``user`` read every DAG of the stream (``team_names``: the team
    of each DAG id in a multi-team Airflow)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    teams = team_names or {}
    requests = [{"method": "GET", "details": DagDetails(id=dag_id, team_name=teams.get(dag_id))}
                for dag_id in stream_dag_ids(cfg)]
    return bool(auth_manager.batch_is_authorized_dag(requests, user=user))


def readable_streams(configs: Iterable[Any], *, user: Any, auth_manager: Any,
                     team_names: Mapping[str, str | None] | None = None) -> list[Any]:
    """The stream configs whose DAGs ``user`` may all read, in their order."""
    return [cfg for cfg in configs
            if may_read_stream(cfg, user=user, auth_manager=auth_manager, team_names=team_names)]


def stream_of_dag(dag_id: str | None, configs: Iterable[Any]) -> Any | None:
    """The stream config one of whose DAGs is ``dag_id``, or None."""
    if not dag_id:
        return None
    return next((cfg for cfg in configs if dag_id in stream_dag_ids(cfg)), None)


def may_see_import_errors(*, user: Any, auth_manager: Any) -> bool:
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView

    return bool(auth_manager.is_authorized_view(access_view=AccessView.IMPORT_ERRORS, user=user))


def file_problems(errors: Mapping[str, Exception], *, detailed: bool) -> list[str]:
    """The page's lines for broken stream files: each file's error when ``detailed`` (the user sees
    every configured stream and Airflow's import errors), else only their number (a broken file may
    be a stream hidden from the user)."""
    if not errors:
        return []
    if detailed:
        return [str(exc) for exc in errors.values()]
    return [f"{len(errors)} stream file(s) could not be read; their errors are shown to users who may "
            "read every stream's DAGs"]
