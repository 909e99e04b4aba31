"""Pure DataFrame transforms of one table's changes (no I/O): the net effect of a batch.

Input: the table's changes with the data columns (lake types) and the ``_tm_*`` meta columns of
`tidemark.consolidate.decode`. Order is ``(_tm_time, _tm_pos)``; an update is a ``-1`` of the old
row (or only its key, ``_tm_full`` false) at position ``p`` followed by a ``+1`` of the new row at
``p + 1``.

* `dedupe` drops surplus copies of one record identity.
* `net_keyed`: the last change per primary key; unchanged-TOAST columns come from the newest image
  of the same row earlier in the batch — following it across a key change — or else are left for
  the lake row (``_tm_need``).
* `net_multiset`: tables without a key: diffs add up per identical row.
* `with_bucket`: ``_bucket = pmod(xxhash64(columns), buckets)``.
"""

from __future__ import annotations

from tidemark.consolidate.decode import (META_CTS, META_DIFF, META_FULL, META_POS, META_TIME,
                                         META_UNKNOWN)

NEED, DELETE, NET, INC, MOVED_FROM = "_tm_need", "_tm_del", "_tm_n", "_tm_inc", "_tm_moved"


def col(name: str):
    """A column by exact name (any characters)."""
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def dedupe(df):
    """One row per ``(time, position)``: identical duplicates are dropped."""
    return df.dropDuplicates([META_TIME, META_POS])


def in_range(df, lower: int, upper: int, after: tuple[int, int] | None = None):
    """Changes with ``lower <= time < upper`` (and after the ``(time, position)`` of a truncate)."""
    from pyspark.sql import functions as F

    out = df.filter((F.col(META_TIME) >= lower) & (F.col(META_TIME) < upper))
    if after is not None:
        t, p = after
        out = out.filter((F.col(META_TIME) > t) | ((F.col(META_TIME) == t) & (F.col(META_POS) > p)))
    return out


def _known(name: str):
    from pyspark.sql import functions as F

    return F.col(META_FULL) & ~F.array_contains(F.col(META_UNKNOWN), F.lit(name))


def with_pairing(df, keys: list[str]):
    """Add ``_tm_moved``: for a ``+1`` that follows a ``-1`` of another key in its transaction
    (an update that changed the key), the old key as a struct; else null. Also ``_tm_paired``."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy(META_TIME).orderBy(META_POS)
    prev_key = F.lag(F.struct(*[col(k).alias(k) for k in keys]), 1).over(w)
    prev_ok = ((F.lag(F.col(META_DIFF), 1).over(w) == -1) & (F.lag(F.col(META_POS), 1).over(w) == F.col(META_POS) - 1)
               & (F.col(META_DIFF) == 1))
    own = F.struct(*[col(k).alias(k) for k in keys])
    return (df.withColumn("_tm_prev", F.when(prev_ok, prev_key))
              .withColumn("_tm_paired", F.col("_tm_prev").isNotNull() & (F.col("_tm_prev") == own))
              .withColumn(MOVED_FROM, F.when(F.col("_tm_prev").isNotNull() & (F.col("_tm_prev") != own),
                                             F.col("_tm_prev")))
              .drop("_tm_prev"))


def _with_last_known(df, keys: list[str], values: list[str]):
    """Per key and incarnation, the newest known value of every non-key column up to each row
    (``_tm_lk_<i>`` structs, null when unknown); ``_tm_inc`` numbers incarnations: an insert or a
    key change into the key starts a new one, so values never leak from a deleted row."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    kcols = [col(k) for k in keys]
    w_order = Window.partitionBy(*kcols).orderBy(META_TIME, META_POS)
    w_key = w_order.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    after_delete = (F.lag(F.col(META_DIFF), 1).over(w_order) == -1) & ~F.col("_tm_paired")
    starts = (F.col(META_DIFF) == 1) & (F.col(MOVED_FROM).isNotNull() | F.coalesce(after_delete, F.lit(False)))
    df = df.withColumn(INC, F.sum(F.when(starts, 1).otherwise(0)).over(w_key))
    w_inc = Window.partitionBy(*kcols, F.col(INC)).orderBy(META_TIME, META_POS).rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    for i, v in enumerate(values):
        df = df.withColumn(f"_tm_lk_{i}", F.last(F.when(_known(v), F.struct(col(v).alias("v"))),
                                                 ignorenulls=True).over(w_inc))
    return df


def moved_needing_values(df, keys: list[str], values: list[str]):
    """Rows ``+1`` that moved from another key and lack some values: with the old row's newest known
    values in the batch (``_tm_lk_<i>`` of the paired ``-1``) and its incarnation there."""
    from pyspark.sql import functions as F

    lk = _with_last_known(with_pairing(df, keys), keys, values)
    moved = lk.filter(F.col(MOVED_FROM).isNotNull() & (F.size(F.col(META_UNKNOWN)) > 0))
    prev = lk.select(F.col(META_TIME).alias("_p_time"), (F.col(META_POS) + 1).alias("_p_pos"),
                     F.col(INC).alias("_p_inc"), *[F.col(f"_tm_lk_{i}").alias(f"_p_lk_{i}") for i in range(len(values))])
    return moved.join(prev, (moved[META_TIME] == prev["_p_time"]) & (moved[META_POS] == prev["_p_pos"]), how="left")


def fill_moved(df, keys: list[str], values: list[str], resolved):
    """Replace unknown values of moved rows with ``resolved`` (``_tm_time``, ``_tm_pos`` and the
    value columns, plus ``_tm_ok`` per column as ``_tm_ok_<i>``). Every column keeps its type in
    ``df`` (the lake type): ``resolved`` may carry another Spark type for the same values (a
    ``timestamp`` read back from Arrow as a local-time timestamp), and a chain of key changes is
    resolved over several rounds, each feeding the next."""
    from pyspark.sql import functions as F

    types = {f.name: f.dataType for f in df.schema.fields}
    r = resolved.select(F.col(META_TIME).alias("_r_time"), F.col(META_POS).alias("_r_pos"),
                        *[col(v).cast(types[v]).alias(f"_r_v_{i}") for i, v in enumerate(values)],
                        *[F.col(f"_tm_ok_{i}").alias(f"_r_ok_{i}") for i in range(len(values))])
    j = df.join(r, (df[META_TIME] == r["_r_time"]) & (df[META_POS] == r["_r_pos"]), how="left")
    unknown = F.col(META_UNKNOWN)
    for i, v in enumerate(values):
        fill = F.col(f"_r_ok_{i}") & F.array_contains(unknown, F.lit(v))
        j = j.withColumn(v, F.when(fill, F.col(f"_r_v_{i}")).otherwise(col(v)))
        unknown = F.when(fill, F.array_remove(unknown, F.lit(v))).otherwise(unknown)
        j = j.withColumn(META_UNKNOWN, unknown)
        unknown = F.col(META_UNKNOWN)
    return j.drop("_r_time", "_r_pos", *[f"_r_v_{i}" for i in range(len(values))],
                  *[f"_r_ok_{i}" for i in range(len(values))])


def net_keyed(df, keys: list[str], values: list[str]):
    """The last change per key: data columns, ``_tm_del`` (the key is gone), ``_tm_need`` (columns
    to take from the current lake row), ``_tm_time``/``_tm_cts`` of the last change, ``_tm_moved``
    (the row came from another key in this batch and still lacks values: an error downstream)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    lk = _with_last_known(with_pairing(df, keys), keys, values)
    w_last = Window.partitionBy(*[col(k) for k in keys]).orderBy(F.col(META_TIME).desc(), F.col(META_POS).desc())
    last = lk.withColumn("_tm_rn", F.row_number().over(w_last)).filter(F.col("_tm_rn") == 1)
    need = F.filter(F.array(*[F.when(F.col(f"_tm_lk_{i}").isNull(), F.lit(v)) for i, v in enumerate(values)]),
                    lambda x: x.isNotNull()) if values else F.array().cast("array<string>")
    is_del = F.col(META_DIFF) < 0
    out = last.select(
        *[col(k) for k in keys],
        *[F.when(is_del, F.lit(None)).otherwise(F.col(f"_tm_lk_{i}.v")).alias(v) for i, v in enumerate(values)],
        is_del.alias(DELETE),
        F.when(is_del, F.array().cast("array<string>")).otherwise(need).alias(NEED),
        (~is_del & (F.col(INC) > 0) & (F.size(need) > 0)).alias(MOVED_FROM),
        F.col(META_TIME), F.col(META_CTS))
    return out


def fill_from_pair(df, columns: list[str]):
    """Tables without a key: an unknown (unchanged TOAST) value of a ``+1`` comes from the ``-1`` just
    before it in the transaction (the old image of the same update). ``_tm_unfilled`` flags rows
    that still lack a value."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy(META_TIME).orderBy(META_POS)
    paired = ((F.lag(F.col(META_DIFF), 1).over(w) == -1) & (F.lag(F.col(META_POS), 1).over(w) == F.col(META_POS) - 1)
              & F.lag(F.col(META_FULL), 1).over(w))
    out = df.withColumn("_tm_pairok", paired)
    for c in columns:
        unknown = (F.col(META_DIFF) == 1) & F.array_contains(F.col(META_UNKNOWN), F.lit(c))
        out = out.withColumn(c, F.when(unknown, F.lag(col(c), 1).over(w)).otherwise(col(c)))
    unfilled = ((F.col(META_DIFF) == 1) & (F.size(F.col(META_UNKNOWN)) > 0) & ~F.coalesce(F.col("_tm_pairok"), F.lit(False)))
    return out.withColumn("_tm_unfilled", unfilled).drop("_tm_pairok")


def net_multiset(df, columns: list[str]):
    """Tables without a key: the sum of diffs per identical row (zero sums dropped), with the time
    and commit timestamp of the row's last change."""
    from pyspark.sql import functions as F

    return (df.groupBy(*[col(c) for c in columns])
              .agg(F.sum(META_DIFF).alias(NET), F.max(META_TIME).alias(META_TIME), F.max(META_CTS).alias(META_CTS))
              .filter(F.col(NET) != 0))


def bucket_expr(columns: list[str], buckets: int):
    """The bucket of a row: ``pmod(xxhash64(columns), buckets)`` as int."""
    from pyspark.sql import functions as F

    return F.pmod(F.xxhash64(*[col(c) for c in columns]), F.lit(buckets)).cast("int")


def with_bucket(df, columns: list[str], buckets: int):
    return df.withColumn("_bucket", bucket_expr(columns, buckets))
