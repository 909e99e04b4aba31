"""The lake: one Delta Lake table per captured table, plus its consolidated changelog table.

Layout under the stream's ``lake.path``::

    {lake}/{stream}/tables/{schema}.{table}/      current state (Delta), partitioned by ``_bucket``
    {lake}/{stream}/changelog/{schema}.{table}/   consolidated changes (Delta), partitioned by ``_commit_date``

``_bucket`` (``pmod(xxhash64(key columns), buckets)``, or of all columns for tables without a
primary key) is a partition column, so data files hold exactly the source columns; the bucket count
is kept in the table's description, so a later configuration change cannot scatter existing keys.

Every Tidemark commit carries a Delta application transaction ``(stream, frontier)``:
`committed_frontier` reads it back and consolidation skips what a table already holds.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from tidemark.config import StreamConfig, TableRef
from tidemark.errors import TidemarkError
from tidemark.pgtypes import arrow_schema, lake_array, TableSchema, text_parser

BUCKET_COLUMN = "_bucket"

_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


class LakeError(TidemarkError):
    """A lake table is missing or not what Tidemark expects; names the table."""


def dir_name(table: str) -> str:
    """A directory name for ``schema.table`` (unsafe characters replaced, plus a short hash if any were)."""
    safe = _SAFE.sub("_", table)
    if safe != table:
        safe += "-" + hashlib.sha1(table.encode()).hexdigest()[:8]
    return safe


def resolved_name(table: str | TableRef) -> str:
    """The one spelling of a table name every entry point resolves to: `TableRef.parse` as the stream
    file is read (``public`` when no schema; unquoted parts folded to lower case), then `TableRef.qualified`."""
    return (table if isinstance(table, TableRef) else TableRef.parse(table)).qualified


def lake_root(cfg: StreamConfig) -> str:
    """The stream's lake directory (a local path or an ``s3://`` URI)."""
    return cfg.lake_path.removeprefix("file://").rstrip("/") + "/" + cfg.stream


def table_uri(cfg: StreamConfig, table: str | TableRef) -> str:
    """Where the current state of ``table`` lives."""
    return f"{lake_root(cfg)}/tables/{dir_name(resolved_name(table))}"


def changelog_uri(cfg: StreamConfig, table: str | TableRef) -> str:
    """Where the consolidated changelog (Delta) of ``table`` lives."""
    return f"{lake_root(cfg)}/changelog/{dir_name(resolved_name(table))}"


def history_uri(cfg: StreamConfig, table: str | TableRef) -> str:
    """Where the SCD type 2 history table of ``table`` lives (`tidemark.consolidate.history`)."""
    return f"{lake_root(cfg)}/history/{dir_name(resolved_name(table))}"


def storage_options(cfg: StreamConfig) -> dict[str, str] | None:
    """deltalake storage options for an S3 lake (endpoint/region from the landing settings)."""
    if not cfg.lake_path.startswith("s3://"):
        return None
    opts: dict[str, str] = {}
    if cfg.landing.endpoint_url:
        opts["AWS_ENDPOINT_URL"] = cfg.landing.endpoint_url
        if cfg.landing.endpoint_url.startswith("http://"):     # plain HTTP only when the endpoint says so
            opts["AWS_ALLOW_HTTP"] = "true"
    if cfg.landing.region:
        opts["AWS_REGION"] = cfg.landing.region
    return opts or None


def open_delta(uri: str, options: dict[str, str] | None = None):
    """The Delta table at ``uri``, or None if there is none yet."""
    from deltalake import DeltaTable

    try:
        return DeltaTable(uri, storage_options=options)
    except Exception as exc:  # deltalake raises TableNotFoundError (a DeltaError) for a missing table
        if type(exc).__name__ in ("TableNotFoundError",) or "no files in log segment" in str(exc).lower() \
                or "not a delta table" in str(exc).lower():
            return None
        if uri.startswith("s3://") or (Path(uri) / "_delta_log").exists():
            raise
        return None


# Delta (delta-rs) refuses a table description over 4,000 characters (a wide table's shape is longer):
# above this size the shape goes to a file of its own beside the table (`SHAPE_DIR`, which Delta readers
# and VACUUM leave alone), named by its content.
DESCRIPTION_LIMIT = 3500
SHAPE_DIR = "_tidemark"
_SHAPES: dict[tuple[str, str], dict] = {}
FILE_ATTNUMS = "_attnums"     # a shape file's member holding the columns' attnums (`table_description`)


def table_description(uri: str, options: dict | None, stream: str, table: str, buckets: int, shape_json: dict,
                      missing: dict | None = None, attnums: dict | None = None) -> str:
    """The Delta description Tidemark keeps on a lake table (`table_info` reads it): the stream, the
    table, its buckets, its shape, ``missing_values`` (columns added with a DEFAULT: the text of
    the value rows that lack them hold) and ``attnums`` (each column's attnum in the source, where
    known: how a RENAME COLUMN is told from a DROP and an ADD); a shape too long for a description
    goes to ``{uri}/_tidemark/shape-<digest>.json`` (written here, once: same shape, same file)."""
    extra = {"missing_values": missing} if missing else {}
    nums = {"attnums": attnums} if attnums else {}
    head = {"stream": stream, "table": table, "buckets": buckets, **extra}
    desc = json.dumps({**head, "table_schema": shape_json, **nums}, sort_keys=True)
    if len(desc) <= DESCRIPTION_LIMIT:
        return desc
    # the shape's file holds the attnums too (as wide as the shape), under a key no shape has
    text = json.dumps({**shape_json, **({FILE_ATTNUMS: attnums} if attnums else {})}, sort_keys=True)
    name = f"shape-{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
    fs = filesystem(uri, options)
    folder = strip_scheme(uri).rstrip("/") + "/" + SHAPE_DIR
    path = f"{folder}/{name}"
    from pyarrow import fs as pafs

    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        fs.create_dir(folder, recursive=True)
        with fs.open_output_stream(path) as out:
            out.write(text.encode())
    return json.dumps({**head, "table_schema_file": name}, sort_keys=True)


def table_info(dt) -> dict[str, Any]:
    """Tidemark's properties of a lake table (kept in the Delta description): buckets, key, shape
    (``table_schema``, also when it is kept in a file of its own: `table_description`)."""
    desc = dt.metadata().description
    try:
        info = json.loads(desc) if desc else {}
    except ValueError:
        return {}
    name = info.get("table_schema_file")
    if name and "table_schema" not in info:
        key = (dt.table_uri, name)
        if key not in _SHAPES:      # named by its content: never changes once written
            path = strip_scheme(dt.table_uri).rstrip("/") + f"/{SHAPE_DIR}/{name}"
            try:
                with filesystem(dt.table_uri, getattr(dt, "_storage_options", None)).open_input_stream(path) as f:
                    _SHAPES[key] = json.loads(f.read().decode())
            except (OSError, ValueError) as exc:
                raise LakeError(f"lake table {dt.table_uri}: its shape file {SHAPE_DIR}/{name} cannot be read "
                                f"({exc})") from exc
        shape = dict(_SHAPES[key])
        if FILE_ATTNUMS in shape:
            info["attnums"] = shape.pop(FILE_ATTNUMS)
        info["table_schema"] = shape
    return info


def renames_since(then: dict, now: dict) -> dict[str, str]:
    """{old name: new name} of the columns a lake table held under another name at an earlier version
    than now (``then``, ``now``: their `table_info`), by the columns' source attnums (RENAME COLUMN)."""
    by_num = {num: name for name, num in (now.get("attnums") or {}).items()}
    return {name: by_num[num] for name, num in (then.get("attnums") or {}).items()
            if by_num.get(num) not in (None, name)}


def missing_values(info: dict, columns: list[str] | None = None) -> dict:
    """{column: pyarrow scalar} a row lacking the column holds, from a table's `table_info`: the
    columns added with a DEFAULT (``missing_values``: PostgreSQL's ``attmissingval`` as text),
    parsed to their lake types. A file written before such a column existed reads it this way."""
    missing = info.get("missing_values") or {}
    if not missing or not info.get("table_schema"):
        return {}
    cols = {c.name: c for c in TableSchema.from_json(info["table_schema"]).columns}
    return {name: lake_array(cols[name], [text_parser(cols[name])(text)])[0] for name, text in missing.items()
            if name in cols and text is not None and (columns is None or name in columns)}


def conform(table, schema, fill: dict | None = None):
    """``table`` with exactly ``schema``'s columns, by name, cast to their types there; a missing
    column is null, or holds ``fill``'s value for it (a column added with a DEFAULT: `missing_values`)."""
    import pyarrow as pa

    arrays = []
    for f in schema:
        if f.name in table.column_names:
            c = table.column(f.name)
            arrays.append(c if c.type == f.type else c.cast(f.type))
        elif fill and f.name in fill:
            arrays.append(pa.repeat(fill[f.name], table.num_rows))
        else:
            arrays.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def committed_frontier(dt, stream: str) -> int | None:
    """The frontier of the last Tidemark commit of ``stream`` to this table (Delta app transaction)."""
    return None if dt is None else dt.transaction_version(stream)


def lake_schema(dt):
    """The Arrow schema of the source columns (the partition column ``_bucket`` removed)."""
    import pyarrow as pa

    return pa.schema([f for f in pa.schema(dt.schema().to_arrow()) if f.name != BUCKET_COLUMN])


def open_lake_table(cfg: StreamConfig, table: str | TableRef):
    """``(uri, storage options, Delta table)`` of ``table`` in the stream's lake; a LakeError when it is
    no Delta table (nothing consolidated into it yet)."""
    uri, opts = table_uri(cfg, table), storage_options(cfg)
    dt = open_delta(uri, opts)
    if dt is None:
        raise LakeError(f"{uri} is not a Delta table (nothing consolidated yet?)")
    return uri, opts, dt


def read_dt(dt, uri: str, options):
    """All rows of the Delta table ``dt`` (at ``uri``) as one Arrow table with its source columns, in
    the lake types of the table's recorded shape (`pgtypes.arrow_schema`)."""
    import pyarrow.dataset as ds

    schema = exact_schema(dt)
    files = data_files(dt, uri)
    if not files:
        return schema.empty_table()
    dataset = ds.dataset(files, format="parquet", schema=schema, filesystem=filesystem(uri, options))
    return dataset.to_table(columns=schema.names).combine_chunks()


def exact_schema(dt):
    """The Arrow schema of the table's source columns: from its recorded shape when there is one."""
    shape = table_info(dt).get("table_schema")
    if shape:
        return arrow_schema(TableSchema.from_json(shape))
    return lake_schema(dt)


def data_files(dt, uri: str) -> list[str]:
    """The current version's data files as filesystem paths (deltalake percent-encodes local ones:
    a lake path with a space would not be found)."""
    from urllib.parse import unquote

    files = [strip_scheme(u) for u in dt.file_uris()]
    return files if uri.startswith("s3://") else [unquote(f) for f in files]


def strip_scheme(uri: str) -> str:
    return re.sub(r"^(?:file|s3)://", "", uri)


def filesystem(uri: str, options: dict[str, str] | None = None):
    """A pyarrow filesystem for a lake URI (local or S3)."""
    import pyarrow.fs as pafs

    if uri.startswith("s3://"):
        opts = options or {}
        return pafs.S3FileSystem(endpoint_override=opts.get("AWS_ENDPOINT_URL"), region=opts.get("AWS_REGION"),
                                 scheme="http" if opts.get("AWS_ALLOW_HTTP") else "https")
    return pafs.LocalFileSystem()


def log_files(uri: str, options, version: int) -> list[tuple[str, str, int]]:
    """("add" | "remove", path, size) of each data-file action of one Delta version, from its log
    entry (``_delta_log/NNN.json``); a remove without a size counts 0."""
    fs = filesystem(uri, options)
    path = f"{strip_scheme(uri).rstrip('/')}/_delta_log/{version:020d}.json"
    with fs.open_input_stream(path) as fh:
        text = fh.read().decode()
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        action: dict[str, Any] = json.loads(line)
        for kind in ("add", "remove"):
            if kind in action:
                out.append((kind, action[kind]["path"], int(action[kind].get("size") or 0)))
    return out


def frontier_of(dt, *, stream: str, version: int) -> int | None:
    """The Tidemark frontier recorded at or before ``version`` (carried forward over versions without)."""
    return next((int(m["frontier"]) for v, m in reversed(tidemark_commits(dt, stream)) if v <= version), None)


def tidemark_meta(h: dict, stream: str) -> dict | None:
    """The ``tidemark`` commit info ``{stream, frontier, …}`` of one history entry, if it is ``stream``'s."""
    m = h.get("tidemark")
    if isinstance(m, str):
        try:
            m = json.loads(m)
        except ValueError:
            m = None
    return m if isinstance(m, dict) and m.get("stream") == stream else None


def tidemark_commits(dt, stream: str) -> list[tuple[int, dict]]:
    """(version, `tidemark_meta`) of each of ``stream``'s commits to the table, oldest first."""
    return [(h["version"], m) for h in sorted(dt.history(), key=lambda h: h["version"])
            if (m := tidemark_meta(h, stream)) is not None]


def version_at(dt, stream: str, frontier: int) -> int | None:
    """The newest version of the table whose content is the table's content at ``frontier``: the last
    version whose recorded Tidemark frontier (carried forward over commits that record none) is at
    most ``frontier``, skipping a schema or description change made just before a commit past it."""
    history = sorted(dt.history(), key=lambda h: h["version"])
    running, best = None, None
    for i, h in enumerate(history):
        m = tidemark_meta(h, stream)
        if m is not None:
            running = int(m["frontier"])
        if running is None or running > frontier:
            continue
        nxt = tidemark_meta(history[i + 1], stream) if i + 1 < len(history) else None
        if m is None and nxt is not None and int(nxt["frontier"]) > frontier:
            continue     # a schema/description change that belongs to the next (later) commit
        best = h["version"]
    return best
