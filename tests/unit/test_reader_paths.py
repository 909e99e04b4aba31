"""`SlotReader` over a scripted replication stream (no database): where a read ends (a keepalive at
the target, a limit at a commit, a re-drain's upper at a Begin), what its waits report, and each of
its errors (a Begin before the start, an unmatched Commit, a change before its Relation, an unknown
message, the end of the stream, no progress).

Messages are built with `struct` from the protocol documentation (`test_pgoutput`'s builders); the
stream hands them out as libpq does (``n`` bytes and the message; None in the script: nothing
buffered, 0), then 0 or -1 (the server ended the stream) for ever."""

from __future__ import annotations

import struct
import types

import pytest

from test_pgoutput import relation_msg, tuple_data
from tidemark.capture import reader
from tidemark.capture.reader import SlotReader
from tidemark.errors import DecodeError, DrainStalled, TidemarkError, TransientError
from tidemark.landing.segments import SegmentWriter

OID = 16384


def xlog(payload: bytes) -> bytes:
    return b"w" + struct.pack(">QQq", 0, 0, 0) + payload


def begin(final_lsn: int, xid: int = 7) -> bytes:
    return xlog(b"B" + struct.pack(">QqI", final_lsn, 1_000, xid))


def commit(commit_lsn: int, end_lsn: int) -> bytes:
    return xlog(b"C" + struct.pack(">BQQq", 0, commit_lsn, end_lsn, 1_000))


def insert(i: int, v: str, oid: int = OID) -> bytes:
    return xlog(b"I" + struct.pack(">I", oid) + b"N" + tuple_data(str(i), v))


def keepalive(wal_end: int, reply: int = 0) -> bytes:
    return b"k" + struct.pack(">QqB", wal_end, 0, reply)


RELATION = xlog(relation_msg(OID, "public", "t", "d", [(1, "id", 23, -1), (0, "v", 25, -1)]))
# two transactions: two rows committing at 0x200 (end 0x210), one at 0x300 (end 0x310)
TWO = [begin(0x200), RELATION, insert(1, "a"), insert(2, "b"), commit(0x200, 0x210),
       begin(0x300), insert(3, "c"), commit(0x300, 0x310)]


class Stream:
    """What the reader uses of a `WalStream`: the scripted messages (None: nothing buffered), then ``end``."""

    def __init__(self, messages: list[bytes], end: int):
        self.messages, self.end, self.statuses, self.waits = list(messages), end, [], 0
        self.pg = types.SimpleNamespace(get_copy_data=self._get)
        self.backend_pid = 1

    def _get(self, async_: int):
        if self.messages:
            m = self.messages.pop(0)
            return (0, None) if m is None else (len(m), m)
        return self.end, None

    def send_status(self, *, reply: bool = False) -> None:
        self.statuses.append(reply)

    def wait(self, timeout: float) -> None:
        self.waits += 1
        assert self.waits < 100, "the read waits for ever"

    def error_text(self) -> str:
        return "terminating connection due to administrator command"


def read(messages: list[bytes | None], *, target: int = 0x1000, end: int = 0, progress=None, **kw):
    stream = Stream(messages, end)
    seg = SegmentWriter("s", 0, 0x100, codec="null")
    slot = SlotReader(types.SimpleNamespace(stream="s"), stream, seg, progress)
    args = {"exact_upper": False, "max_changes": None, "max_bytes": None, "idle_timeout": 30.0, **kw}
    return slot.read(lower=0x100, target=target, **args), seg, stream


def test_a_keepalive_at_the_target_between_transactions_ends_the_read_with_every_transaction():
    out, seg, stream = read([*TWO, keepalive(0x1000, reply=1)])
    assert (out.upper, out.changes, out.reached) == (0x1000, 3, True)
    assert (seg.records, seg.txns, seg.counts) == (3, 2, {0x200: 2, 0x300: 1})
    assert stream.statuses[0] is False          # the keepalive asked for a reply: a status, not a ping


def test_a_keepalive_inside_a_transaction_moves_nothing_and_no_progress_stalls_the_read():
    with pytest.raises(DrainStalled) as err:
        read([begin(0x200), RELATION, insert(1, "a"), keepalive(0x1000)], stall_timeout=0.0)
    assert "stopped inside a transaction, whole transactions received up to 0/100" in str(err.value)
    assert "no keepalive past 0/1000" in str(err.value)


def test_waits_ask_for_keepalives_and_report_how_far_the_walsender_has_decoded(monkeypatch):
    monkeypatch.setattr(reader, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(reader, "PING_SECONDS", 0.0)
    reports: list[dict] = []
    out, seg, stream = read([begin(0x200), RELATION, insert(1, "a"), None, keepalive(0x800), None,
                             commit(0x200, 0x210), keepalive(0x1000)], idle_timeout=0.0, progress=reports.append)
    assert (out.upper, out.changes, seg.records) == (0x1000, 1, 1)
    assert [(r["lsn"], r.get("decoded")) for r in reports] == [(0x100, 0), (0x100, 0x800), (0x210, None),
                                                                (0x1000, None)]
    assert stream.statuses == [True, True] and stream.waits == 2      # a ping before each wait


def test_a_limit_ends_the_read_at_a_commit():
    out, seg, _ = read(TWO, max_changes=2)
    assert (out.upper, out.changes, out.reached) == (0x210, 2, False)
    assert (seg.txns, seg.counts) == (1, {0x200: 2})


def test_a_redrain_ends_at_the_begin_of_a_transaction_committing_at_its_upper():
    out, seg, _ = read(TWO, target=0x300, exact_upper=True, max_changes=1)      # its limits do not apply
    assert (out.upper, out.changes, out.reached) == (0x300, 2, True)
    assert (seg.txns, seg.counts) == (1, {0x200: 2})


@pytest.mark.parametrize("messages, error, says", [
    ([begin(0xF0, xid=9)], DecodeError, "transaction 9 commits at 0/F0, before the drain's start 0/100"),
    ([commit(0x200, 0x210)], DecodeError, "Commit at 0/200 does not match the open transaction"),
    ([begin(0x200), commit(0x201, 0x210)], DecodeError, "Commit at 0/201 does not match the open transaction (0/200)"),
    ([begin(0x200), insert(1, "a")], DecodeError, "relation OID 16384 at LSN 0/200 before any Relation message"),
    ([b"x" + bytes(8)], DecodeError, "unknown replication message 'x'"),
    ([begin(0x200), xlog(b"Z")], DecodeError, "unknown pgoutput message 'Z' after LSN 0/200"),
    ([], TransientError, "the server ended replication: terminating connection due to administrator command"),
])
def test_each_error_names_what_was_wrong_and_where(messages, error, says):
    with pytest.raises(TidemarkError) as err:
        read(messages, end=-1)
    assert type(err.value) is error and says in str(err.value), err.value
