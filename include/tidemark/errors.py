"""Named exceptions. Every message says what was wrong and where."""

import errno
import json
import os
import re
import shutil


class TidemarkError(Exception):
    """Base class of every error Tidemark raises on purpose. ``remedy``: what to do about it, when the
    error knows (the command line prints it on a line of its own: `describe`)."""

    remedy: str | None = None


class ConfigError(TidemarkError):
    """A stream configuration is invalid; the message names the key (``tables[2].name``) and why."""

    def __init__(self, key: str, reason: str, *, source: str | None = None):
        self.key = key
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {reason}")


class StreamBusy(TidemarkError):
    """Another process holds the stream's lock (a second drain, snapshot or consolidation)."""


class SegmentError(TidemarkError):
    """A segment is malformed or inconsistent; names the segment, the record and the reason."""

    def __init__(self, segment: str, reason: str, *, record: int | None = None):
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
        reason = (f"table {facts['table']} column {facts['column']}: value {facts['value']!r} at LSN {facts['lsn']} "
                  f"cannot be stored in the lake ({facts['why']}); {self.MARK}"
                  f"{json.dumps(self.facts, ensure_ascii=True, sort_keys=True)}")
        super().__init__(segment, reason)

    @classmethod
    def find(cls, text: str) -> dict | None:
        """The facts of an `UnstorableValue` named in ``text`` (an exception's text, a Spark
        executor's traceback included), or None."""
        return _facts_after(text, cls.MARK, "table")


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


class TransientError(TidemarkError):
    """A failure that the same call may get past later: a connection to PostgreSQL that was refused,
    lost or timed out, a walsender that ended replication (a restart). Said in one line like every
    `TidemarkError`, but retried (`tidemark.failures.is_transient`)."""


class NoSpace(TidemarkError):
    """A store Tidemark writes to has no space left (ENOSPC, EDQUOT): the same write fails the same way
    until space is freed there, so it is not retried as transient (`tidemark.failures.is_transient`).
    The landing store's is `tidemark.landing.store.StoreFull`, the lake's `LakeFull`."""

    ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(where: str) -> int | None:
    """The bytes free on the file system holding ``where`` (its nearest existing parent), or None
    (an object store, an unreadable path)."""
    path = where[len("file://"):] if where.startswith("file://") else where
    if "://" in path:
        return None
    while path and not os.path.exists(path):
        parent = os.path.dirname(path.rstrip("/"))
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path or "/").free
    except OSError:
        return None


# the words of a full disk in an error's text: Python's OSError, Rust's io::Error (deltalake), Java's
# IOException (a Spark executor's), pyarrow's "Error writing bytes to file"
_NO_SPACE_TEXT = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (?:28|122)\]|"
                            r"\(os error (?:28|122)\)|\berrno (?:28|122)\b", re.IGNORECASE)


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or what can be said without it: a Py4J error's ``str`` asks the JVM for its
    message and fails when the JVM is gone."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - e.g. ConnectionRefusedError from a dead JVM
        return getattr(exc, "errmsg", "") or "(its message is in the JVM, which is gone)"


def says_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a full disk: an OSError with ENOSPC/EDQUOT,
    a `NoSpace`, or an error whose text says so (a PySpark exception carrying a Python worker's
    ``OSError: [Errno 28] …``, deltalake's ``… (os error 28)``)."""
    return any(isinstance(e, NoSpace) or isinstance(e, OSError) and e.errno in NoSpace.ERRNOS
               or _NO_SPACE_TEXT.search(safe_str(e)) for e in exception_chain(exc))


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the errors behind it (each one's ``__cause__``, else ``__context__``), each once."""
    seen, chain = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


class LakeFull(NoSpace):
    """The lake has no space for a file (a table's, changelog's or history's Parquet file, or a Delta
    commit): names the lake, the file and the bytes it needed at least (when known) and those free;
    the file is not left half-written (`layout.write_parquet`). Raised in a Spark executor too: its
    message ends with the same facts as one JSON object after `MARK`, so the driver reads them back
    from the executor's failure text (`LakeFull.find`)."""

    MARK = "[lake full] "
    remedy = "free space on the lake's volume (or move lake.path to a larger one), then run it again"

    def __init__(self, facts: dict):
        self.facts = dict(facts)
        super().__init__(f"{self.describe(self.facts)}; {self.remedy}; {self.MARK}"
                         f"{json.dumps(self.facts, sort_keys=True)}")

    def __reduce__(self):        # rebuilt from its facts (its one argument), not from its message
        return type(self), (self.facts,)

    @classmethod
    def at(cls, path: str, needed: int | None = None, what: str = "the file") -> "LakeFull":
        """The `LakeFull` of a write to ``path``: a file (``needed``: its size), or a Delta table's
        directory (``what``: "a Delta commit of")."""
        return cls({"path": path, "what": what, "needed": needed, "free": free_bytes(path)})

    @staticmethod
    def describe(facts: dict) -> str:
        """One line: the lake's file (or table) that did not fit, the bytes it needs and those free."""
        need = f"at least {facts['needed']:,} bytes" if facts.get("needed") else "more space"
        free = f"; {facts['free']:,} bytes free" if facts.get("free") is not None else ""
        return (f"the lake is full: no space left for {facts.get('what') or 'the file'} "
                f"{facts.get('path') or '(unknown)'} (it needs {need}{free})")

    @classmethod
    def find(cls, text: str) -> dict | None:
        """The facts of a `LakeFull` named in ``text`` (a Spark executor's failure text), or None."""
        return _facts_after(text, cls.MARK, "path")


def _facts_after(text: str, mark: str, key: str) -> dict | None:
    """The JSON object after ``mark`` in ``text`` when it has ``key``, or None."""
    at = text.find(mark)
    if at < 0:
        return None
    try:
        facts, _ = json.JSONDecoder().raw_decode(text, at + len(mark))
    except ValueError:
        return None
    return facts if isinstance(facts, dict) and key in facts else None


def facts_behind(exc: BaseException, cls) -> dict | None:
    """The facts of the ``cls`` error (`LakeFull`, `UnstorableValue`: an error that carries its facts
    after its ``MARK``) behind ``exc``: raised here, or in a Spark executor, when only its text reaches
    the driver; None when there is none."""
    for e in exception_chain(exc):
        found = e.facts if isinstance(e, cls) else cls.find(safe_str(e))
        if found is not None:
            return found
    return None


class LeaseLost(StreamBusy):
    """The job no longer holds its stream lock (its connection was lost or terminated); it stopped
    before committing anything that moves a position."""


# libpq's words for a connection that will fail the same way next time: the credentials, the
# database, the address or the TLS set-up are wrong (a refused or lost connection may come back)
_PERMANENT_CONNECT = re.compile(
    r"password authentication failed|no password supplied|authentication failed for user|"
    r"no pg_hba\.conf entry|pg_hba\.conf rejects|database \"[^\"]*\" does not exist|role \"[^\"]*\" does not exist|"
    r"invalid integer value|invalid port number|invalid connection option|invalid sslmode value|"
    r"missing \"=\" after|Name or service not known|"
    r"certificate verify failed|root certificate file .* does not exist|could not read root certificate|"
    r"SSL error: certificate|server does not support SSL|must be superuser or replication role|"
    r"permission denied to start WAL sender|is not a valid replication slot", re.IGNORECASE)


def permanent_connect_failure(text: str) -> bool:
    """Whether a connection error's text says it will fail the same way when tried again (a wrong
    password, an unknown database or host, a malformed port, a certificate that does not verify)."""
    return bool(_PERMANENT_CONNECT.search(text or ""))


def describe(exc: BaseException) -> tuple[str, str | None]:
    """An error as an operator reads it: (one line of what failed and where, the remedy or None). The
    remedy is the error's own ``remedy`` (cut from its message when the message ends with it), else
    what follows ``; remedy: `` in its message. Never a stack trace (`reason_line` for others)."""
    text = one_line(safe_str(exc)) if isinstance(exc, TidemarkError) else reason_line(safe_str(exc))
    if not isinstance(exc, TidemarkError):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    for mark in (LakeFull.MARK, UnstorableValue.MARK):    # the facts for the driver, not for a person
        if mark in text:
            text = text[:text.find(mark)].rstrip(" ;")
    remedy = getattr(exc, "remedy", None)
    if remedy:
        at = text.find(remedy)
        what = text[:at].rstrip(" ;:,") if at > 0 else text
        mark = what.rfind("; remedy")
        if at > 0 and mark >= 0 and what[mark:].strip(" ;:") == "remedy":
            what = what[:mark]
        return (what or text), text[at:] if at > 0 else remedy
    what, sep, rest = text.partition("; remedy: ")
    return what, (rest or None) if sep else None


def one_line(text: str) -> str:
    """``text`` on one line: its lines stripped and joined by a space (a libpq message's second
    line, "Is the server running on that host…", stays readable)."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


_EXC_LINE = re.compile(r"^(?:Caused by: )?([A-Za-z_][\w.$]*(?:Error|Exception|Failure|Exit|Interrupt))\b:?\s*(.*)$")


def reason_line(text: str, limit: int = 500) -> str:
    """The first meaningful line of an error text that may hold a Java stack trace, a Py4J dump
    ("An error occurred while calling o123.save. : org.apache.spark.SparkException: … at …") or a
    Python traceback from an executor: an ``OutOfMemoryError`` wherever it is; else the error the
    Python traceback ends with; else the deepest Java ``Caused by:``; else the first line naming an
    exception; else the first line. Never the frames. At most ``limit`` characters."""
    lines = [ln.strip().lstrip(": ").strip() for ln in str(text).splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        return ""
    if len(lines) == 1:
        return lines[0][:limit]
    frames = re.compile(r"^(at |\.\.\. \d+ more|File \"|Traceback \(most recent call last\)|\^+$)")
    meaningful = [ln for ln in lines if not frames.match(ln)]
    for ln in meaningful:
        at = ln.find("OutOfMemoryError")
        if at >= 0:
            start = ln.rfind(" ", 0, at) + 1
            return ln[start:][:limit]
    if any("Traceback (most recent call last)" in ln for ln in lines):
        # the Python traceback's own error: the exception line after its frames
        after = lines[max(i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln) + 1:]
        errs = [ln for ln in after if _EXC_LINE.match(ln) and not ln.startswith("at ")]
        if errs:
            return next((e for e in errs if not e.startswith(("org.", "java.", "py4j."))), errs[0])[:limit]
    caused = [ln for ln in meaningful if ln.startswith("Caused by: ")]
    if caused:
        return caused[-1][len("Caused by: "):][:limit]
    errs = [ln for ln in meaningful if _EXC_LINE.match(ln)]
    if errs:
        return errs[0][:limit]
    return (meaningful or lines)[0][:limit]


# what changes from one occurrence of the same failure to the next inside an error text
_VOLATILE_TEXT = [
    (re.compile(r"\b(attempts?|try|tries|retry|retries|try_number)(\s*#?\s*)\d+(\s*(?:of|/)\s*\d+)?", re.I), r"\1\2N"),
    (re.compile(r"\b(pid|PID|backend pid|process)\s+\d+"), r"\1 N"),
    (re.compile(r"\(TID \d+\)"), "(TID N)"),
    (re.compile(r"\b(stage|task) \d+(\.\d+)?", re.I), r"\1 N"),
    (re.compile(r"\bo\d+\.(?=\w)"), "oN."),                                           # Py4J object ids
    (re.compile(r"\b(app|application|local|driver)-\d{8,}(-\d+)*"), r"\1-N"),           # Spark application ids
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I), "<uuid>"),
    (re.compile(r"(\.tmp-|tmp)[A-Za-z0-9_]{6,}"), r"\1*"),                                # temporary names
    (re.compile(r"\b\d+(\.\d+)?\s?(s|ms|seconds)\b"), "N s"),                               # elapsed times
    (re.compile(r"(no space left for the file )\S+"), r"\1<file>"),          # which task failed first
    (re.compile(r"\b(at least )?[\d,]+ bytes( free)?"), r"\1N bytes\2"),     # a full disk's amounts
]


def normalize_reason(text: str) -> str:
    """An error's one-line reason without what changes between two occurrences of the same failure
    (attempt numbers, pids, Spark stage/task ids, application ids, temporary names, elapsed times):
    equal for equal causes, so repeats count on one incident."""
    out = reason_line(text)
    for pattern, repl in _VOLATILE_TEXT:
        out = pattern.sub(repl, out)
    return out
