"""Stream files read and validated into a `StreamConfig` (`tidemark.config.model`): every error names
the file, the key that is wrong (``source.tables[1]``) and why."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import yaml

from tidemark.config.model import (NO_FILTER, ConsolidateConfig, DrainConfig, LandingConfig,
                                   SnapshotConfig, SourceConfig, StreamConfig, TableFilter, TableRef, parse_duration)
from tidemark.errors import ConfigError

NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
ACK_POLICIES = ("frontier", "landed")
LANDING_CODECS = ("zstandard", "deflate", "null")     # `tidemark.landing.segments.CODECS`
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


def _section(doc: dict, key: str, allowed, required: bool, origin: str | None) -> dict:
    """Section ``key`` of ``doc``, its keys ``allowed`` (a set, or a dataclass's fields)."""
    allowed = {f.name for f in dataclasses.fields(allowed)} if isinstance(allowed, type) else allowed
    value = doc.get(key)
    if value is None:
        if required:
            raise ConfigError(key, "is required", source=origin)
        return {}
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a mapping, got {type(value).__name__}", source=origin)
    _known_keys(value, allowed, f"{key}.", origin)
    return value


def _known_keys(value: dict, allowed: set[str], prefix: str, origin: str | None) -> None:
    """Raise `ConfigError` naming ``prefix`` + the first key of ``value`` that is not ``allowed``."""
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}", f"unknown key (allowed: {', '.join(sorted(allowed))})", source=origin)


def _name(value: Any, key: str, origin: str | None) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ConfigError(key, f"{value!r} is not a valid name (lower-case letters, digits and _, "
                               "starting with a letter or _, at most 63 characters)", source=origin)
    return value


def _numbers(cls, section: dict, prefix: str, origin: str | None, minimum: dict[str, int] | None = None,
             first: tuple[str, ...] = ()) -> dict[str, int | float]:
    """The numeric settings of section ``prefix`` (those of dataclass ``cls`` with a number as default;
    those named in ``first`` checked first), each defaulting to the field's default: a positive
    number where that is a float, else an integer >= ``minimum`` (1)."""
    values: dict[str, int | float] = {}
    numeric = [f for f in dataclasses.fields(cls) if type(f.default) in (int, float)]
    for f in sorted(numeric, key=lambda f: f.name not in first):
        value = section.get(f.name, f.default)
        if isinstance(f.default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{prefix}.{f.name}", f"must be a positive number, got {value!r}", source=origin)
            values[f.name] = float(value)
            continue
        least = (minimum or {}).get(f.name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{prefix}.{f.name}", f"must be an integer >= {least}, got {value!r}", source=origin)
        values[f.name] = value
    return values


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
    _known_keys(doc, _TOP_KEYS, "", origin)
    if "stream" not in doc:
        raise ConfigError("stream", "is required", source=origin)
    stream = _name(doc["stream"], "stream", origin)
    source = _source(doc, stream, origin)
    ctl = _section(doc, "control", {"connection"}, False, origin)
    control_connection = ctl.get("connection", "tidemark_control")
    if not isinstance(control_connection, str) or not control_connection:
        raise ConfigError("control.connection", "must be a connection id (string)", source=origin)
    landing = _landing(doc, origin)
    lake = _section(doc, "lake", {"path", "retention", "maintain"}, True, origin)
    retention = parse_duration(lake.get("retention", "7 days"), "lake.retention", origin)
    maintain_cron = _cron(lake.get("maintain", "30 3 * * *"), "lake.maintain", origin)
    lake_path = _expand(lake.get("path"), "lake.path", origin)
    if lake_path is None or lake_path == "":
        raise ConfigError("lake.path", "is required (an absolute path, file:///path or s3://bucket/prefix)",
                          source=origin)
    # a relative path would be a different lake in every working directory (the CLI's, each Airflow task's,
    # Spark's executors'); the lake is read and written locally or on S3 only (`tidemark.lake.delta.filesystem`)
    if not isinstance(lake_path, str) or not re.match(r"^(file:///|s3://|/)", lake_path):
        raise ConfigError("lake.path", f"{lake_path!r} must be an absolute path, file:///path or s3://bucket/prefix",
                          source=origin)
    if "%" in lake_path and not lake_path.startswith("s3://"):
        raise ConfigError("lake.path", f"{lake_path!r}: a '%' in a local lake path is not supported "
                                       "(Delta Lake reads it as a percent-escape)", source=origin)

    dr = _section(doc, "drain", DrainConfig, False, origin)
    ack = dr.get("ack_policy", "frontier")
    if ack not in ACK_POLICIES:
        raise ConfigError("drain.ack_policy", f"{ack!r} is not one of {', '.join(ACK_POLICIES)}", source=origin)
    drain = DrainConfig(ack_policy=ack, **_numbers(DrainConfig, dr, "drain", origin, {"max_bytes": 1024},
                                                   first=("idle_timeout_seconds",)))
    sn = _section(doc, "snapshot", SnapshotConfig, False, origin)
    snapshot = SnapshotConfig(**_numbers(SnapshotConfig, sn, "snapshot", origin))
    co = _section(doc, "consolidate", ConsolidateConfig, False, origin)
    numbers = _numbers(ConsolidateConfig, co, "consolidate", origin,
                       {"max_batch_bytes": 1024, "check_every_minutes": 0, "follow_seconds": 0},
                       first=("check_every_minutes",))
    if numbers["check_every_minutes"] > 59:
        raise ConfigError("consolidate.check_every_minutes", f"must be at most 59 (a cron minute step), got "
                                                             f"{numbers['check_every_minutes']}", source=origin)
    consolidate = ConsolidateConfig(**numbers, spark_conf=_spark_conf(co.get("spark_conf"), origin))
    history = _history(doc.get("history"), source.tables, origin)
    return StreamConfig(stream=stream, source=source, control_connection=control_connection, landing=landing,
                        lake_path=lake_path, drain=drain, snapshot=snapshot, consolidate=consolidate, origin=origin,
                        history=history, history_all=doc.get("history") == "all", lake_retention_seconds=retention,
                        lake_maintain_cron=maintain_cron)


_CRON_FIELD = re.compile(r"^[0-9A-Za-z*/,?#LW-]+$")


def _cron(value: Any, key: str, origin: str | None) -> str:
    """A five-field cron expression (minute hour day month weekday, UTC), as Airflow's cron timetables
    read it; checked with ``croniter`` where it is installed (with Airflow), by its shape otherwise."""
    fields = value.split() if isinstance(value, str) else []
    ok = len(fields) == 5 and all(_CRON_FIELD.match(f) for f in fields)
    if ok:
        try:
            from croniter import croniter   # comes with Airflow; the library runs without it
        except ImportError:
            croniter = None
        ok = croniter is None or croniter.is_valid(value)
    if not ok:
        raise ConfigError(key, f"{value!r} is not a cron expression of five fields such as '30 3 * * *' "
                               "(minute hour day-of-month month day-of-week, UTC)", source=origin)
    return " ".join(fields)


def _source(doc: dict, stream: str, origin: str | None) -> SourceConfig:
    """The ``source`` section: a PostgreSQL database's tables (publication and slot named after the
    stream unless given), or an external feed's (``kind: feed``: no connection, publication or slot)."""
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
    return SourceConfig(connection=src["connection"],
                        publication=_name(src.get("publication", f"tidemark_{stream}"), "source.publication", origin),
                        slot=_name(src.get("slot", f"tidemark_{stream}"), "source.slot", origin),
                        tables=tuple(tables), kind=kind, filters=tuple(filters))


def _landing(doc: dict, origin: str | None) -> LandingConfig:
    land = _section(doc, "landing", LandingConfig, True, origin)
    url = _expand(land.get("url"), "landing.url", origin)
    if not isinstance(url, str) or not re.match(r"^(file://|s3://|/)", url):
        raise ConfigError("landing.url", f"{url!r} must be an absolute path, file:///path or s3://bucket/prefix",
                          source=origin)
    if url.startswith("s3://") and not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$", url):
        raise ConfigError("landing.url", f"{url!r} has an invalid S3 bucket name", source=origin)
    codec = land.get("codec", "zstandard")
    if codec not in LANDING_CODECS:
        raise ConfigError("landing.codec", f"{codec!r} is not one of {', '.join(LANDING_CODECS)}", source=origin)
    endpoint = _expand(land.get("endpoint_url"), "landing.endpoint_url", origin)
    if endpoint not in (None, "") and (not isinstance(endpoint, str) or not re.match(r"^https?://\S+$", endpoint)):
        raise ConfigError("landing.endpoint_url", f"{endpoint!r} must be an http:// or https:// URL", source=origin)
    region = _expand(land.get("region"), "landing.region", origin)
    if region is not None and not isinstance(region, str):
        raise ConfigError("landing.region", f"must be a region name (a string), got {region!r}", source=origin)
    return LandingConfig(url=url, endpoint_url=endpoint, region=region, codec=codec)


def _table_entry(value: Any, key: str, kind: str, origin: str | None) -> tuple[TableRef, TableFilter]:
    """One ``source.tables`` entry: ``schema.table``, or ``{name, columns, where}`` (`TableFilter`)."""
    if isinstance(value, str):
        return TableRef.parse(value, key=key, origin=origin), NO_FILTER
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a string 'schema.table' or a mapping {{name, columns, where}}, got {value!r}",
                          source=origin)
    _known_keys(value, {"name", "columns", "where"}, f"{key}.", origin)
    if not isinstance(value.get("name"), str):
        raise ConfigError(f"{key}.name", f"must be a string 'schema.table', got {value.get('name')!r}", source=origin)
    ref = TableRef.parse(value["name"], key=f"{key}.name", origin=origin)
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
        if not isinstance(t, str):
            raise ConfigError(f"history[{i}]", f"must be a string 'schema.table', got {t!r}", source=origin)
        ref = TableRef.parse(t, key=f"history[{i}]", origin=origin)
        if ref not in tables:
            raise ConfigError(f"history[{i}]", f"{ref} is not one of source.tables", source=origin)
        if ref in out:
            raise ConfigError(f"history[{i}]", f"{ref} is listed twice", source=origin)
        out.append(ref)
    return tuple(out)


class _KeyTwice(Exception):
    """A key given twice in one YAML mapping: (the key's line, what to say)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that holds a key twice: plain YAML keeps the last one
    silently, so a section written twice (two ``lake:``, a repeated ``slot:``) lost the first."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":     # ``<<: *anchor``: YAML's way to override keys
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _KeyTwice(f"(line {line})", f"key {key!r} is given twice (also on line {seen[key]}); YAML "
                                                  "would keep only the last one: keep one of them")
            seen.setdefault(key, line)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path) -> StreamConfig:
    """Read and validate one stream file (a key given twice in one mapping is an error)."""
    path = Path(path)
    try:
        doc = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)   # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError("(file)", "does not exist", source=str(path)) from None
    except _KeyTwice as exc:
        raise ConfigError(*exc.args, source=str(path)) from None
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
