"""`tidemark read` prints dates and timestamps Python cannot hold (PostgreSQL's ±infinity, BC dates,
years past 9999), at any depth, as text; it failed with "year 5881580 is out of range". Columns Python
holds print as before."""

from __future__ import annotations

import datetime as dt
import random

import pyarrow as pa

from tidemark.cli.output import python_rows
from tidemark.pgtypes.text import days_from_civil, iso_date, parse_date, parse_timestamptz

UTC = pa.timestamp("us", tz="UTC")


def test_iso_date_is_the_inverse_of_days_from_civil_and_pythons_where_python_has_the_year():
    rng = random.Random(7)
    for n in [rng.randint(-2**31 + 1, 2**31 - 2) for _ in range(20000)] + [0, -1, -719162, 2932896]:
        text = iso_date(n)
        y, m, d = text.lstrip("-").split("-")
        assert days_from_civil(-int(y) if text.startswith("-") else int(y), int(m), int(d)) == n, (n, text)
    for n in range(-719162, 2932897, 4999):
        assert iso_date(n) == (dt.date(1970, 1, 1) + dt.timedelta(days=n)).isoformat()
    assert iso_date(parse_date("0044-03-15 BC")) == "-0043-03-15" and iso_date(parse_date("5874897-12-31")) == \
        "5874897-12-31"


def test_out_of_range_values_print_as_text_at_any_depth_and_others_as_before():
    days = [parse_date(s) for s in ("infinity", "-infinity", "0044-03-15 BC", "5874897-12-31", "2020-01-02")] + [None]
    stamps = [parse_timestamptz(s) for s in ("infinity", "-infinity", "0044-03-15 12:00:00+00 BC",
                                             "294246-12-31 23:59:59+00", "2020-01-02 03:04:05+00")] + [None]
    table = pa.table({"id": list(range(6)), "d": pa.array(days, pa.date32()), "ts": pa.array(stamps, UTC),
                      "l": pa.array([None if s is None else [s, None] for s in stamps], pa.list_(UTC)),
                      "s": pa.array([None if d is None else {"a": d} for d in days], pa.struct([("a", pa.date32())])),
                      "ok": pa.array([parse_date("2020-01-02")] * 6, pa.date32())})
    got = python_rows(table)
    assert [r["d"] for r in got] == ["infinity", "-infinity", "-0043-03-15", "5874897-12-31", "2020-01-02", None]
    assert [r["ts"] for r in got][:3] == ["infinity", "-infinity", "-0043-03-15 12:00:00.000000Z"]
    assert got[1]["l"] == ["-infinity", None] and got[2]["s"] == {"a": "-0043-03-15"} and got[5]["s"] is None
    assert all(r["ok"] == dt.date(2020, 1, 2) for r in got) and got[0]["id"] == 0
    assert python_rows(table.slice(4)) == table.slice(4).to_pylist()      # nothing out of range: as before
    assert python_rows(table.slice(2, 1))[0]["d"] == "-0043-03-15"
