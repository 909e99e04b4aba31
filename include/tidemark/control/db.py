"""The control database: streams, subscribers, the segment manifest, snapshots, incidents, metrics.

All state lives in the ``tidemark`` schema of a PostgreSQL database. `Control` is one connection to it,
its methods by responsibility in the modules beside this one, each a mixin over `connection.Connection`
(which applies the migrations, ``control/migrations/NNNN_*.sql``): `streams` (their tables, frontier and
subscribers), `lease`, `manifest` (segments, feed files), `snapshots`, `incidents` and `figures` (the
status page's). The names other modules import from here are re-exported.
"""

from __future__ import annotations

from tidemark.control.connection import CONNECT_TIMEOUT_SECONDS, Connection
from tidemark.control.figures import FiguresMixin, lag_summary
from tidemark.control.incidents import (CAUSE_KEYS, NUMBERS_BLANKED, VOLATILE_DETAIL_KEYS, IncidentsMixin,
                                        cause_key, incident_cause)
from tidemark.control.lease import (COMPATIBLE_PURPOSES, LOCK_PURPOSES, LOCK_WAIT_ENV, NESTED_PURPOSES, Lease,
                                    LeaseMixin, exclusion_matrix, lock_compatible, lock_wait_seconds)
from tidemark.control.manifest import ManifestMixin, Segment
from tidemark.control.snapshots import SnapshotsMixin
from tidemark.control.streams import StreamState, StreamsMixin
from tidemark.errors import LeaseLost, StreamBusy


class Control(StreamsMixin, LeaseMixin, ManifestMixin, SnapshotsMixin, IncidentsMixin, FiguresMixin, Connection):
    """A connection to the control database. Each method commits its own transaction."""


__all__ = ["CAUSE_KEYS", "COMPATIBLE_PURPOSES", "CONNECT_TIMEOUT_SECONDS", "LOCK_PURPOSES", "LOCK_WAIT_ENV",
           "NESTED_PURPOSES", "NUMBERS_BLANKED", "VOLATILE_DETAIL_KEYS", "Control", "Lease", "LeaseLost",
           "Segment", "StreamBusy", "StreamState", "cause_key", "exclusion_matrix", "incident_cause", "lag_summary",
           "lock_compatible", "lock_wait_seconds"]
