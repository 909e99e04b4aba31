"""DataFrame expressions the Spark side of a batch needs (no I/O): a time range of changes, and a
row's bucket, ``_bucket = pmod(xxhash64(columns), buckets)`` (`sparkhash` computes the same in Arrow)."""

from __future__ import annotations

from tidemark.consolidate.decode import META_TIME


def col(name: str):
    """A column by exact name (any characters)."""
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def plain_names(df):
    """``(df', names)``: ``df`` with each column whose name has a dot, a backtick or a star renamed
    to ``_tm_c<i>``, and its real column names. PySpark's ``mapInArrow`` and ``applyInArrow`` pass
    the columns as ``df[name]``, which reads ``a.b`` as field ``b`` of a struct ``a`` (failing on a
    column named ``a.b``) and ``*`` as every column; the Arrow side gets the real names back with
    `named`."""
    names = list(df.columns)
    safe = [f"_tm_c{i}" if any(ch in n for ch in ".`*") else n for i, n in enumerate(names)]
    return (df if safe == names else df.toDF(*safe)), names


def named(batches, names: list[str]):
    """The Arrow record batches (or tables) of a `plain_names` frame with their real column names."""
    for b in batches:
        yield b if b.schema.names == names else b.rename_columns(names)


def in_range(df, lower: int, upper: int):
    """Changes with ``lower <= time < upper``."""
    from pyspark.sql import functions as F

    return df.filter((F.col(META_TIME) >= lower) & (F.col(META_TIME) < upper))


def bucket_expr(columns: list[str], buckets: int):
    """The bucket of a row: ``pmod(xxhash64(columns), buckets)`` as int."""
    from pyspark.sql import functions as F

    return F.pmod(F.xxhash64(*[col(c) for c in columns]), F.lit(buckets)).cast("int")


def with_bucket(df, columns: list[str], buckets: int):
    return df.withColumn("_bucket", bucket_expr(columns, buckets))
