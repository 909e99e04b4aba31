"""PostgreSQL's text output -> canonical values (the table of kinds: docs/internals/storage.md).

Parsers assume the session settings below, which make the text canonical; the drain's replication
connection and every snapshot connection apply them. Imports only `tidemark.pgtypes.mapping`.
"""

from __future__ import annotations

import datetime as _dt
import re
from typing import Any, Callable

from tidemark.pgtypes.mapping import (DATE_NEG_INF, DATE_POS_INF, TS_NEG_INF, TS_POS_INF, US_PER_DAY, Column,
                                      _value_text)

_EPOCH_ORDINAL = _dt.date(1970, 1, 1).toordinal()
SESSION_SETTINGS = {
    "DateStyle": "ISO",
    "IntervalStyle": "iso_8601",
    "TimeZone": "UTC",
    "bytea_output": "hex",
    "extra_float_digits": "3",
}


def session_options() -> str:
    """The libpq ``options`` string that applies `SESSION_SETTINGS`."""
    return " ".join(f"-c {k}={v}" for k, v in SESSION_SETTINGS.items())


def days_from_civil(y: int, m: int, d: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (astronomical year, any sign)."""
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def iso_date(days: int) -> str:
    """ISO 8601 text of ``days`` since 1970-01-01, any year (astronomical: ``-0043-03-15`` is 44 BC);
    the inverse of `days_from_civil`."""
    era, doe = divmod(days + 719468, 146097)
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    m = mp + 3 if mp < 10 else mp - 9
    y = yoe + era * 400 + (m <= 2)
    return f"{'-' if y < 0 else ''}{abs(y):04d}-{m:02d}-{doy - (153 * mp + 2) // 5 + 1:02d}"


def parse_date(s: str) -> int:
    if len(s) == 10:
        return _dt.date.fromisoformat(s).toordinal() - _EPOCH_ORDINAL
    if s == "infinity":
        return DATE_POS_INF
    if s == "-infinity":
        return DATE_NEG_INF
    bc = s.endswith(" BC")
    body = s[:-3] if bc else s
    y, m, d = body.split("-")
    year = int(y)
    return days_from_civil(1 - year if bc else year, int(m), int(d))


def parse_time(s: str) -> int:
    hh, mm, rest = s.split(":")
    if "." in rest:
        sec, frac = rest.split(".")
        micros = int((frac + "000000")[:6])
    else:
        sec, micros = rest, 0
    return ((int(hh) * 60 + int(mm)) * 60 + int(sec)) * 1_000_000 + micros


_TZ_RE = re.compile(r"([+-])(\d\d)(?::?(\d\d))?(?::?(\d\d))?$")


def parse_timestamp(s: str) -> int:
    if s == "infinity":
        return TS_POS_INF
    if s == "-infinity":
        return TS_NEG_INF
    bc = s.endswith(" BC")
    if bc:
        s = s[:-3]
    date_part, time_part = s.split(" ", 1)
    days = parse_date(date_part + (" BC" if bc else ""))
    return days * US_PER_DAY + parse_time(time_part)


def parse_timestamptz(s: str) -> int:
    if s in ("infinity", "-infinity"):
        return parse_timestamp(s)
    bc = s.endswith(" BC")
    if bc:
        s = s[:-3]
    m = _TZ_RE.search(s)
    offset = 0
    if m:
        sign = 1 if m.group(1) == "+" else -1
        offset = sign * ((int(m.group(2)) * 60 + int(m.group(3) or 0)) * 60 + int(m.group(4) or 0)) * 1_000_000
        s = s[: m.start()]
    return parse_timestamp(s + (" BC" if bc else "")) - offset


def parse_bytea(s: str) -> bytes:
    if s.startswith("\\x"):
        return bytes.fromhex(s[2:])
    raise ValueError(f"bytea value is not in hex format: {s[:20]!r}")


class ArrayMisfit(ValueError):
    """An array value a column's list type cannot hold: other dimensions than the column declares,
    or lower bounds other than 1 (``'[0:1]={1,2}'``). Its column is then held as PostgreSQL's text."""


_ARRAY_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|([^,{}"]+)|([{},])', re.S)
_ELEMENT_1D = re.compile(r'"((?:[^"\\]|\\.)*)"|([^,]+)', re.S)


def _unescape(quoted: str) -> str:
    """A quoted array element's text without its escapes: array_out escapes only ``"`` and ``\\``,
    each backslash escapes the next character (pairs from the left); the text holds no NUL."""
    return quoted.replace("\\\\", "\x00").replace("\\", "").replace("\x00", "\\")


def parse_array_text(s: str, dims: int, elem: Callable[[str], Any]) -> list:
    """PostgreSQL's output text of an array (``{1,NULL,"a \\"b\\""}``, ``{{1,2},{3,4}}``) as nested
    lists ``dims`` deep of ``elem`` of each element's text (an unquoted NULL: None; a quoted
    ``"NULL"`` is the string). ``{}`` (an empty array, of any dimensions) is ``[]``. Raises
    `ArrayMisfit` for a value of other dimensions or with non-default bounds (``[0:1]={1,2}``),
    ValueError for text that is no array. Element delimiter ``,`` (every type but ``box``)."""
    if s[:1] != "{":
        if s[:1] == "[":
            raise ArrayMisfit(f"array {_value_text(s)!r} has lower bounds other than 1")
        raise ValueError(f"not an array: {_value_text(s)!r}")
    if s == "{}":
        return []
    depth = len(s) - len(s.lstrip("{"))
    if depth != dims:
        raise ArrayMisfit(f"array {_value_text(s)!r} has {depth} dimension(s), the column {dims}")
    if dims == 1 and '"' not in s and "{" not in s[1:]:
        # the common case: no element is quoted (numbers, booleans, plain words)
        return [None if t == "NULL" else elem(t) for t in s[1:-1].split(",")]
    if dims == 1:       # quoted elements (an unquoted one holds no comma, quote, brace, blank or backslash)
        out1 = []
        for quoted, bare in _ELEMENT_1D.findall(s, 1, len(s) - 1):
            if bare:
                out1.append(None if bare == "NULL" else elem(bare))
            else:
                out1.append(elem(_unescape(quoted) if "\\" in quoted else quoted))
        return out1
    stack: list[list] = []
    out: list | None = None
    for m in _ARRAY_TOKEN.finditer(s):
        quoted, bare, punct = m.groups()
        if punct == "{":
            stack.append([])
        elif punct == "}":
            done = stack.pop()
            if stack:
                stack[-1].append(done)
            else:
                out = done
        elif punct is None:
            if quoted is not None:
                stack[-1].append(elem(_unescape(quoted) if "\\" in quoted else quoted))
            else:
                stack[-1].append(None if bare == "NULL" else elem(bare))
    if out is None or stack:
        raise ValueError(f"not an array: {_value_text(s)!r}")
    return out


def _identity(s: str) -> str:
    return s


def _bool(s: str) -> bool:
    return s == "t"


_PARSERS: dict[str, Callable[[str], Any]] = {
    "int16": int, "int32": int, "int64": int, "float32": float, "float64": float, "bool": _bool,
    "numeric": _identity, "text": _identity, "bytes": parse_bytea, "date": parse_date, "time": parse_time,
    "timetz": _identity, "timestamp": parse_timestamp, "timestamptz": parse_timestamptz, "interval": _identity,
    "uuid": _identity, "json": _identity, "jsonb": _identity,
}


def text_parser(col: Column) -> Callable[[str], Any]:
    """A function from PostgreSQL's text output (under `SESSION_SETTINGS`) to the canonical value.
    An array's canonical value is its text (`lake_array` makes it a list: `array_parser`), but for
    shapes of kind ``array`` recorded without dimensions (segments landed by earlier versions)."""
    if col.kind == "array" and not col.dims:
        elem = _PARSERS[col.elem_kind or "text"]

        def parse_array(s: str) -> Any:
            try:
                return parse_array_text(s, 1, elem)
            except ArrayMisfit:     # not 1-D with default bounds: its text
                return s

        return parse_array
    if col.kind == "array":
        return _identity
    return _PARSERS[col.kind]


def array_parser(col: Column) -> Callable[[str], list]:
    """A function from an array column's text to its nested lists of canonical element values
    (`parse_array_text`, ``col.dims`` deep; raises `ArrayMisfit` for a value the lists cannot hold)."""
    elem = _PARSERS[col.elem_kind or "text"]
    dims = col.dims or 1
    return lambda s: parse_array_text(s, dims, elem)
