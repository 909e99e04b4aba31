"""
# A downstream DAG on one lake table's Asset (an example)

`example_<stream>_downstream` is scheduled on the Asset of one lake table,
`tidemark://<stream>/<schema>.<table>` (`tidemark_airflow.assets.table_asset`): it runs after each
consolidation that gave that table a new Delta version, and not after one that left it alone. Its task
reads the event's extra (stream, table, frontier, Delta version, rows inserted / updated / deleted)
and counts the table's rows at that version (time travel: later commits do not change the answer).

The table is `TIDEMARK_EXAMPLE_TABLE` (`<stream>:<schema>.<table>`, default `demo:public.orders`); no
DAG is built when that stream file is not loaded. Copy this file to depend on your own tables.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, task
from tidemark.config import scan_stream_dir
from tidemark_airflow.assets import table_asset

STREAMS_DIR = Path(os.environ.get("TIDEMARK_STREAMS_DIR") or Path(__file__).resolve().parent.parent / "include" / "streams")
STREAM, _, TABLE = (os.environ.get("TIDEMARK_EXAMPLE_TABLE") or "demo:public.orders").partition(":")


@task
def count_rows(stream_file: str, table: str, **context) -> list[dict]:
    """Each triggering event's table version and its row count (a manual run: the newest version)."""
    from deltalake import DeltaTable

    from tidemark.config import load_config
    from tidemark.lake import storage_options, table_uri

    cfg = load_config(stream_file)
    # (by the Asset: an event sent through the consolidation's alias is under the alias's key too)
    events = list((context.get("triggering_asset_events") or {}).get(table_asset(cfg.stream, table), []))
    versions = [e.extra.get("version") for e in events] or [None]
    out = []
    for event, version in zip(events or [None], versions):
        dt = DeltaTable(table_uri(cfg, table), version=version, storage_options=storage_options(cfg))
        got = {"table": table, "version": dt.version(), "rows": dt.to_pyarrow_dataset().count_rows(),
               "event": dict(event.extra) if event is not None else None}
        print(f"lake table {table} version {got['version']}: {got['rows']} rows (event {got['event']})")
        out.append(got)
    return out


for _cfg in scan_stream_dir(STREAMS_DIR)[0]:
    if _cfg.stream == STREAM and TABLE in {t.qualified for t in _cfg.source.tables}:
        with DAG(
            dag_id=f"example_{_cfg.stream}_downstream",
            doc_md=f"Example consumer of lake table `{TABLE}` of stream `{_cfg.stream}`: runs on its Asset "
                   f"`{table_asset(_cfg.stream, TABLE).uri}`, i.e. after each consolidation that changed that "
                   "table, and counts its rows at the event's Delta version.",
            schedule=[table_asset(_cfg.stream, TABLE)], start_date=datetime(2024, 1, 1), catchup=False,
            default_args={"owner": "tidemark", "retries": 1, "retry_delay": timedelta(seconds=30)},
            tags=["tidemark", f"stream:{_cfg.stream}", "example"],
        ) as _dag:
            count_rows(_cfg.origin, TABLE)
        globals()[_dag.dag_id] = _dag
