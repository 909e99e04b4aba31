"""The control database: streams, subscribers, the segment manifest, snapshots, incidents, metrics.

All state lives in the ``tidemark`` schema of a PostgreSQL database. `Control`, one connection to it,
is the mixins of the modules beside this one by responsibility (`streams`, `lease`, `manifest`,
`incidents`, `figures`) over `connection.Connection` (which applies ``migrations/NNNN_*.sql``).
"""

from __future__ import annotations

from tidemark.control.connection import Connection
from tidemark.control.figures import FiguresMixin, lag_summary
from tidemark.control.incidents import (CAUSE_KEYS, NUMBERS_BLANKED, VOLATILE_DETAIL_KEYS, IncidentsMixin,
                                        cause_key, incident_cause)
from tidemark.control.lease import (COMPATIBLE_PURPOSES, LOCK_PURPOSES, LOCK_WAIT_ENV, NESTED_PURPOSES, Lease,
                                    LeaseMixin, exclusion_matrix, lock_compatible, lock_wait_seconds)
from tidemark.control.manifest import ManifestMixin, Segment
from tidemark.control.streams import StreamState, StreamsMixin
from tidemark.errors import LeaseLost, StreamBusy


class Control(StreamsMixin, LeaseMixin, ManifestMixin, IncidentsMixin, FiguresMixin, Connection):
    """A connection to the control database. Each method commits its own transaction."""


__all__ = ["CAUSE_KEYS", "COMPATIBLE_PURPOSES", "LOCK_PURPOSES", "LOCK_WAIT_ENV", "NESTED_PURPOSES", "NUMBERS_BLANKED",
           "VOLATILE_DETAIL_KEYS", "Control", "Lease", "LeaseLost", "Segment", "StreamBusy", "StreamState", "cause_key",
           "exclusion_matrix", "incident_cause", "lag_summary", "lock_compatible", "lock_wait_seconds"]
