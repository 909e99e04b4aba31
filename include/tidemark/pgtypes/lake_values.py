"""A column's canonical values as a lake (Arrow) array (`lake_array`), or the `LakeValueError` naming
the value its lake type cannot hold. An array column's texts are parsed (`tidemark.pgtypes.text`) into
lists ``dims`` deep; a value the lists cannot hold falls back to text (``fallback = "text"``).
"""

from __future__ import annotations

from typing import Any

from tidemark.pgtypes.mapping import INT64_MAX, INT64_MIN, Column, _value_text, arrow_type
from tidemark.pgtypes.text import ArrayMisfit, array_parser


def format_time_us(us: int) -> str:
    """The lake text of a ``time`` value: ``HH:MM:SS.ffffff`` (always six fractional digits)."""
    secs, frac = divmod(us, 1_000_000)
    return f"{secs // 3600:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}.{frac:06d}"


class LakeValueError(ValueError):
    """A canonical value its column's lake type cannot hold: names the column, the value, its row
    (index into the values given to `lake_array`) and the lake type."""

    def __init__(self, col: "Column", row: int, value: Any, lake_type: str, why: str, fallback: str | None = None):
        self.column, self.row, self.value, self.lake_type = col.name, row, value, lake_type
        self.type_name = col.declared_type
        self.why = why
        self.fallback = fallback     # "text": the column is held as PostgreSQL's text instead (arrays)
        super().__init__(f"column {col.name}: {why}")


def _report(err: LakeValueError, unstorable: list | None) -> None:
    """Raise ``err``, or append it to ``unstorable`` when given (`lake_array`)."""
    if unstorable is None:
        raise err
    unstorable.append(err)


def _same_family(a, b) -> bool:
    """Whether a cast of Arrow type ``a`` to ``b`` only changes the width (never parses or formats)."""
    import pyarrow as pa

    return any(t(a) and t(b) for t in (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean,
                                       lambda x: pa.types.is_string(x) or pa.types.is_large_string(x),
                                       lambda x: pa.types.is_binary(x) or pa.types.is_large_binary(x)))


def lake_array(col: Column, values, unstorable: list | None = None):
    """The lake (Arrow, `arrow_type`) array of a column's canonical values (a list, or the Arrow
    array the segment decoders give).

    Raises `LakeValueError` for a canonical value the lake type cannot hold (an array value its
    lists cannot hold, NaN/Infinity in a numeric declared with a precision, a timestamp after the
    year 294247); given a list ``unstorable``, appends a `LakeValueError` per such value to it instead and puts
    null in its place."""
    import decimal

    import pyarrow as pa

    atype = arrow_type(col)
    kind = col.kind
    if kind == "array":                  # (its texts parsed in Arrow where they allow: `_fast_lists`)
        return _lake_lists(col, atype, values, unstorable)
    if isinstance(values, pa.Array):     # the decoders' Arrow column (`landing.columnar.AVRO_ARROW`)
        if kind in ("date", "timestamp", "timestamptz"):
            return values.cast(pa.int32() if kind == "date" else pa.int64()).cast(atype)
        if _same_family(values.type, atype):
            return values.cast(atype)
        values = values.to_pylist()
    if kind == "date":
        return pa.array(values, pa.int32()).cast(atype)
    if kind in ("timestamp", "timestamptz"):
        try:
            return pa.array(values, pa.int64()).cast(atype)
        except (OverflowError, pa.ArrowInvalid):     # beyond 64 bits: which value(s)
            values = list(values)
            for i, v in enumerate(values):
                if v is not None and not INT64_MIN <= v <= INT64_MAX:
                    _report(LakeValueError(col, i, v, str(atype),
                                           f"{kind} {v} µs since 1970 is beyond the lake's range (64-bit "
                                           "microseconds since 1970: up to the year 294247)"), unstorable)
                    values[i] = None
        return pa.array(values, pa.int64()).cast(atype)
    if kind == "time":
        return pa.array([None if v is None else format_time_us(v) for v in values], atype)
    if kind == "numeric" and pa.types.is_decimal(atype):
        out = []
        for i, v in enumerate(values):
            if v is not None and v.lstrip("-") in ("NaN", "Infinity"):
                _report(LakeValueError(col, i, v, str(atype),
                                       f"{v} cannot be stored in {col.declared_type} (lake type {atype})"), unstorable)
                v = None
            out.append(None if v is None else decimal.Decimal(v))
        return pa.array(out, atype)
    return pa.array(values, atype)


# element kinds whose canonical values Arrow takes as they are (nested lists built in one C++ call)
_DIRECT_ELEMENTS = {"int16", "int32", "int64", "float32", "float64", "bool", "text", "bytes", "timetz",
                    "interval", "uuid", "json", "jsonb"}


def _lake_lists(col: Column, atype, values, unstorable: list | None):
    """`lake_array` of an array column: each value's text parsed into lists ``dims`` deep of the
    element's lake type (a list value, landed by earlier versions, taken as it is). A value the lists
    cannot hold (`text.ArrayMisfit`, or an element its lake type cannot hold) is a `LakeValueError`
    with ``fallback = "text"``."""
    import pyarrow as pa

    elem = col.element()
    if col.dims and not isinstance(values, pa.Array) and all(v is None or type(v) is str for v in values):
        values = pa.array(values, pa.string())
    if isinstance(values, pa.Array) and col.dims == 1 and elem.kind in _FAST_ELEMENTS and len(values):
        fast = _fast_lists(col, elem, atype, values, unstorable)
        if fast is not None:
            return fast
    if isinstance(values, pa.Array):
        values = values.to_pylist()
    parse = array_parser(col)

    def misfit(i: int, v, why: str) -> None:
        _report(LakeValueError(col, i, v, str(atype), f"array value {_value_text(v)!r} does not fit the lake type "
                               f"{atype}: {why}", fallback="text"), unstorable)

    rows = []
    for i, v in enumerate(values):
        if isinstance(v, str) and not col.dims:    # a shape landed by earlier versions: the text of a misfit
            misfit(i, v, "not one-dimensional with default bounds")
            v = None
        elif isinstance(v, str):
            try:
                v = parse(v)
            except ArrayMisfit as exc:
                misfit(i, v, str(exc))
                v = None
        rows.append(v)
    direct = elem.kind in _DIRECT_ELEMENTS or (elem.kind == "numeric" and not pa.types.is_decimal(arrow_type(elem)))
    if direct:
        return pa.array(rows, atype)
    depth = col.dims or 1
    try:
        return _nested(rows, depth, lambda flat: lake_array(elem, flat), atype)
    except LakeValueError:
        pass
    for i, v in enumerate(rows):      # an element its lake type cannot hold: which rows (rare)
        if v is not None:
            try:
                _nested([v], depth, lambda flat: lake_array(elem, flat), atype)
            except LakeValueError as exc:
                misfit(i, values[i], exc.why)
                rows[i] = None
    return _nested(rows, depth, lambda flat: lake_array(elem, flat), atype)


_FAST_ELEMENTS = {"int16", "int32", "int64", "float32", "float64", "bool", "numeric", "date", "text", "timetz",
                  "interval", "uuid", "json", "jsonb"}


def _fast_lists(col: Column, elem: Column, atype, values, unstorable: list | None):
    """`_lake_lists` of a 1-D array column's texts in Arrow compute (no Python object per element):
    the values without a quoted element (numbers, booleans, dates, plain words: most) are split at
    their commas and cast to the element's lake type at once; the others (quoted elements, other
    dimensions or bounds) take the Python parser. None when the cast fails (an element only the
    Python path converts or reports: ``infinity`` dates, NaN in a decimal): the caller parses all."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_string(values.type):
        values = values.cast(pa.string())
    slow = pc.fill_null(pc.or_(pc.or_(pc.match_substring(values, '"'), pc.starts_with(values, "{{")),
                               pc.invert(pc.starts_with(values, "{"))), False)
    n_slow = pc.sum(slow).as_py() or 0
    if n_slow == len(values):
        return None
    quick = pc.if_else(slow, pa.scalar(None, pa.string()), values) if n_slow else values
    inner = pc.utf8_slice_codeunits(quick, 1, -1)
    parts = pc.split_pattern(inner, ",")
    empty = pc.fill_null(pc.equal(inner, ""), False).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(parts)
    if empty.any():                  # '{}': no element (split gives one empty string)
        flat = flat.filter(pa.array(~empty[pc.list_parent_indices(parts).to_numpy()]))
    lengths = np.where(empty, 0, pc.fill_null(pc.list_value_length(parts), 0).to_numpy(zero_copy_only=False))
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = pc.if_else(pc.equal(flat, "NULL"), pa.scalar(None, pa.string()), flat)
    target = atype.value_type
    try:
        if elem.kind == "bool":
            items = pc.equal(flat, "t")
        elif pa.types.is_string(target):
            items = flat
        else:
            items = flat.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    mask = quick.is_null()
    out = pa.ListArray.from_arrays(pa.array(offsets), items, mask=mask if quick.null_count else None, type=atype)
    if not n_slow:
        return out
    at = np.flatnonzero(slow.to_numpy(zero_copy_only=False))
    errs: list = []
    rest = _lake_lists(col, atype, values.take(pa.array(at)).to_pylist(), errs)
    for err in errs:
        err.row = int(at[err.row])
        _report(err, unstorable)
    where = np.full(len(values), -1, np.int64)
    where[at] = np.arange(len(at))
    scattered = rest.take(pa.array(where, mask=where < 0))
    return pc.if_else(slow, scattered, out)


def _nested(rows: list, depth: int, leaves, atype):
    """A list array ``depth`` deep of ``rows`` (lists of lists ..., None: a null row), its innermost
    values made an Arrow array by ``leaves``."""
    import pyarrow as pa

    offsets, flat, mask = [0], [], []
    for v in rows:
        if v is not None:
            flat.extend(v)
        offsets.append(len(flat))
        mask.append(v is None)
    child = _nested(flat, depth - 1, leaves, atype.value_type) if depth > 1 else leaves(flat)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), child,
                                    mask=pa.array(mask, pa.bool_()) if any(mask) else None, type=atype)
