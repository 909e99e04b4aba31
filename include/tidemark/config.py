"""Stream configuration: YAML files validated into a `StreamConfig`.

A stream file looks like this (see ``include/streams/demo.yaml``)::

    stream: demo
    source:
      connection: tidemark_source        # Airflow connection id, or AIRFLOW_CONN_TIDEMARK_SOURCE
      publication: tidemark_demo         # created by `tidemark stream apply` if missing
      slot: tidemark_demo
      tables: [public.customers, public.orders]   # or per table: {name: public.users, columns: [id, email,
                                                  #   region], where: "region = 'eu'"} (the publication's
                                                  #   column list and row filter; `TableFilter`)
    control:
      connection: tidemark_control
    landing:
      url: file:///var/lib/tidemark/landing   # or s3://bucket/prefix
      endpoint_url: null                      # S3-compatible endpoint (optional)
      codec: zstandard                        # segments' Avro block codec: zstandard, deflate or null
    lake:
      path: /var/lib/tidemark/lake
      retention: 7 days                  # how far back the lake (and the landing store) can be read;
                                         # `tidemark maintain` deletes what only older positions need
    drain:
      max_changes: 200000
      max_bytes: 268435456
      ack_policy: frontier               # or: landed
    snapshot:
      chunk_pages: 2000
      parallelism: 2
    consolidate:
      buckets: 16
      count_timeout_seconds: 600
      check_every_minutes: 5             # the consolidate DAG also runs this often, new segments or not:
                                         # it mends what stops the drain (a lost slot) unattended; 0: never
      spark_conf:                        # Spark settings of this stream's consolidation (`tidemark.sparkconf`)
        spark.driver.memory: 4g
    history: [public.orders]             # SCD type 2 history tables kept beside these (or: all); keyed tables only

``landing.url``, ``landing.endpoint_url`` and ``lake.path`` may use ``${VAR}`` from the environment.
Errors name the key that is wrong (``source.tables[1]``) and why. Checks that need the source
database (the table exists, its replica identity names its rows: a primary key, USING INDEX of a
unique index on NOT NULL columns, or FULL) are in `validate_against_source`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tidemark.errors import ConfigError
from tidemark.pgtypes import lake_name_problem, qualified_name
from tidemark.pgtypes.catalog import column_attnums, generated_columns, table_schema_for_oid

NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
ACK_POLICIES = ("frontier", "landed")
LANDING_CODECS = ("zstandard", "deflate", "null")     # `tidemark.landing.segments.CODECS`


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
    def parse(cls, text: str, key: str = "table") -> "TableRef":
        """Parse ``schema.table`` or ``table`` (schema ``public``); quoted parts keep dots and case."""
        parts = _split_qualified(text, key)
        if len(parts) == 1:
            return cls("public", parts[0])
        if len(parts) == 2:
            return cls(parts[0], parts[1])
        raise ConfigError(key, f"{text!r} is not 'schema.table'")


def _split_qualified(text: str, key: str) -> list[str]:
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(key, "must be a non-empty string 'schema.table'")
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
        raise ConfigError(key, f"{text!r} has an unterminated quote")
    parts.append(cur)
    if any(p == "" for p in parts):
        raise ConfigError(key, f"{text!r} has an empty part")
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

    def as_dict(self) -> dict[str, Any]:
        """Return the configuration as plain data (stored in the control database)."""
        return {
            "stream": self.stream,
            "source": ({"kind": "feed", "tables": [t.qualified for t in self.source.tables]} if self.source.is_feed else
                       {"connection": self.source.connection, "publication": self.source.publication,
                        "slot": self.source.slot, "tables": self.source.table_entries()}),
            "control": {"connection": self.control_connection},
            "landing": {"url": self.landing.url, "endpoint_url": self.landing.endpoint_url,
                        "region": self.landing.region, "codec": self.landing.codec},
            "lake": {"path": self.lake_path, "retention": _duration_text(self.lake_retention_seconds)},
            "drain": vars(self.drain).copy(),
            "snapshot": vars(self.snapshot).copy(),
            "consolidate": vars(self.consolidate).copy(),
            **({"history": "all" if self.history_all else [t.qualified for t in self.history]}
               if self.history else {}),
        }


_TOP_KEYS = {"stream", "source", "control", "landing", "lake", "drain", "snapshot", "consolidate", "history"}


_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: Any, key: str, origin: str | None) -> Any:
    """Expand ``${VAR}`` in a string from the environment; an unset variable is an error."""
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(1) not in os.environ:
            raise ConfigError(key, f"environment variable {m.group(1)} is not set", source=origin)
        return os.environ[m.group(1)]

    return _VAR_RE.sub(sub, value)


def _section(doc: dict, key: str, allowed: set[str], required: bool, origin: str | None) -> dict:
    value = doc.get(key)
    if value is None:
        if required:
            raise ConfigError(key, "is required", source=origin)
        return {}
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a mapping, got {type(value).__name__}", source=origin)
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"unknown key (allowed: {', '.join(sorted(allowed))})", source=origin)
    return value


def _name(value: Any, key: str, origin: str | None) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ConfigError(key, f"{value!r} is not a valid name (lower-case letters, digits and _, "
                               "starting with a letter or _, at most 63 characters)", source=origin)
    return value


def _positive(section: dict, key: str, default: float, origin: str | None) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"drain.{key}", f"must be a positive number, got {value!r}", source=origin)
    return float(value)


def _posint(section: dict, key: str, prefix: str, default: int, origin: str | None, minimum: int = 1) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{prefix}.{key}", f"must be an integer >= {minimum}, got {value!r}", source=origin)
    return value


def _spark_conf(value: Any, origin: str | None) -> dict[str, str | int | float]:
    """``consolidate.spark_conf``: a mapping of Spark setting names (``spark.…``) to strings or numbers."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError("consolidate.spark_conf", f"must be a mapping of spark.* settings, got "
                                                    f"{type(value).__name__}", source=origin)
    out: dict[str, str | int | float] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not re.fullmatch(r"spark\.[A-Za-z0-9_.\-]+", k):
            raise ConfigError(f"consolidate.spark_conf.{k}", "is not a Spark setting name (spark.…)", source=origin)
        if isinstance(v, bool) or not isinstance(v, (str, int, float)) or (isinstance(v, str) and not v.strip()):
            raise ConfigError(f"consolidate.spark_conf.{k}", f"must be a string or a number, got {v!r}",
                              source=origin)
        out[k] = v
    return out


def parse_config(doc: Any, origin: str | None = None) -> StreamConfig:
    """Validate a parsed YAML document into a `StreamConfig`, or raise `ConfigError` naming the key."""
    if not isinstance(doc, dict):
        raise ConfigError("(top)", "a stream file must be a mapping", source=origin)
    unknown = sorted(set(doc) - _TOP_KEYS)
    if unknown:
        raise ConfigError(unknown[0], f"unknown key (allowed: {', '.join(sorted(_TOP_KEYS))})", source=origin)
    if "stream" not in doc:
        raise ConfigError("stream", "is required", source=origin)
    stream = _name(doc["stream"], "stream", origin)

    src = _section(doc, "source", {"kind", "connection", "publication", "slot", "tables"}, True, origin)
    kind = src.get("kind", "postgresql")
    if kind not in ("postgresql", "feed"):
        raise ConfigError("source.kind", f"{kind!r} is not one of postgresql, feed", source=origin)
    if kind == "feed":
        src = {"connection": "", **src}     # no PostgreSQL behind an external feed
    for req in ("connection", "tables"):
        if req not in src:
            raise ConfigError(f"source.{req}", "is required", source=origin)
    if kind == "feed":
        if src["connection"] or "publication" in src or "slot" in src:
            raise ConfigError("source", "a feed (kind: feed) has no connection, publication or slot", source=origin)
    elif not isinstance(src["connection"], str) or not src["connection"]:
        raise ConfigError("source.connection", "must be a connection id (string)", source=origin)
    tables_raw = src["tables"]
    if not isinstance(tables_raw, list) or not tables_raw:
        raise ConfigError("source.tables", "must be a non-empty list of 'schema.table'", source=origin)
    tables: list[TableRef] = []
    filters: list[tuple[TableRef, TableFilter]] = []
    for i, t in enumerate(tables_raw):
        ref, filt = _table_entry(t, f"source.tables[{i}]", kind, origin)
        if ref in tables:
            raise ConfigError(f"source.tables[{i}]", f"{ref} is listed twice", source=origin)
        tables.append(ref)
        if filt != NO_FILTER:
            filters.append((ref, filt))
    source = SourceConfig(
        connection=src["connection"],
        publication=_name(src.get("publication", f"tidemark_{stream}"), "source.publication", origin),
        slot=_name(src.get("slot", f"tidemark_{stream}"), "source.slot", origin),
        tables=tuple(tables),
        kind=kind,
        filters=tuple(filters),
    )

    ctl = _section(doc, "control", {"connection"}, False, origin)
    control_connection = ctl.get("connection", "tidemark_control")
    if not isinstance(control_connection, str) or not control_connection:
        raise ConfigError("control.connection", "must be a connection id (string)", source=origin)

    land = _section(doc, "landing", {"url", "endpoint_url", "region", "codec"}, True, origin)
    url = _expand(land.get("url"), "landing.url", origin)
    if not isinstance(url, str) or not re.match(r"^(file://|s3://|/)", url):
        raise ConfigError("landing.url", f"{url!r} must be an absolute path, file:///path or s3://bucket/prefix",
                          source=origin)
    if url.startswith("s3://") and not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$", url):
        raise ConfigError("landing.url", f"{url!r} has an invalid S3 bucket name", source=origin)
    codec = land.get("codec", "zstandard")
    if codec not in LANDING_CODECS:
        raise ConfigError("landing.codec", f"{codec!r} is not one of {', '.join(LANDING_CODECS)}", source=origin)
    landing = LandingConfig(url=url, endpoint_url=_expand(land.get("endpoint_url"), "landing.endpoint_url", origin),
                            region=land.get("region"), codec=codec)

    lake = _section(doc, "lake", {"path", "retention"}, True, origin)
    retention = parse_duration(lake.get("retention", "7 days"), "lake.retention", origin)
    lake_path = _expand(lake.get("path"), "lake.path", origin)
    if not isinstance(lake_path, str) or not lake_path:
        raise ConfigError("lake.path", "is required (a directory or file:// URL)", source=origin)
    if "%" in lake_path and not lake_path.startswith("s3://"):
        raise ConfigError("lake.path", f"{lake_path!r}: a '%' in a local lake path is not supported "
                                       "(Delta Lake reads it as a percent-escape)", source=origin)

    dr = _section(doc, "drain", {"max_changes", "max_bytes", "ack_policy", "idle_timeout_seconds",
                                   "stall_timeout_seconds"}, False, origin)
    ack = dr.get("ack_policy", "frontier")
    if ack not in ACK_POLICIES:
        raise ConfigError("drain.ack_policy", f"{ack!r} is not one of {', '.join(ACK_POLICIES)}", source=origin)
    idle = dr.get("idle_timeout_seconds", 2.0)
    if isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle <= 0:
        raise ConfigError("drain.idle_timeout_seconds", f"must be a positive number, got {idle!r}", source=origin)
    drain = DrainConfig(max_changes=_posint(dr, "max_changes", "drain", 200_000, origin),
                        max_bytes=_posint(dr, "max_bytes", "drain", 256 * 1024 * 1024, origin, minimum=1024),
                        ack_policy=ack, idle_timeout_seconds=float(idle),
                        stall_timeout_seconds=_positive(dr, "stall_timeout_seconds", 300.0, origin))

    sn = _section(doc, "snapshot", {"chunk_pages", "parallelism"}, False, origin)
    snapshot = SnapshotConfig(chunk_pages=_posint(sn, "chunk_pages", "snapshot", 2000, origin),
                              parallelism=_posint(sn, "parallelism", "snapshot", 2, origin))

    co = _section(doc, "consolidate", {"buckets", "count_timeout_seconds", "max_batch_bytes", "max_batch_records",
                                       "check_every_minutes", "spark_conf"}, False, origin)
    check = _posint(co, "check_every_minutes", "consolidate", 5, origin, minimum=0)
    if check > 59:
        raise ConfigError("consolidate.check_every_minutes", f"must be at most 59 (a cron minute step), got {check}",
                          source=origin)
    consolidate = ConsolidateConfig(buckets=_posint(co, "buckets", "consolidate", 16, origin),
                                    count_timeout_seconds=_posint(co, "count_timeout_seconds", "consolidate", 600,
                                                                  origin),
                                    max_batch_bytes=_posint(co, "max_batch_bytes", "consolidate",
                                                            64 * 1024 * 1024, origin, minimum=1024),
                                    max_batch_records=_posint(co, "max_batch_records", "consolidate", 500_000,
                                                              origin),
                                    check_every_minutes=check,
                                    spark_conf=_spark_conf(co.get("spark_conf"), origin))
    history = _history(doc.get("history"), source.tables, origin)
    return StreamConfig(stream=stream, source=source, control_connection=control_connection, landing=landing,
                        lake_path=lake_path, drain=drain, snapshot=snapshot, consolidate=consolidate, origin=origin,
                        history=history, history_all=doc.get("history") == "all", lake_retention_seconds=retention)


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


def _table_entry(value: Any, key: str, kind: str, origin: str | None) -> tuple[TableRef, TableFilter]:
    """One ``source.tables`` entry: ``schema.table``, or ``{name, columns, where}`` (`TableFilter`)."""
    if isinstance(value, str):
        return TableRef.parse(value, key=key), NO_FILTER
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a string 'schema.table' or a mapping {{name, columns, where}}, got {value!r}",
                          source=origin)
    unknown = sorted(set(value) - {"name", "columns", "where"})
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", "unknown key (allowed: columns, name, where)", source=origin)
    if not isinstance(value.get("name"), str):
        raise ConfigError(f"{key}.name", f"must be a string 'schema.table', got {value.get('name')!r}", source=origin)
    ref = TableRef.parse(value["name"], key=f"{key}.name")
    if kind == "feed" and (value.get("columns") is not None or value.get("where") is not None):
        raise ConfigError(key, "a feed (kind: feed) has no publication: columns and where are for PostgreSQL "
                               "sources", source=origin)
    columns = value.get("columns")
    if columns is not None:
        if (not isinstance(columns, list) or not columns
                or not all(isinstance(c, str) and c and c == c.strip() for c in columns)):
            raise ConfigError(f"{key}.columns", f"must be a non-empty list of column names, got {columns!r}",
                              source=origin)
        twice = sorted({c for c in columns if columns.count(c) > 1})
        if twice:
            raise ConfigError(f"{key}.columns", f"{twice[0]} is listed twice", source=origin)
        columns = tuple(columns)
    where = value.get("where")
    if where is not None:
        if not isinstance(where, str) or not where.strip():
            raise ConfigError(f"{key}.where", f"must be a SQL boolean expression (a string), got {where!r}",
                              source=origin)
        problem = _expression_problem(where)
        if problem:
            raise ConfigError(f"{key}.where", f"{ref}: {where!r}: {problem}", source=origin)
        where = where.strip()
    return ref, TableFilter(columns=columns, where=where)


def _expression_problem(text: str) -> str | None:
    """Why ``text`` is not one SQL expression that can stand inside ``WHERE (...)`` of a publication
    and a SELECT (PostgreSQL checks the rest at `stream apply`): no ``;``, no comment, parentheses
    balanced outside quotes, quotes closed (``'...'``, ``E'...'`` with backslash escapes, ``"..."``);
    dollar quoting is not taken. Checked so that the text cannot end the parenthesis it is put in."""
    depth, i, n = 0, 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "'\"":
            escapes = ch == "'" and i > 0 and text[i - 1] in "eE" and (i < 2 or not (text[i - 2].isalnum()
                                                                               or text[i - 2] == "_"))
            j = i + 1
            while True:
                if j >= n:
                    return f"an unterminated {'string' if ch == chr(39) else 'quoted name'}"
                if escapes and text[j] == "\\":
                    j += 2
                    continue
                if text[j] == ch:
                    if j + 1 < n and text[j + 1] == ch:
                        j += 2
                        continue
                    break
                j += 1
            i = j + 1
            continue
        if ch == ";":
            return "a ';' (one expression, not statements)"
        if text.startswith("--", i) or text.startswith("/*", i):
            return "a comment"
        if ch == "$" and (i + 1 < n and (text[i + 1] == "$" or text[i + 1].isalpha() or text[i + 1] == "_")) \
                and not (i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")):
            return "dollar quoting (use '...')"
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return "a ')' without its '('"
        i += 1
    return "a '(' without its ')'" if depth else None


def _history(value: Any, tables: tuple[TableRef, ...], origin: str | None) -> tuple[TableRef, ...]:
    """``history:``: ``all`` (every captured table with a key), or a list of captured tables (absent: none)."""
    if value is None:
        return ()
    if value == "all":
        return tuple(tables)
    if not isinstance(value, list):
        raise ConfigError("history", f"must be 'all' or a list of 'schema.table' of source.tables, got {value!r}",
                          source=origin)
    out: list[TableRef] = []
    for i, t in enumerate(value):
        ref = TableRef.parse(t, key=f"history[{i}]") if isinstance(t, str) else None
        if ref is None:
            raise ConfigError(f"history[{i}]", f"must be a string 'schema.table', got {t!r}", source=origin)
        if ref not in tables:
            raise ConfigError(f"history[{i}]", f"{ref} is not one of source.tables", source=origin)
        if ref in out:
            raise ConfigError(f"history[{i}]", f"{ref} is listed twice", source=origin)
        out.append(ref)
    return tuple(out)


def load_config(path: str | Path) -> StreamConfig:
    """Read and validate one stream file."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError("(file)", "does not exist", source=str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError("(yaml)", f"not valid YAML: {exc}", source=str(path)) from None
    return parse_config(doc, origin=str(path))


def load_stream_dir(directory: str | Path) -> list[StreamConfig]:
    """Read every ``*.yaml`` / ``*.yml`` stream file in a directory, sorted by name; raise the first
    file's `ConfigError` (see `scan_stream_dir` for one that keeps the good files)."""
    configs, errors = scan_stream_dir(directory)
    if errors:
        raise next(iter(errors.values()))
    return configs


def scan_stream_dir(directory: str | Path) -> tuple[list[StreamConfig], dict[str, ConfigError]]:
    """Read every ``*.yaml`` / ``*.yml`` stream file in a directory, sorted by name: the valid
    configs, and each broken file's `ConfigError` (naming the file and the key) by path. A file that
    defines a stream name already defined by an earlier file is broken; one bad file never hides
    the others."""
    directory = Path(directory)
    files = sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])
    configs: list[StreamConfig] = []
    errors: dict[str, ConfigError] = {}
    seen: dict[str, str] = {}
    for f in files:
        try:
            cfg = load_config(f)
        except ConfigError as exc:
            errors[str(f)] = exc
            continue
        if cfg.stream in seen:
            errors[str(f)] = ConfigError("stream", f"{cfg.stream!r} is also defined in {seen[cfg.stream]}",
                                         source=cfg.origin)
            continue
        seen[cfg.stream] = cfg.origin or "?"
        configs.append(cfg)
    return configs, errors


def validate_against_source(cfg: StreamConfig, conn) -> list[str]:
    """Check the tables against the source database: they exist, and each has a replica identity
    that names its rows (`replica_identity_problem`). ``conn`` is an open psycopg2 connection to the
    source. Returns notes on what will not be captured (generated columns: pgoutput does not publish
    them)."""
    notes: list[str] = []
    with conn.cursor() as cur:
        for i, ref in enumerate(cfg.source.tables):
            key = f"source.tables[{i}]"
            cur.execute(
                """SELECT c.oid, c.relkind, c.relreplident,
                          EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
                          EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident)
                     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE n.nspname = %s AND c.relname = %s""",
                (ref.schema, ref.name),
            )
            row = cur.fetchone()
            if row is None:
                raise ConfigError(key, f"table {ref} does not exist in the source database", source=cfg.origin)
            oid, relkind, replident, has_pk, has_ri_index = row
            if relkind not in ("r", "p"):
                raise ConfigError(key, f"{ref} is not a table (relkind {relkind!r})", source=cfg.origin)
            problem = replica_identity_problem(conn, ref, oid, replident, has_pk, has_ri_index)
            if problem:
                raise ConfigError(key, problem, source=cfg.origin)
            if ref in cfg.history and replident == "f":
                if cfg.history_all:
                    notes.append(f"history: all: {ref} has no key (REPLICA IDENTITY FULL), so it gets no history "
                                 "table")
                else:
                    raise ConfigError(f"history[{cfg.history.index(ref)}]",
                                      f"{ref} has no key (REPLICA IDENTITY FULL): a history table follows each "
                                      "key's versions; take it out of history:", source=cfg.origin)
            cur.execute("""SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0
                            AND NOT attisdropped ORDER BY attnum""", (oid,))
            problem = lake_name_problem([r[0] for r in cur.fetchall()])
            if problem:
                raise ConfigError(key, f"table {ref}: {problem}", source=cfg.origin)
            if cfg.source.filter_of(ref) != NO_FILTER:
                trial_filter(cfg, conn, ref, oid, key)
            generated = generated_columns(conn, ref.schema, ref.name)
            if generated:
                notes.append(f"{key}: {ref} column(s) {', '.join(generated)} are GENERATED ALWAYS ... STORED; "
                             "PostgreSQL's pgoutput does not publish generated columns, so they are not captured "
                             "and the lake table has no such column")
    return notes


def publication_table(ref: TableRef, filt: TableFilter):
    """The publication's table element: ``schema.table [(columns)] [WHERE (expr)]`` (psycopg2.sql)."""
    from psycopg2 import sql

    out = sql.Identifier(ref.schema, ref.name)
    if filt.columns is not None:
        out = sql.SQL("{} ({})").format(out, sql.SQL(", ").join(sql.Identifier(c) for c in filt.columns))
    if filt.where is not None:       # one expression, checked by `_expression_problem` and by PostgreSQL
        out = sql.SQL("{} WHERE ({})").format(out, sql.SQL(filt.where))
    return out


def trial_filter(cfg: StreamConfig, conn, ref: TableRef, oid: int, key: str = "source.tables") -> str | None:
    """Check a table's column list and row filter against the source and return the filter as
    PostgreSQL stores it (``pg_get_expr``; None: no filter). The column list must name existing
    columns and hold the table's replica identity (its key; under REPLICA IDENTITY FULL every column);
    the row filter must be an expression PostgreSQL takes for a publication (tried in a publication
    created and rolled back in one transaction) and, as the stream publishes UPDATE and DELETE, use
    only replica-identity columns: PostgreSQL accepts other columns at CREATE PUBLICATION but then
    refuses every UPDATE and DELETE of the table. Raises `ConfigError` naming the table."""
    import secrets

    from psycopg2 import errors as pg_errors
    from psycopg2 import sql

    filt = cfg.source.filter_of(ref)
    shape = table_schema_for_oid(conn, oid)
    names = [c.name for c in shape.columns]
    ident = [c.name for c in shape.columns if c.key]
    full = shape.replica_identity == "f"
    if filt.columns is not None:
        unknown = [c for c in filt.columns if c not in names]
        if unknown:
            raise ConfigError(f"{key}.columns", f"table {ref} has no column {', '.join(unknown)} (columns that "
                                                f"can be published: {', '.join(names)})", source=cfg.origin)
        lacking = [c for c in ident if c not in filt.columns]
        if lacking:
            why = ("it is REPLICA IDENTITY FULL: every column is in its identity, so the column list must name "
                   "them all" if full else f"its key (replica identity) is {', '.join(ident)}")
            raise ConfigError(f"{key}.columns", f"table {ref}: the column list lacks {', '.join(lacking)}: {why} "
                                                "(PostgreSQL refuses UPDATE and DELETE of a table whose publication's "
                                                "column list does not hold its replica identity)", source=cfg.origin)
    name = f"tidemark_check_{secrets.token_hex(6)}"
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        try:
            cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish_via_partition_root = true)")
                        .format(sql.Identifier(name), publication_table(ref, filt)))
            cur.execute("""SELECT pg_get_expr(pr.prqual, pr.prrelid), pr.prqual::text FROM pg_publication_rel pr
                             JOIN pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = %s""", (name,))
            where, tree = cur.fetchone()
        except pg_errors.InsufficientPrivilege:
            raise
        except Exception as exc:
            what = (f"where {filt.where!r}" if filt.where is not None else "") + \
                   (" and " if filt.where is not None and filt.columns is not None else "") + \
                   (f"columns {list(filt.columns)}" if filt.columns is not None else "")
            raise ConfigError(key, f"table {ref}: {what}: PostgreSQL refuses it: "
                                   f"{' '.join(str(getattr(exc, 'pgerror', None) or exc).split())}",
                              source=cfg.origin) from None
        finally:
            cur.execute("ROLLBACK")
    if where is not None and not full:
        by_num = {v: k for k, v in column_attnums(conn, oid).items()}
        used = sorted({by_num.get(int(n), f"attnum {n}") for n in re.findall(r":varattno (-?\d+)", tree or "")})
        outside = [c for c in used if c not in ident]
        if outside:
            raise ConfigError(f"{key}.where", f"table {ref}: the row filter {filt.where!r} uses {', '.join(outside)}, "
                                              f"outside the table's replica identity ({', '.join(ident)}); the stream "
                                              "publishes UPDATE and DELETE, so PostgreSQL would refuse them: filter "
                                              "on key columns only, or make the table REPLICA IDENTITY FULL",
                              source=cfg.origin)
    return where


# A unique index PostgreSQL accepts for REPLICA IDENTITY USING INDEX: not partial, no expressions,
# not deferrable, valid, every key column NOT NULL (INCLUDE columns may be null); not the primary key
# (DEFAULT is that). Named in the refusal of a table whose replica identity names no row.
_IDENTITY_INDEX_SQL = """
SELECT quote_ident(ic.relname),
       ARRAY(SELECT a.attname::text FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) WITH ORDINALITY k(num, ord)
               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.num ORDER BY k.ord)
  FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
 WHERE i.indrelid = %s AND i.indisunique AND i.indimmediate AND i.indisvalid AND i.indpred IS NULL
   AND i.indexprs IS NULL AND NOT i.indisprimary
   AND NOT EXISTS (SELECT 1 FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) k(num)
                     JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.num WHERE NOT a.attnotnull)
 ORDER BY i.indnkeyatts, ic.relname LIMIT 1
"""


def replica_identity_problem(conn, ref: TableRef, oid: int, replident: str, has_pk: bool,
                             has_ri_index: bool) -> str | None:
    """Why the table's replica identity does not name its rows in pgoutput's changes, with the
    commands that give it one; None when it does. A row is named by its replica identity's columns
    (pgoutput's old-key images carry exactly those): the primary key (DEFAULT), the columns of a
    unique index on NOT NULL columns (USING INDEX, with or without a primary key: the lake's key is
    that index's columns), or the whole row (FULL: the table is a multiset). DEFAULT without a
    primary key, NOTHING, and USING INDEX whose index was dropped (PostgreSQL then behaves as
    NOTHING) send no old key, and PostgreSQL refuses UPDATE and DELETE on such a published table."""
    if replident == "f" or (replident == "d" and has_pk) or (replident == "i" and has_ri_index):
        return None
    if replident == "d":
        why = f"{ref} has no primary key and is REPLICA IDENTITY DEFAULT (its changes name no row)"
    elif replident == "i":
        why = (f"{ref} is REPLICA IDENTITY USING INDEX, but that index no longer exists (PostgreSQL then "
               "treats it as NOTHING: its changes name no row)")
    else:
        why = f"{ref} is REPLICA IDENTITY NOTHING (its changes name no row)"
    options = [f"ALTER TABLE {ref} REPLICA IDENTITY DEFAULT (its primary key)"] if has_pk else \
        [f"ALTER TABLE {ref} ADD PRIMARY KEY (...)"]
    with conn.cursor() as cur:
        cur.execute(_IDENTITY_INDEX_SQL, (oid,))
        index = cur.fetchone()
    if index:
        options.append(f"ALTER TABLE {ref} REPLICA IDENTITY USING INDEX {index[0]} (its unique index on "
                       f"NOT NULL columns {', '.join(index[1])})")
    else:
        options.append(f"ALTER TABLE {ref} REPLICA IDENTITY USING INDEX <a unique index on NOT NULL columns>")
    options.append(f"ALTER TABLE {ref} REPLICA IDENTITY FULL (no key: the table is kept as a multiset of whole rows)")
    return f"{why}; run one of: " + "; ".join(options)
