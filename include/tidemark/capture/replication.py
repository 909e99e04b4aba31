"""The replication client: a logical replication connection through libpq (psycopg's ``pq``) that
never confirms more than it is told (why not psycopg2's: docs/internals/capture.md). Imports only
`tidemark.capture.pgoutput`, `tidemark.pgtypes`, `tidemark.lsn` and `tidemark.errors`.
"""

from __future__ import annotations

import contextlib
import select
import struct
import time

from psycopg import pq
from psycopg.conninfo import make_conninfo

from tidemark.capture.pgoutput import PG_EPOCH_US, PROTO_VERSION
from tidemark.errors import StreamBusy, TidemarkError, TransientError
from tidemark.lsn import format_lsn, parse_lsn
from tidemark.pgtypes import session_options

_STATUS = struct.Struct(">cQQQqB").pack          # 'r': write, flush, apply, now, reply
XLOG_BLCKSZ = 8192


def _past_page_header(lsn: int) -> int:
    """``lsn`` moved back to its page's start when it points just past a WAL page header: no record
    ends inside a header, so nothing commits between the two and the walsender reports the start."""
    off = lsn % XLOG_BLCKSZ
    return lsn - off if off in (24, 40) else lsn


def _as_text(message: bytes | str | None) -> str:
    """A libpq message (bytes from ``PGconn.error_message``, text from newer ``get_error_message``) as
    one line of text."""
    if isinstance(message, (bytes, bytearray)):
        message = bytes(message).decode(errors="replace")
    return " ".join((message or "").split())


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class WalStream:
    """A logical replication connection (libpq through psycopg's ``pq``) that never confirms more than
    it is told to: every status message carries ``ack`` (or 0 = no change) as its flush position."""

    def __init__(self, dsn: str, *, extra_options: str = ""):
        options = (session_options() + " " + extra_options).strip()
        conninfo = make_conninfo(dsn, replication="database", application_name="tidemark-drain",
                                 options=options, client_encoding="UTF8")
        self.pg = pq.PGconn.connect(conninfo.encode())
        if self.pg.status != pq.ConnStatus.OK:
            msg = self.error_text()
            self.pg.finish()
            # refused, timed out, the server starting up: retried; a wrong password or certificate is not
            # (`tidemark.failures.is_transient` reads the message)
            raise TransientError(f"cannot open a replication connection to the source: {msg}")
        self.ack = 0
        self.streaming = False
        self.backend_pid = self.pg.backend_pid

    def identify(self) -> int:
        """The drain's end position: every transaction committed before this call commits below it,
        and the walsender can always reach it (a marker transaction's WAL insert position, else the
        server's flush position: docs/internals/capture.md)."""
        res = self.pg.exec_(b"IDENTIFY_SYSTEM")
        if res.status != pq.ExecStatus.TUPLES_OK:
            raise TidemarkError(f"IDENTIFY_SYSTEM failed: {self._error(res)}")
        flushed = parse_lsn(res.get_value(0, 2).decode())
        end = None
        for stmt in (b"BEGIN", b"SET LOCAL synchronous_commit = on", b"SELECT pg_current_xact_id()",
                     b"SELECT pg_current_wal_insert_lsn()::text", b"COMMIT"):
            res = self.pg.exec_(stmt)
            if res.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
                self.pg.exec_(b"ROLLBACK")
                return _past_page_header(flushed)
            if stmt.startswith(b"SELECT pg_current_wal"):
                end = parse_lsn(res.get_value(0, 0).decode())
        return end if end is not None else _past_page_header(flushed)

    def start(self, slot: str, lsn: int, publication: str, busy_wait: float = 0.0) -> None:
        """START_REPLICATION of the slot at ``lsn`` with pgoutput protocol version 1. A slot another
        process holds is asked for again for up to ``busy_wait`` seconds before `StreamBusy`: a
        consolidation advancing it (``pg_replication_slot_advance``) or the previous drain's walsender
        still exiting hold it for moments only."""
        pub = _quote_ident(publication).replace("'", "''")
        cmd = (f"START_REPLICATION SLOT {_quote_ident(slot)} LOGICAL {format_lsn(lsn)} "
               f"(proto_version '{PROTO_VERSION}', publication_names '{pub}')")
        deadline = time.monotonic() + busy_wait
        while True:
            self.pg.send_query(cmd.encode())
            res = self.pg.get_result()
            if res is not None and res.status == pq.ExecStatus.COPY_BOTH:
                break
            msg = self._error(res)
            while self.pg.get_result() is not None:      # the failed command's end: the connection is idle again
                pass
            if "is active for PID" not in msg:
                raise TidemarkError(f"START_REPLICATION of slot {slot} at {format_lsn(lsn)} failed: {msg}")
            if time.monotonic() >= deadline:
                raise StreamBusy(f"replication slot {slot} is in use by another process: {msg}")
            time.sleep(0.2)
        self.pg.nonblocking = 1
        self.streaming = True

    def _error(self, res) -> str:
        text = res.error_message if res is not None else b""
        return _as_text(text) or self.error_text()

    def error_text(self) -> str:
        """The connection's last error message, on one line."""
        return _as_text(self.pg.error_message)

    def send_status(self, *, reply: bool = False) -> None:
        """Send a standby status update: write = flush = apply = ``self.ack`` (0 = no change)."""
        now = int(time.time() * 1_000_000) - PG_EPOCH_US
        msg = _STATUS(b"r", self.ack, self.ack, self.ack, now, 1 if reply else 0)
        if self.pg.put_copy_data(msg) != 1:
            raise TransientError("replication connection lost: cannot send a status update: "
                                 f"{self.error_text()}")
        self._flush()

    def _flush(self) -> None:
        while self.pg.flush() == 1:
            select.select([], [self.pg.socket], [], 1.0)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for data, then pull it into libpq's buffer."""
        select.select([self.pg.socket], [], [], timeout)
        try:
            self.pg.consume_input()
        except Exception as exc:
            raise TransientError(f"replication connection lost: {' '.join(str(exc).split())}") from exc

    def close(self, timeout: float = 10.0) -> None:
        """End replication cleanly (so the slot is released when this returns), then disconnect."""
        if self.pg.status == pq.ConnStatus.OK and self.streaming:
            with contextlib.suppress(Exception):    # closing anyway: the server ends the walsender on disconnect
                self._end_copy(time.monotonic() + timeout)
        self.pg.finish()

    def _end_copy(self, deadline: float) -> None:
        """Send CopyDone, discard what the walsender still sends, wait for the command to finish."""
        self.pg.put_copy_end()
        self._flush()
        while time.monotonic() < deadline:
            n, _ = self.pg.get_copy_data(1)
            if n == -1:
                break
            if n == 0:
                self.wait(0.2)
            elif n < -1:
                return
        while time.monotonic() < deadline:
            self.pg.consume_input()
            if self.pg.is_busy():
                select.select([self.pg.socket], [], [], 0.2)
                continue
            if self.pg.get_result() is None:
                self.streaming = False
                return
