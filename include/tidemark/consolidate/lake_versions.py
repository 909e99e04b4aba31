"""Reading one Delta version of a lake table, bucket by bucket, and finding its snapshot loads: what a
snapshot base of the changelog feed (`bases`) and a subscriber's catch-up read.
"""

from __future__ import annotations

from tidemark.lake import data_files, exact_schema, filesystem, open_delta, table_info
from tidemark.lake.delta import conform, renames_since, tidemark_commits

UNREAD = object()     # an argument its caller has not read (None is a value: "no table yet")


def version_buckets(uri: str, options, version: int, schema):
    """(a reader, {bucket: the version's data files}) of one Delta version of a lake table: the reader
    gives a list of its files' rows in ``schema`` (missing columns null; columns renamed since under
    their names now). Every file of a lake table lies in its bucket's ``_bucket=N`` directory."""
    import re

    import pyarrow as pa
    import pyarrow.dataset as ds
    from deltalake import DeltaTable, Schema

    dt = DeltaTable(uri, version=version, storage_options=options)
    own = exact_schema(dt)
    # a load that changed a column's type records the table's new shape (its description) in a commit
    # right after its files: where the version's own Delta type differs, that type is the files'
    delta = {f.name: f.type for f in dt.schema().fields}
    logical = pa.schema(dt.schema().to_arrow())
    own = pa.schema([f if f.name not in delta or Schema.from_arrow(pa.schema([f])).fields[0].type == delta[f.name]
                     else pa.field(f.name, logical.field(f.name).type) for f in own])
    renames = renames_since(table_info(dt), table_info(open_delta(uri, options)))   # RENAME COLUMN since
    fs = filesystem(uri, options)

    def read(files: list[str]):
        rows = (ds.dataset(files, format="parquet", schema=own, filesystem=fs).to_table(columns=own.names)
                if files else own.empty_table())
        if renames:
            rows = rows.rename_columns([renames.get(n, n) for n in rows.column_names])
        return conform(rows, schema)

    buckets: dict[int, list[str]] = {}
    for f in data_files(dt, uri):
        m = re.search(r"(?:^|/)_bucket=(-?\d+)/", f)
        buckets.setdefault(int(m.group(1)) if m else -1, []).append(f)
    return read, buckets


def snapshot_versions(dt, stream: str) -> list[tuple[int, int]]:
    """(Delta version, snapshot LSN) of every snapshot load in a lake table's history, oldest first."""
    return [(v, int(m["frontier"])) for v, m in tidemark_commits(dt, stream) if m.get("operation") == "snapshot"]
