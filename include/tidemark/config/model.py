"""What a stream's configuration is: `StreamConfig` and its parts, as `tidemark.config.parse` builds
them from a stream file, and as plain data again (`StreamConfig.as_dict`, stored in the control database)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tidemark.errors import ConfigError
from tidemark.pgtypes import qualified_name


@dataclass(frozen=True)
class TableRef:
    schema: str
    name: str

    @property
    def qualified(self) -> str:
        """``schema.table``, parts quoted where needed (`tidemark.pgtypes.qualified_name`)."""
        return qualified_name(self.schema, self.name)

    def __str__(self) -> str:
        return self.qualified

    @classmethod
    def parse(cls, text: str, key: str = "table", origin: str | None = None) -> "TableRef":
        """Parse ``schema.table`` or ``table`` (schema ``public``); quoted parts keep dots and case.
        ``origin``: the stream file it is read from, named by the error."""
        parts = _split_qualified(text, key, origin)
        if len(parts) == 1:
            return cls("public", parts[0])
        if len(parts) == 2:
            return cls(parts[0], parts[1])
        raise ConfigError(key, f"{text!r} is not 'schema.table'", source=origin)


def _split_qualified(text: str, key: str, origin: str | None = None) -> list[str]:
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(key, "must be a non-empty string 'schema.table'", source=origin)
    parts, cur, quoted, i = [], "", False, 0
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == '"' and i + 1 < len(text) and text[i + 1] == '"':
                cur += '"'
                i += 1
            elif ch == '"':
                quoted = False
            else:
                cur += ch
        elif ch == '"':
            quoted = True
        elif ch == ".":
            parts.append(cur)
            cur = ""
        else:
            cur += ch.lower() if ch.isascii() else ch
        i += 1
    if quoted:
        raise ConfigError(key, f"{text!r} has an unterminated quote", source=origin)
    parts.append(cur)
    if any(p == "" for p in parts):
        raise ConfigError(key, f"{text!r} has an empty part", source=origin)
    return parts


@dataclass(frozen=True)
class TableFilter:
    """What of one table the stream captures: the publication's column list (``columns``: exact
    column names, None: every column) and row filter (``where``: a boolean SQL expression over the
    table's columns, None: every row). PostgreSQL's pgoutput then sends only those columns and
    rows; the snapshot, a resend's range checksums and parity read the same columns under the same
    WHERE (`tidemark.capture.source.published_filter`)."""

    columns: tuple[str, ...] | None = None
    where: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"columns": list(self.columns) if self.columns is not None else None, "where": self.where}


NO_FILTER = TableFilter()


@dataclass(frozen=True)
class SourceConfig:
    connection: str
    publication: str
    slot: str
    tables: tuple[TableRef, ...]
    kind: str = "postgresql"        # or "feed": Materialize CDC files from another producer (tidemark.feeds)
    filters: tuple[tuple[TableRef, TableFilter], ...] = ()   # the tables with a column list or row filter

    @property
    def is_feed(self) -> bool:
        return self.kind == "feed"

    def filter_of(self, ref: TableRef | str) -> TableFilter:
        """The table's column list and row filter (`NO_FILTER`: the whole table)."""
        ref = ref if isinstance(ref, TableRef) else TableRef.parse(ref)
        return next((f for r, f in self.filters if r == ref), NO_FILTER)

    def table_entries(self) -> list[Any]:
        """``source.tables`` as plain data: ``schema.table``, or a mapping for a filtered table."""
        return [t.qualified if self.filter_of(t) == NO_FILTER else
                {"name": t.qualified, **{k: v for k, v in self.filter_of(t).as_dict().items() if v is not None}}
                for t in self.tables]


@dataclass(frozen=True)
class LandingConfig:
    url: str
    endpoint_url: str | None = None
    region: str | None = None
    codec: str = "zstandard"        # the Avro codec new segments' blocks are compressed with


@dataclass(frozen=True)
class DrainConfig:
    max_changes: int = 200_000
    max_bytes: int = 256 * 1024 * 1024
    ack_policy: str = "frontier"
    idle_timeout_seconds: float = 2.0     # silence after which a drain reports that it waits for the walsender
    stall_timeout_seconds: float = 300.0  # no progress at all for this long: the drain fails (lands nothing)


@dataclass(frozen=True)
class SnapshotConfig:
    chunk_pages: int = 2000
    parallelism: int = 2


@dataclass(frozen=True)
class ConsolidateConfig:
    buckets: int = 16
    count_timeout_seconds: int = 600
    # at most this many bytes of segments, and records, per Spark job: a backlog goes slice by slice
    # (segments are compressed, so their records bound the decoded size better than their bytes)
    max_batch_bytes: int = 64 * 1024 * 1024
    max_batch_records: int = 500_000
    # besides on every landing, the consolidate DAG runs this often (cron */N): its gap sensor finds what
    # no drain reports (a lost slot stops the drains) and branches to the repair or resend; 0: never
    check_every_minutes: int = 5
    # a run of the consolidate task goes on with the next batch while records have landed meanwhile,
    # for at most this long (its client and warm Spark session serve each batch: no task, client or
    # session start between them); 0: one batch (and its slices) per run
    follow_seconds: int = 120
    spark_conf: dict[str, str | int | float] = field(default_factory=dict)   # spark.* -> value


@dataclass(frozen=True)
class StreamConfig:
    stream: str
    source: SourceConfig
    control_connection: str
    landing: LandingConfig
    lake_path: str
    drain: DrainConfig = field(default_factory=DrainConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    consolidate: ConsolidateConfig = field(default_factory=ConsolidateConfig)
    origin: str | None = None  # file it was read from
    history: tuple[TableRef, ...] = ()   # tables with an SCD type 2 history table (`consolidate.history`)
    history_all: bool = False            # ``history: all``: every table with a key (keyless ones have none)
    lake_retention_seconds: float = 7 * 86400.0   # ``lake.retention``: the window the past is readable in
    lake_maintain_cron: str = "30 3 * * *"        # ``lake.maintain``: when the maintain DAG runs (cron, UTC)

    def as_dict(self) -> dict[str, Any]:
        """Return the configuration as plain data (stored in the control database)."""
        return {
            "stream": self.stream,
            "source": ({"kind": "feed", "tables": [t.qualified for t in self.source.tables]} if self.source.is_feed else
                       {"connection": self.source.connection, "publication": self.source.publication,
                        "slot": self.source.slot, "tables": self.source.table_entries()}),
            "control": {"connection": self.control_connection},
            "landing": vars(self.landing).copy(),
            "lake": {"path": self.lake_path, "retention": _duration_text(self.lake_retention_seconds),
                     "maintain": self.lake_maintain_cron},
            "drain": vars(self.drain).copy(),
            "snapshot": vars(self.snapshot).copy(),
            "consolidate": vars(self.consolidate).copy(),
            **({"history": "all" if self.history_all else [t.qualified for t in self.history]}
               if self.history else {}),
        }


_DURATION_UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(second|minute|hour|day|week)s?\s*$", re.IGNORECASE)


def _duration_text(seconds: float) -> str:
    """``seconds`` as a duration string `parse_duration` reads back exactly (no exponent)."""
    return f"{seconds:.6f}".rstrip("0").rstrip(".") + " seconds"


def parse_duration(value: Any, key: str, origin: str | None = None) -> float:
    """Seconds of a duration string such as ``"7 days"``, ``"1 minute"``, ``"12 hours"`` (a number
    and one unit: seconds, minutes, hours, days or weeks); must be positive."""
    m = _DURATION.match(value) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(key, f"{value!r} is not a duration such as '7 days' or '1 minute' (a positive number "
                               "and one of seconds, minutes, hours, days, weeks)", source=origin)
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
