"""Log sequence numbers: PostgreSQL's ``X/Y`` text and the 64-bit integer Tidemark stores and orders by.

Every LSN Tidemark prints goes through `format_lsn` (``0/16B3748``, ``-`` for none); every LSN it
reads from the server's text goes through `parse_lsn`. Imports nothing from Tidemark.
"""

from __future__ import annotations


def format_lsn(lsn: int | None) -> str:
    """``0/16B3748`` for an LSN, ``-`` for None."""
    if lsn is None:
        return "-"
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """The integer of an LSN's text form ``X/Y``; ValueError for anything else."""
    hi, sep, lo = text.strip().partition("/")
    if not sep:
        raise ValueError(f"{text!r} is not an LSN (expected X/Y in hexadecimal)")
    return (int(hi, 16) << 32) | int(lo, 16)
