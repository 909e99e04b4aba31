"""DataFrame expressions the Spark side of a load needs (no I/O): a row's bucket, ``_bucket =
pmod(xxhash64(columns), buckets)`` (`sparkhash` computes the same in Arrow), column names any
character may be in, and UDF schemas parsed once."""

from __future__ import annotations

from tidemark.sparkconf import is_connect


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


def bucket_expr(columns: list[str], buckets: int):
    """The bucket of a row: ``pmod(xxhash64(columns), buckets)`` as int."""
    from pyspark.sql import functions as F

    return F.pmod(F.xxhash64(*[col(c) for c in columns]), F.lit(buckets)).cast("int")


_SCHEMAS: dict[str, object] = {}


def schema(spark, ddl: str):
    """The Spark schema of a DDL string, parsed once per process (PySpark parses a UDF's DDL return
    type through the JVM each time the UDF is made; a `StructType` it takes as it is). Over Spark
    Connect the string itself (the server parses it)."""
    got = _SCHEMAS.get(ddl)
    if got is None:
        if is_connect(spark):
            return ddl
        from pyspark.sql.types import _parse_datatype_string

        got = _SCHEMAS[ddl] = _parse_datatype_string(ddl)
    return got
