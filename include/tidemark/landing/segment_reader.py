"""Reading segments: their bytes decoded column by column (`read_segment_columns`, in pieces:
`read_segment_pieces`) or into `Update` and `Event` objects (`read_segment`), checking the invariants a
consumer relies on (the format: `tidemark.landing.segment_format`; names re-exported by `segments`)."""

from __future__ import annotations

import io
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import fastavro

from tidemark.errors import SegmentError
from tidemark.landing.segment_format import (Event, SegmentContent, SegmentHeader, Update, _relations,
                                             event_from_record)
from tidemark.landing.store import read_uri
from tidemark.pgtypes import avro_field_names, avro_type, TableSchema


@dataclass
class SegmentColumns(SegmentHeader):
    """What a segment says, decoded column by column (`read_segment_columns`): per table shape
    (Avro record name), its updates' fields as arrays in file order, and the row values per column."""

    # record name -> {"time", "diff", "xid", "position", "commit_ts", "order"}: int64 numpy arrays ("order":
    # each update's index among the segment's updates); "image": a numpy array of "full" / "key";
    # "unchanged_toast": an Arrow list<string> array; "row": {column name: an Arrow array of the Avro
    # primitive's type (`columnar.AVRO_ARROW`), or for an array column a list of lists, strings and None}
    shapes: dict[str, dict[str, Any]]
    events: list[Event]
    n_updates: int = 0
    last: bool = True       # `read_segment_pieces`: the last piece (events, progress)


UPDATE_FIELDS = ("time", "diff", "xid", "position", "commit_ts", "image", "unchanged_toast")


def read_segment_columns(data: bytes, name: str = "<segment>") -> SegmentColumns:
    """Decode a segment's bytes into columns, checking the invariants a consumer relies on: column by
    column (`tidemark.landing.columnar`) when its updates are framed one per array block, as Tidemark
    writes them, else by fastavro, with the same result. Raises `SegmentError` naming the segment, the
    record number and the reason."""
    whole, = read_segment_pieces(data, name, 1 << 62)
    return whole


def _decode_fastavro(data: bytes, name: str):
    try:
        reader = fastavro.reader(io.BytesIO(data), return_record_name=True)
    except Exception as exc:  # fastavro raises ValueError/EOFError/SchemaParseException variants
        raise SegmentError(name, f"not an Avro object container file: {exc}") from exc
    meta = reader.metadata
    relations = _relations(meta, name)
    groups: dict[str, list] = {}        # full Avro record name -> (update number, fastavro dict), in file order
    first: dict[str, int] = {}          # full record name -> the record number of its first update
    events: list[Event] = []
    progress = None
    idx = -1
    n = 0
    try:
        for datum in reader:
            idx += 1
            if progress is not None:
                raise SegmentError(name, "a record follows the progress record", record=idx)
            if isinstance(datum, list):
                for u in datum:
                    first.setdefault(u["data"][0], idx)
                    groups.setdefault(u["data"][0], []).append((n, u))
                    n += 1
            else:
                rname, rec = datum
                if rname == "com.materialize.cdc.progress":
                    progress = rec
                elif rname == "com.tidemark.event":
                    events.append(event_from_record(rec))
                else:
                    raise SegmentError(name, f"unexpected record type {rname}", record=idx)
    except SegmentError:
        raise
    except Exception as exc:
        raise SegmentError(name, f"cannot decode: {exc}", record=idx + 1) from exc
    shapes: dict[str, dict[str, Any]] = {}
    for full, pairs in groups.items():     # in the order of their first updates
        rname = full.rsplit(".", 1)[-1]
        table = relations.get(rname)
        if table is None:
            raise SegmentError(name, f"update for unknown table shape {rname}", record=first[full])
        ups = [u for _, u in pairs]
        cols: dict[str, Any] = {f: [u[f] for u in ups] for f in UPDATE_FIELDS}
        cols["order"] = [o for o, _ in pairs]
        rows = [u["data"][1] for u in ups]
        try:
            cols["row"] = {col: [r[f] for r in rows] for f, col in zip(avro_field_names(table.columns),
                                                                      (c.name for c in table.columns))}
        except KeyError as exc:
            raise SegmentError(name, f"cannot decode: shape {rname} lacks field {exc}", record=first[full]) from exc
        if rname in shapes:         # one shape written under two full names: keep them together
            for f in (*UPDATE_FIELDS, "order"):
                shapes[rname][f] += cols[f]
            for c, v in cols["row"].items():
                shapes[rname]["row"][c] += v
        else:
            shapes[rname] = cols
    return meta, relations, {r: _as_columns(cols, relations[r]) for r, cols in shapes.items()}, events, progress, n


def _as_columns(cols: dict, table: TableSchema) -> dict:
    """fastavro's lists in the form `columnar` decodes into (`SegmentColumns.shapes`)."""
    import numpy as np
    import pyarrow as pa

    from tidemark.landing.columnar import AVRO_ARROW  # deferred: columnar loads numpy, which the drain does not

    out = {f: np.array(cols[f], np.int64) for f in ("time", "diff", "xid", "position", "commit_ts")}
    out["image"] = np.array(cols["image"], "<U4")
    out["unchanged_toast"] = pa.array(cols["unchanged_toast"], pa.list_(pa.string()))
    out["order"] = np.array(cols["order"], np.int64)
    row = {}
    for col in table.columns:
        atype = avro_type(col)
        values = cols["row"][col.name]
        row[col.name] = pa.array(values, AVRO_ARROW[atype[1]]) if isinstance(atype[1], str) else values
    out["row"] = row
    return out


def _checked(name: str, meta: dict, relations: dict, shapes: dict, events: list, progress, n: int, last: bool = True,
             seen: Counter | None = None, first_at: dict[int, int] | None = None) -> SegmentColumns:
    """The `SegmentColumns` of a decoded segment, or of a piece of one (``last``; ``seen``
    and ``first_at`` carry the records per time and each time's first update number over the pieces).
    A last piece is checked: `SegmentError` for no progress record, a record outside ``[lower,
    upper)`` or more records at a time than the progress counts say; the others have ``lower``,
    ``upper`` and ``counts`` -1, -1 and ``{}``."""
    import numpy as np

    seen = Counter() if seen is None else seen
    first_at = {} if first_at is None else first_at
    for cols in shapes.values():
        at, idx, many = np.unique(cols["time"], return_index=True, return_counts=True)
        seen.update(dict(zip(at.tolist(), many.tolist())))
        for t, o in zip(at.tolist(), cols["order"][idx].tolist()):
            if o < first_at.get(t, o + 1):
                first_at[t] = o
    lower, upper, counts = -1, -1, {}
    if last:
        if progress is None:
            raise SegmentError(name, "no progress record (truncated file?)")
        if len(progress["lower"]) != 1 or len(progress["upper"]) != 1:
            raise SegmentError(name, "progress lower/upper must have exactly one element")
        lower, upper = progress["lower"][0], progress["upper"][0]
        counts = {c["time"]: c["count"] for c in progress["counts"]}
        outside = [(o, t) for t, o in first_at.items() if not (lower <= t < upper)]    # the first such update
        if outside:
            raise SegmentError(name, f"record at time {min(outside)[1]} outside [{lower}, {upper})")
        total = Counter(seen)
        for e in events:
            if not (lower <= e.time < upper):
                raise SegmentError(name, f"record at time {e.time} outside [{lower}, {upper})")
            total[e.time] += 1
        for t, c in total.items():
            if counts.get(t, 0) < c:
                raise SegmentError(name, f"{c} records at time {t} but progress counts say {counts.get(t, 0)}")
    return SegmentColumns(stream=meta.get("tidemark.stream", ""), seq=int(meta.get("tidemark.seq", "-1")),
                          lower=lower, upper=upper, counts=counts, relations=relations, shapes=shapes,
                          events=events, n_updates=n, last=last)


PIECE_RECORDS = 65_536     # updates per piece of `read_segment_pieces` unless told


def read_segment_pieces(data: bytes, name: str = "<segment>", max_records: int = PIECE_RECORDS
                        ) -> Iterator[SegmentColumns]:
    """`read_segment_columns` piece by piece, so that one huge segment (one huge transaction) is never decoded
    at once: `SegmentColumns` of runs of container blocks holding at least ``max_records`` updates each
    (`columnar.decode_columnar_pieces`: at most ``max_records`` plus one block's), each shape's ``order``
    counting from the segment's first update. Only the last piece (``last``) carries the events and the
    progress record's ``lower``, ``upper`` and ``counts`` (-1, -1 and ``{}`` before). The checks of
    `read_segment_columns` are made when the last piece is decoded, so a segment that fails them raises
    `SegmentError` after its earlier pieces were given (a consumer must not take them as the whole). A
    segment the columnar decoder cannot read is decoded whole by fastavro, as `read_segment_columns` does
    (after pieces already given: only its updates from the first one not given yet)."""
    from tidemark.landing.columnar import decode_columnar_pieces  # deferred: columnar loads numpy (the drain does not)

    done = 0
    seen: Counter = Counter()
    first_at: dict[int, int] = {}
    if os.environ.get("TIDEMARK_SEGMENT_DECODER") != "fastavro":
        pieces = decode_columnar_pieces(data, name, max_records)
        try:
            for meta, relations, shapes, events, progress, n, first in pieces:
                last = progress is not None
                yield _checked(name, meta, relations, shapes, events, progress, n, last, seen, first_at)
                if last:
                    return
                done = first + n
        except SegmentError:
            raise
        except Exception:  # noqa: BLE001 - as `columnar.decode_columnar`: fastavro decodes it or says why
            pass
    try:
        whole = _checked(name, *_decode_fastavro(data, name))
    except (KeyError, TypeError) as exc:     # a writer schema whose records lack the format's fields
        raise SegmentError(name, f"cannot decode: a record lacks the field {exc} (not the segment schema)") from exc
    if done:
        whole.shapes = {r: _from_order(cols, done) for r, cols in whole.shapes.items()}
        whole.shapes = {r: cols for r, cols in whole.shapes.items() if len(cols["time"])}
    yield whole


def _from_order(cols: dict, done: int) -> dict:
    """A shape's columns (`SegmentColumns.shapes`) without its updates before update number ``done``."""
    import numpy as np
    import pyarrow as pa

    keep = np.nonzero(cols["order"] >= done)[0]
    out = {}
    for k, v in cols.items():
        if k == "row":
            out[k] = {c: (a.take(pa.array(keep)) if isinstance(a, (pa.Array, pa.ChunkedArray))
                          else [a[i] for i in keep.tolist()]) for c, a in v.items()}
        elif isinstance(v, (pa.Array, pa.ChunkedArray)):
            out[k] = v.take(pa.array(keep))
        else:
            out[k] = v[keep]
    return out


def read_segment(data: bytes, name: str = "<segment>") -> SegmentContent:
    """Decode a segment's bytes into `Update` and `Event` objects (updates in file order), checking
    the invariants a consumer relies on (`read_segment_columns`).

    Raises `SegmentError` naming the segment, the record number and the reason.
    """
    content = read_segment_columns(data, name)
    updates: list[Any] = [None] * content.n_updates
    for rname, cols in content.shapes.items():
        table = content.relations[rname]
        names = list(cols["row"])
        values = list(zip(*(_pylist(v) for v in cols["row"].values()))) if names else [()] * len(cols["time"])
        f = {k: _pylist(cols[k]) for k in (*UPDATE_FIELDS, "order")}
        for i, o in enumerate(f["order"]):
            updates[o] = Update(table=table, row=dict(zip(names, values[i])), time=f["time"][i],
                                diff=f["diff"][i], xid=f["xid"][i], position=f["position"][i],
                                commit_ts=f["commit_ts"][i], image=f["image"][i],
                                unchanged_toast=tuple(f["unchanged_toast"][i]))
    return SegmentContent(stream=content.stream, seq=content.seq, lower=content.lower, upper=content.upper,
                          counts=content.counts, relations=content.relations, updates=updates,
                          events=content.events)


def read_segment_at(uri: str, endpoint_url: str | None = None) -> SegmentContent:
    """`read_segment` of the object at ``uri`` (``file://`` or ``s3://``, `read_uri`), named by its URI."""
    return read_segment(read_uri(uri, endpoint_url=endpoint_url), uri)


def _pylist(values) -> list:
    """A column of `SegmentColumns` (numpy, Arrow or a list) as a list of Python values."""
    if hasattr(values, "to_pylist"):         # Arrow
        return values.to_pylist()
    return values.tolist() if hasattr(values, "tolist") else list(values)
