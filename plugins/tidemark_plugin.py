"""Register Tidemark with Airflow: the plugin lists the hook so the UI shows its connection type."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin


class TidemarkPlugin(AirflowPlugin):
    """The Tidemark plugin (operators, sensor and hook live in the ``tidemark_airflow`` package)."""

    name = "tidemark"
