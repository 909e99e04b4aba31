"""What a merge group works with (`merge`): the plans the driver gives the executors (`TablePlan`,
`LogPlan`), the errors of bad input and the names of the group's result rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tidemark.errors import TidemarkError
from tidemark.lake import layout

META_BUCKET = "_tm_bucket"           # a record's bucket, beside the meta columns (`work_area.META_COLUMNS`)
# a merge group's net effect on its table (`_count_changes`), in its ``changes`` result row's ``stats``
CHANGE_COUNTS = ("inserted", "updated", "deleted")
# the records a keyed table's merge group holds at once (or ``consolidate.max_batch_records``, if fewer;
# `TablePlan.max_records`): a group of more (one huge transaction) is merged key range by key range
MERGE_RECORDS = layout.TARGET_ROWS
OUT_DDL = f"table string, {layout.ACTIONS_DDL}, log binary, problem string, cdc binary"


class MergeError(TidemarkError):
    """A group's records cannot be applied (bad input: names the table, key or row and the time)."""


class RowImageUnknown(MergeError):
    """A keyed table's change left TOAST values unchanged but the row's previous image is neither in
    the batch nor in the lake. PostgreSQL does so when an UPDATE moves a row into a publication's row
    filter without changing its TOASTed columns: it sends an INSERT lacking them. Only a copy of the
    table mends it: the driver turns it into `TableNeedsSnapshot` (`MARK` survives the executor's
    problem text)."""

    MARK = "[needs a re-snapshot] "

    def __init__(self, message: str, *, key: dict, time: int):
        super().__init__(message)
        self.key, self.time = key, time


@dataclass
class LogPlan:
    """Where a merge group writes its changelog rows with ``time >= lo``: Parquet files into the
    changelog Delta table's directory, CDC updates as container blocks framed with ``sync`` into the
    landing store under ``parts`` (`cdc_file.Written`); the driver commits and frames them."""

    uri: str
    lo: int
    sync: bytes
    parts: str
    store: tuple                     # (url, endpoint_url, region) of the landing store
    codec: str = "zstandard"         # the feed file's Avro block codec (the stream's ``landing.codec``)


@dataclass
class TablePlan:
    """What the executors need to merge one table's buckets (picklable)."""

    table: str
    bucket_plan: layout.BucketPlan
    lower: int
    frontier: int
    full: Any = None                 # pyarrow schema: meta columns + the table's columns
    log: LogPlan | None = None       # where the executors write the table's changelog (None: committed already)
    truncates: list = field(default_factory=list)   # [(time, position, commit_ts)] in [lower, frontier), in order
    replay: bool = False             # only the changelog rows, to the driver; no file written (`batch.replay`)
    history: Any = None              # `history.HistorySpec`: its history kept in the same tasks (`history.in_merge`)
    max_records: int | None = None   # a group of more records is merged key range by key range (`_key_ranges`)
