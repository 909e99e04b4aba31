"""The readers a user calls: a table's current rows (`read_table`), every table at one stream frontier or
as of a position or time (`read_tables`; `at=` is `lake.history.read_tables_at`), and Spark views of a
table (`register_table`) or of its history table (`register_history`).
"""

from __future__ import annotations

from typing import Any

from tidemark.config import StreamConfig, TableRef
from tidemark.lake.changelog import at_frontier
from tidemark.lake.delta import (LakeError, dir_name, committed_frontier, data_files, exact_schema, frontier_of,
                                 history_uri, lake_schema, open_delta, open_lake_table, read_dt, resolved_name,
                                 storage_options, version_at)
from tidemark.lake.history import read_history, read_tables_at
from tidemark.lake.retention import check_position
from tidemark.lsn import format_lsn


def read_table(cfg: StreamConfig, table: str | TableRef, *, frontier: int | None = None):
    """The lake's current rows of ``table`` as a `pyarrow.Table` with exactly the source columns;
    with ``frontier``, its rows as of that stream frontier (`version_at`)."""
    if frontier is None:
        uri, opts, dt = open_lake_table(cfg, table)
        return read_dt(dt, uri, opts)
    return read_tables(cfg, [table], frontier=frontier)[resolved_name(table)]


def read_tables(cfg: StreamConfig, tables: list[str | TableRef] | None = None, *, frontier: int | None = None,
                at: Any = None) -> dict:
    """Every (or the given) table of the stream, ``{schema.table: pyarrow.Table}``, as the source held
    it right after its commit at position ``at`` (an LSN or a time: `tidemark.lake.history.read_tables_at`),
    or as of the stream ``frontier`` (the control database's: tables a failed run committed past it
    are read at it, so readers never see tables from two frontiers).

    An external feed's table (`tidemark.feeds`) may have committed past ``frontier`` in a version
    that also holds earlier times: it is then its last version at or below ``frontier`` (empty: none)
    plus its changelog's changes from there to ``frontier`` (`at_frontier`)."""
    if at is not None:
        return read_tables_at(cfg, at, tables, frontier=frontier)
    if frontier is None:
        raise LakeError("read_tables needs frontier= (the stream's) or at= (a position or time)")
    names = [resolved_name(t) for t in (tables if tables is not None else cfg.source.tables)]
    out = {}
    for name in names:
        uri, opts, dt = open_lake_table(cfg, name)
        version = version_at(dt, cfg.stream, frontier)
        if version is None and cfg.source.is_feed:      # a feed's table starts empty at time 0
            out[name] = at_frontier(cfg, name, exact_schema(dt).empty_table(), 0, frontier)
            continue
        if version is None:
            raise LakeError(f"{name}: the lake has no version of it at or below frontier {format_lsn(frontier)} "
                            f"(its first commit came later)")
        below = frontier_of(dt, stream=cfg.stream, version=version) if cfg.source.is_feed else None
        beyond = committed_frontier(dt, cfg.stream)
        if version != dt.version():
            # an older version: below the retention window its files may be vacuumed (`lake.retention`)
            check_position(cfg, frontier, f"{name} as of frontier {format_lsn(frontier)}")
            dt.load_as_version(version)
        rows = read_dt(dt, uri, opts)
        if below is not None and below < frontier and beyond is not None and beyond > frontier:
            rows = at_frontier(cfg, name, rows, below, frontier)
        out[name] = rows
    return out


def register_table(spark, cfg: StreamConfig, table: str | TableRef, name: str | None = None, *,
                   as_of: Any = None):
    """Register ``table``'s current lake state as a temporary view in ``spark``; return the DataFrame.
    With ``as_of`` (an LSN or a time), the table as the source held it then (`read_tables` with
    ``at``: read and folded here, then handed to Spark — its size passes through this process).

    A local lake is read by Spark's own Parquet reader from the files of the current Delta version
    (Delta's Spark jars are not needed); an S3 lake is read through deltalake on the driver."""
    view = name or dir_name(resolved_name(table)).replace(".", "_").replace("-", "_")
    if as_of is not None:
        rows = read_tables(cfg, [table], at=as_of)[resolved_name(table)]
        return spark_view(spark, view, rows.schema, rows=rows)
    uri, opts, dt = open_lake_table(cfg, table)
    files = data_files(dt, uri)
    rows = read_dt(dt, uri, opts) if files and uri.startswith("s3://") else None
    return spark_view(spark, view, exact_schema(dt), rows=rows, files=files)


def register_history(spark, cfg: StreamConfig, table: str | TableRef, name: str | None = None):
    """Register ``table``'s history table (`read_history`) as a temporary view in ``spark`` (default
    name: the table's, with ``_history``); return the DataFrame. A local lake is read by Spark's own
    Parquet reader from the current Delta version's files (Delta's Spark jars are not needed; the
    ``_bucket`` partition is not a column); an S3 lake through `read_history` on the driver."""
    qualified = resolved_name(table)
    view = name or (dir_name(qualified).replace(".", "_").replace("-", "_") + "_history")
    uri = history_uri(cfg, qualified)
    if uri.startswith("s3://"):
        rows = read_history(cfg, qualified)
        return spark_view(spark, view, rows.schema, rows=rows)
    read_history(cfg, qualified, current=True)     # the same checks and errors as a read
    dt = open_delta(uri, storage_options(cfg))
    return spark_view(spark, view, lake_schema(dt), files=data_files(dt, uri))


def spark_view(spark, view: str, schema, *, rows=None, files=()):
    """Register ``rows`` (an Arrow table) or else the Parquet ``files`` (none: no rows), in ``schema``,
    as the temporary view ``view`` in ``spark``; return the DataFrame."""
    from pyspark.sql.pandas.types import from_arrow_schema

    spark_schema = from_arrow_schema(schema, prefer_timestamp_ntz=True)
    if rows is not None:
        # the Arrow table itself, not pandas: a date of 'infinity' (2**31 - 1 days), a BC date or a
        # timestamp beyond pandas' range has no Python or pandas value
        df = spark.createDataFrame(rows, spark_schema)
    elif files:
        df = spark.read.schema(spark_schema).parquet(*files)
    else:
        df = spark.createDataFrame([], spark_schema)
    df.createOrReplaceTempView(view)
    return df
