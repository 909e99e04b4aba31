"""The control database: streams, subscribers, the segment manifest, snapshots, incidents, metrics.

Owns every statement on the ``tidemark.*`` tables (`db.Control`, its parts by responsibility in the
modules beside it) and their migrations (``migrations/NNNN_*.sql``). Imports only `tidemark.config`,
`tidemark.connections`, `tidemark.errors` and `tidemark.lsn`.
"""

from __future__ import annotations

from tidemark.config import StreamConfig
from tidemark.connections import resolve_dsn
from tidemark.control.db import Control, Segment, StreamState


def control_dsn(cfg: StreamConfig) -> str:
    """The DSN of the stream's control database (its connection id resolved)."""
    return resolve_dsn(cfg.control_connection)


def open_control(cfg: StreamConfig) -> Control:
    """A `Control` on the stream's control database."""
    return Control(control_dsn(cfg))


__all__ = ["Control", "Segment", "StreamState", "control_dsn", "open_control"]
