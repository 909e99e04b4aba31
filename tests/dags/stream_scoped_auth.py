"""A test auth manager that can give a user read access to some DAGs only.

Airflow's SimpleAuthManager grants by role (viewer, user, op, admin) over every DAG, and the FAB auth
manager (per-DAG permissions) is not installed; this subclass adds per-DAG grants for the status
page's permission tests. It is configured like the simple one (``[core] auth_manager`` =
``stream_scoped_auth.StreamScopedAuthManager``, users in ``simple_auth_manager_users``); a user named
in ``TIDEMARK_TEST_DAG_GRANTS`` (JSON ``{"user": ["dag_id", ...]}``) may read exactly those DAGs and
change none, and may read DAGs "in general" (a check without a DAG id) when granted any, as a
per-DAG role of the FAB auth manager does. Every other check is SimpleAuthManager's.
"""

from __future__ import annotations

import json
import os

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

GRANTS_ENV = "TIDEMARK_TEST_DAG_GRANTS"


class StreamScopedAuthManager(SimpleAuthManager):
    def __init__(self, grants: dict[str, list[str]] | None = None) -> None:
        super().__init__()
        raw = grants if grants is not None else json.loads(os.environ.get(GRANTS_ENV) or "{}")
        self.grants = {user: frozenset(ids) for user, ids in raw.items()}

    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        granted = self.grants.get(user.username)
        if granted is None:
            return super().is_authorized_dag(method=method, user=user, access_entity=access_entity,
                                             details=details)
        if method != "GET":
            return False
        if details is None or details.id is None:
            return bool(granted)
        return details.id in granted
