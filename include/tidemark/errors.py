"""Named exceptions. Every message says what was wrong and where."""


class TidemarkError(Exception):
    """Base class of every error Tidemark raises on purpose."""


class ConfigError(TidemarkError):
    """A stream configuration is invalid; the message names the key (``tables[2].name``) and why."""

    def __init__(self, key: str, reason: str, *, source: str | None = None):
        self.key = key
        self.reason = reason
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {reason}")


class StreamBusy(TidemarkError):
    """Another process holds the stream's lock (a second drain, snapshot or consolidation)."""


class SegmentError(TidemarkError):
    """A segment is malformed or inconsistent; names the segment, the record and the reason."""

    def __init__(self, segment: str, reason: str, *, record: int | None = None):
        self.segment = segment
        self.record = record
        self.reason = reason
        at = f" record {record}" if record is not None else ""
        super().__init__(f"segment {segment}{at}: {reason}")


class DecodeError(TidemarkError):
    """A pgoutput message could not be decoded; names the LSN and the message type."""


class ChangelogError(TidemarkError):
    """The exact changelog cannot be built; names the stream, table, interval and reason."""


class GapError(TidemarkError):
    """The segments of a stream do not tile the LSN line."""


class SlotLost(TidemarkError):
    """The replication slot is missing or no longer reaches the required position."""


class DrainStalled(TidemarkError):
    """The walsender showed no progress (no data, no keepalive further on) for the stall timeout;
    the drain landed nothing and the slot still holds every change."""


class LeaseLost(StreamBusy):
    """The job no longer holds its stream lock (its connection was lost or terminated); it stopped
    before committing anything that moves a position."""
