"""The control database: streams, subscribers, the segment manifest, snapshots, incidents, metrics.

Owns every statement on the ``tidemark.*`` tables (`db.Control`, its parts by responsibility in the
modules beside it) and their migrations (``migrations/NNNN_*.sql``). Imports only `tidemark.config`,
`tidemark.connections`, `tidemark.errors` and `tidemark.lsn`.
"""

from __future__ import annotations

import psycopg2

from tidemark.config import StreamConfig
from tidemark.connections import connect_failure, resolve_dsn
from tidemark.control.db import Control, Segment, StreamState


def control_dsn(cfg: StreamConfig) -> str:
    """The DSN of the stream's control database (its connection id resolved)."""
    return resolve_dsn(cfg.control_connection)


def open_control(cfg: StreamConfig) -> Control:
    """A `Control` on the stream's control database. One that cannot be reached (a wrong password, host
    or port, a refused connection) is one `TidemarkError` line naming the stream, the connection id,
    host:port, libpq's message and what to do (`connect_failure`), raised from libpq's error, so a
    refused connection is still retried and a wrong password is not (`tidemark.failures.is_transient`)."""
    dsn = control_dsn(cfg)
    try:
        return Control(dsn)
    except psycopg2.OperationalError as exc:
        raise connect_failure(exc, stream=cfg.stream, role="the control database", conn_id=cfg.control_connection,
                              dsn=dsn) from exc


__all__ = ["Control", "Segment", "StreamState", "control_dsn", "open_control"]
