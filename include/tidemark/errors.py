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


class UnstorableValue(SegmentError):
    """A landed value its column's lake type cannot hold (NaN in a ``numeric(p,s)``, ...): names the
    table, column, value, its LSN and the segment. The message ends with the same facts as one JSON
    object after `MARK`, so that the driver can read them back from a Spark executor's failure text
    (`UnstorableValue.facts`)."""

    MARK = "[unstorable value] "

    def __init__(self, segment: str, facts: dict):
        self.facts = dict(facts, segment=segment)
        import json

        reason = (f"table {facts['table']} column {facts['column']}: value {facts['value']!r} at LSN {facts['lsn']} "
                  f"cannot be stored in the lake ({facts['why']}); {self.MARK}"
                  f"{json.dumps(self.facts, ensure_ascii=True, sort_keys=True)}")
        super().__init__(segment, reason)

    @classmethod
    def find(cls, text: str) -> dict | None:
        """The facts of an `UnstorableValue` named in ``text`` (an exception's text, a Spark
        executor's traceback included), or None."""
        import json

        at = text.find(cls.MARK)
        if at < 0:
            return None
        try:
            facts, _ = json.JSONDecoder().raw_decode(text, at + len(cls.MARK))
        except ValueError:
            return None
        return facts if isinstance(facts, dict) and "table" in facts else None


class DecodeError(TidemarkError):
    """A pgoutput message could not be decoded; names the LSN and the message type."""


class ConsolidateError(TidemarkError):
    """Consolidation cannot go on; names the stream, table and reason."""


class TableNeedsSnapshot(ConsolidateError):
    """One table's lake copy cannot follow a change PostgreSQL sent nothing for (a volatile DEFAULT,
    RENAME COLUMN): a re-snapshot of that table alone, while the stream runs, mends it (``table``).
    The consolidate DAG's resend step does it by itself (`tidemark.gaps.detect` reads it from the
    incident)."""

    def __init__(self, message: str, *, table: str):
        super().__init__(message)
        self.table = table


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


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same call later can succeed: a lost or refused connection, a timeout,
    another process holding the stream's lock (or a lost lease), a stalled walsender. Everything Tidemark raises on purpose otherwise (bad
    configuration, a bad segment, a state conflict such as a second initial snapshot) and programming
    errors (ValueError, TypeError, KeyError) are deterministic: the same input fails the same way.
    An error caused by a transient one (``raise … from``) is transient, except a Spark failure that
    the same settings repeat (`tidemark.sparkconf.classify`: out of memory, a dead driver
    JVM, the library or Python missing on the executors; a lost executor or an unreachable master
    is transient). Unknown errors count as transient (a retry
    is the safe default)."""
    try:
        import psycopg2

        lost = (psycopg2.OperationalError, psycopg2.InterfaceError)
    except ImportError:  # pragma: no cover - psycopg2 is a dependency
        lost = ()
    from tidemark.sparkconf import RETRYABLE, classify

    spark = classify(exc)
    if spark is not None and not spark[0].startswith(RETRYABLE):
        return False
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (StreamBusy, DrainStalled)):   # LeaseLost is a StreamBusy
            return True
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if lost and isinstance(exc, lost):
            return True
        cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if cause is None:
            return not isinstance(exc, (TidemarkError, ValueError, TypeError, KeyError, AttributeError,
                                        NotImplementedError))
        exc = cause
    return False
