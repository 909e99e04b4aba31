"""
# Tidemark stream files: their errors

Airflow records import errors per DAG file. `tidemark_streams.py` builds the DAGs of every valid
stream file and leaves broken ones out, so one bad file cannot remove every stream's DAGs; this
file defines no DAG and fails to import, naming each broken stream file and its key, so the error
shows in Airflow's import errors (UI, `GET /api/v2/importErrors`, `airflow dags list-import-errors`)
until the file is fixed.
"""

from __future__ import annotations

import os
from pathlib import Path

from tidemark.config import scan_stream_dir
from tidemark.errors import ConfigError

STREAMS_DIR = Path(os.environ.get("TIDEMARK_STREAMS_DIR") or Path(__file__).resolve().parent.parent / "include" / "streams")

_errors = scan_stream_dir(STREAMS_DIR)[1]
if _errors:
    raise ConfigError("(stream files)", f"{len(_errors)} broken stream file(s) in {STREAMS_DIR}, their DAGs are "
                      "not loaded:\n" + "\n".join(str(e) for e in _errors.values()))
