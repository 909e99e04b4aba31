"""The Airflow Assets of a stream's lake tables: one per table, updated by the consolidation that
gives the table a new Delta version (`TidemarkSparkSubmitOperator.publish_tables`), and by no other.

The URI is ``tidemark://<stream>/<schema>.<table>``: it names what a downstream DAG depends on, the
stream's table, not where the lake keeps it. A lake moved to another path or store (``lake.path``)
keeps its Assets, their event history and the DAGs scheduled on them; the table's location and the
version to read are in each event's extra. Its name is ``tidemark_<stream>_<schema>.<table>``.
"""

from __future__ import annotations

from urllib.parse import quote

from airflow.sdk import Asset, AssetAlias


def table_asset(stream: str, table: str) -> Asset:
    """The Asset of lake table ``table`` (``schema.table``) of ``stream``."""
    return Asset(name=f"tidemark_{stream}_{table}", uri=f"tidemark://{stream}/{quote(table, safe='.')}",
                 group="tidemark")


def tables_alias(stream: str) -> AssetAlias:
    """The consolidation's outlet: an alias through which it updates the Assets of the tables it
    changed only (a declared Asset outlet gets an event whenever its task succeeds, changed or not)."""
    return AssetAlias(name=f"tidemark_{stream}_tables", group="tidemark")
