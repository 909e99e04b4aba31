"""Arrays as lists (`pgtypes.lake_array` of an array column's text): PostgreSQL's array text, written
here the way its ``array_out`` writes it, parses back to the lists it was made of, at any depth; the
Arrow path (values without quoted elements) equals the Python parser value for value; a value of other
dimensions or with non-default bounds is reported with ``fallback = "text"``, not stored. The
end-to-end oracle against PostgreSQL itself is tests/e2e/test_arrays.py."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from tidemark.pgtypes import Column, LakeValueError, arrow_type, lake_array
from tidemark.pgtypes.text import ArrayMisfit, parse_array_text


def _quote(v: str | None) -> str:
    """One element as array_out writes it: NULL bare, quoted when empty, the word NULL, or holding a
    quote, backslash, brace, comma or blank; quotes and backslashes escaped."""
    if v is None:
        return "NULL"
    if v == "" or v.upper() == "NULL" or any(c in v for c in '"\\{},') or any(c.isspace() for c in v):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return v


def array_out(v) -> str:
    if isinstance(v, list):
        return "{" + ",".join(array_out(x) for x in v) + "}"
    return _quote(v)


texts = st.one_of(st.none(), st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                                     max_size=8), st.sampled_from(['"', "\\", "NULL", "null", "", " ", "a,b", "{x}"]))


@st.composite
def rectangular(draw, depth: int):
    """A non-empty rectangular nested list ``depth`` deep (PostgreSQL's arrays are rectangular)."""
    shape = [draw(st.integers(1, 3)) for _ in range(depth)]

    def build(level):
        if level == depth:
            return draw(texts)
        return [build(level + 1) for _ in range(shape[level])]
    return build(0)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3).flatmap(lambda d: st.tuples(st.just(d), rectangular(d))))
def test_array_text_parses_back_to_its_lists(case):
    depth, value = case
    assert parse_array_text(array_out(value), depth, lambda s: s) == value
    with pytest.raises(ArrayMisfit):
        parse_array_text(array_out(value), depth + 1, lambda s: s)
    assert parse_array_text("{}", depth, int) == []


def test_bounds_and_dimensions_that_do_not_fit_are_misfits_with_a_text_fallback():
    col = Column("a", "array", "integer[]", 1007, elem_kind="int32", dims=1)
    errs: list = []
    got = lake_array(col, pa.array(["{1,NULL}", "[0:1]={1,2}", "{{1,2},{3,4}}", None, "{}"]), unstorable=errs)
    assert got.to_pylist() == [[1, None], None, None, None, []]
    assert [(e.row, e.fallback) for e in errs] == [(1, "text"), (2, "text")]
    assert "lower bounds" in errs[0].why and "2 dimension(s), the column 1" in errs[1].why
    with pytest.raises(LakeValueError):
        lake_array(col, ["{{1}}"])
    grid = Column("g", "array", "integer[]", 1007, elem_kind="int32", dims=2)
    assert str(arrow_type(grid)) == "list<item: list<item: int32>>"
    assert lake_array(grid, ["{{1,NULL},{3,4}}", "{}"]).to_pylist() == [[[1, None], [3, 4]], []]
    assert lake_array(grid, ["{1,2}"], unstorable=(errs := [])).to_pylist() == [None] and errs[0].fallback == "text"
    # an element its lake type cannot hold: NaN in numeric(10,2)[] (lake decimal(10,2))
    dec = Column("n", "array", "numeric[]", 1231, elem_kind="numeric", dims=1, typmod=((10 << 16) | 2) + 4)
    assert lake_array(dec, ["{1.50,NaN}", "{2.25}"], unstorable=(errs := [])).to_pylist()[0] is None
    assert [e.row for e in errs] == [0] and errs[0].fallback == "text"


ints = st.one_of(st.none(), st.integers(-2**31, 2**31 - 1))
words = st.one_of(st.none(), st.sampled_from(["a", "b c", 'q"', "", "NULL", "x,y", "é", "\\"]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.lists(ints, max_size=5), st.sampled_from(["{{1,2}}", "[2:2]={5}"])),
                max_size=20),
       st.lists(st.one_of(st.none(), st.lists(words, max_size=4)), max_size=20))
def test_the_arrow_path_equals_the_python_parser(int_rows, word_rows):
    """Values read as an Arrow string array (the segment decoders', the snapshot's) go through Arrow
    compute where no element is quoted; Python lists of the same texts through the parser alone."""
    for col, rows in ((Column("a", "array", "integer[]", 1007, elem_kind="int32", dims=1), int_rows),
                      (Column("t", "array", "text[]", 1009, elem_kind="text", dims=1), word_rows)):
        texts_ = [r if r is None or isinstance(r, str) else array_out([None if x is None else str(x) for x in r])
                  for r in rows]
        fast_errs, slow_errs = [], []
        fast = lake_array(col, pa.array(texts_, pa.string()), unstorable=fast_errs)
        slow = pa.array([None if t is None else parse_or_none(col, t) for t in texts_], arrow_type(col))
        assert fast.to_pylist() == slow.to_pylist()
        lake_array(col, list(texts_), unstorable=slow_errs)
        assert [e.row for e in fast_errs] == [e.row for e in slow_errs] == [
            i for i, t in enumerate(texts_) if t is not None and (t.startswith("[") or t.startswith("{{"))]


def parse_or_none(col, text):
    try:
        return parse_array_text(text, col.dims, int if col.elem_kind == "int32" else str)
    except ArrayMisfit:
        return None
