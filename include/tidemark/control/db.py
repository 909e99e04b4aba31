"""The control database: streams, subscribers, the segment manifest, snapshots, incidents, metrics.

All state lives in the ``tidemark`` schema of a PostgreSQL database. `Control`, one connection to it,
is the mixins of the modules beside this one by responsibility (`streams`, `lease`, `manifest`,
`incidents`, `figures`) over `connection.Connection` (which applies ``migrations/NNNN_*.sql``).
"""

from __future__ import annotations

from tidemark.control.connection import Connection
from tidemark.control.figures import FiguresMixin, lag_summary
from tidemark.control.incidents import NUMBERS_BLANKED, IncidentsMixin
from tidemark.control.lease import (COMPATIBLE_PURPOSES, LOCK_PURPOSES, LOCK_WAIT_ENV, LeaseMixin, exclusion_matrix,
                                    lock_compatible, lock_wait_seconds)
from tidemark.control.manifest import ManifestMixin, Segment
from tidemark.control.streams import StreamState, StreamsMixin
from tidemark.errors import StreamBusy


class Control(StreamsMixin, LeaseMixin, ManifestMixin, IncidentsMixin, FiguresMixin, Connection):
    """A connection to the control database. Each method commits its own transaction."""


__all__ = ["COMPATIBLE_PURPOSES", "LOCK_PURPOSES", "LOCK_WAIT_ENV", "NUMBERS_BLANKED", "Control", "Segment",
           "StreamBusy", "StreamState", "exclusion_matrix", "lag_summary", "lock_compatible", "lock_wait_seconds"]
