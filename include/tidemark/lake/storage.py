"""What a stream's lake and landing store take: `stream_storage` (``tidemark status``, the status page).

Each Delta table's live files come from its log (one table load each), what is on disk from one walk
of the stream's lake directory and one of its landing area. Per table (current state, changelog,
history):

* ``live_bytes`` / ``live_files`` — the data files the current version references;
* ``disk_bytes`` / ``disk_files`` — every file under the table's directory, the Delta log included:
  files replaced by later versions that a vacuum has not deleted yet (`tidemark.maintain` keeps those
  a version inside the retention window references), a failed attempt's files, checkpoints;
* ``log_bytes`` / ``log_files`` — the ``_delta_log`` directory's share of ``disk_bytes``.

The landing store: segment files, the changelog feed's files, snapshot files, and the rest (the
consolidation's work area). ``oldest_readable`` is the retention window's start as a position (the
highest table horizon, `lake.retention.table_window`; None while every version is inside the window).
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

from tidemark.config import StreamConfig
from tidemark.lake import retention
from tidemark.lake.delta import (changelog_uri, filesystem, history_uri, lake_root, open_delta, resolved_name,
                                 storage_options, strip_scheme, table_uri)
from tidemark.landing.store import LocalStore, S3Store, landing_store, stream_keys


def _empty() -> dict[str, int]:
    return {"live_bytes": 0, "live_files": 0, "disk_bytes": 0, "disk_files": 0, "log_bytes": 0, "log_files": 0}


def stream_storage(cfg: StreamConfig, *, now_ms: int | None = None) -> dict[str, Any]:
    """The stream's storage figures (see the module doc): ``tables`` ({table: {kind: figures}}),
    ``lake`` (the sums, and ``unlisted_bytes``: files of the lake directory under no table of the
    stream file), ``landing``, ``oldest_readable``, ``retention`` and ``seconds`` (what it took)."""
    import pyarrow as pa

    t0 = time.monotonic()
    opts = storage_options(cfg)
    root = lake_root(cfg)
    tables: dict[str, dict[str, dict[str, int]]] = {}
    owner: dict[tuple[str, str], tuple[str, str]] = {}     # ("tables", dir name) -> (table, kind)
    horizons: list[int] = []
    start = retention.window_start_ms(cfg, now_ms)     # looked up at each call: tests replace it
    for ref in cfg.source.tables:
        name = resolved_name(ref)
        tables[name] = {}
        for kind, where in (("table", table_uri), ("changelog", changelog_uri), ("history", history_uri)):
            uri = where(cfg, ref)
            owner[tuple(uri[len(root) + 1:].split("/", 1))] = (name, kind)
            dt = open_delta(uri, opts)
            if dt is None:
                continue
            fig = tables[name][kind] = _empty()
            sizes = pa.table(dt.get_add_actions(flatten=True)).column("size_bytes").to_pylist()
            fig["live_files"], fig["live_bytes"] = len(sizes), sum(int(s or 0) for s in sizes)
            if kind == "table":
                _, horizon, _ = retention.table_window(dt, cfg.stream, start)
                if horizon is not None:
                    horizons.append(horizon)
    unlisted = 0
    for rel, size in walk_sizes(root, opts):
        parts = rel.split("/")
        fig = None
        if len(parts) >= 3 and (parts[0], parts[1]) in owner:
            table, kind = owner[(parts[0], parts[1])]
            fig = tables[table].setdefault(kind, _empty())
        if fig is None:
            unlisted += size
            continue
        fig["disk_files"] += 1
        fig["disk_bytes"] += size
        if parts[2] == "_delta_log":
            fig["log_files"] += 1
            fig["log_bytes"] += size
    lake = _empty()
    for kinds in tables.values():
        for fig in kinds.values():
            for k in lake:
                lake[k] += fig[k]
    return {"tables": tables, "lake": {**lake, "unlisted_bytes": unlisted}, "landing": landing_bytes(cfg),
            "oldest_readable": max(horizons) if horizons else None, "retention": retention.window_text(cfg),
            "seconds": round(time.monotonic() - t0, 3)}


def landing_bytes(cfg: StreamConfig) -> dict[str, int]:
    """The stream's landing area by part: ``segment_bytes``/``segment_files``, ``feed_bytes``/``feed_files``
    (the changelog feed), ``snapshot_bytes``/``snapshot_files``, ``other_bytes`` (the work area, probes)
    and ``bytes``, their sum (one listing of the stream's prefix)."""
    store = landing_store(cfg)
    keys = stream_keys(cfg.stream)
    out = {"segment_bytes": 0, "segment_files": 0, "feed_bytes": 0, "feed_files": 0, "snapshot_bytes": 0,
           "snapshot_files": 0, "other_bytes": 0, "bytes": 0}
    prefix = f"{cfg.stream}/"
    if isinstance(store, LocalStore):
        listing = ((os.path.relpath(p, store.root).replace(os.sep, "/"), s)
                   for p, s in _local_sizes(str(store.local_path(prefix))))
    elif isinstance(store, S3Store):
        listing = ((k[len(store.prefix) + 1:] if store.prefix else k, s)
                   for k, s in _s3_sizes(store.client, store.bucket,
                                         f"{store.prefix}/{prefix}" if store.prefix else prefix))
    else:
        return out
    parts = (("segment", keys["segments"]), ("feed", keys["changelog"]), ("snapshot", keys["snapshots"]))
    for key, size in listing:
        out["bytes"] += size
        part = next((p for p, k in parts if key.startswith(k)), None)
        if part is None:
            out["other_bytes"] += size
        else:
            out[f"{part}_bytes"] += size
            out[f"{part}_files"] += 1
    return out


def walk_sizes(uri: str, options: dict | None = None) -> Iterator[tuple[str, int]]:
    """(path relative to ``uri``, '/'-separated; size) of every file under a local directory or an
    ``s3://`` prefix: one recursive listing through the lake's filesystem (S3: ``list_objects_v2``)."""
    from pyarrow.fs import FileSelector, FileType

    base = strip_scheme(uri).rstrip("/")
    for info in filesystem(uri, options).get_file_info(FileSelector(base, recursive=True, allow_not_found=True)):
        if info.type == FileType.File:
            yield info.path[len(base) + 1:], int(info.size)


def _local_sizes(base: str) -> Iterator[tuple[str, int]]:
    for dirpath, _, files in os.walk(base):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                yield p, os.stat(p).st_size
            except FileNotFoundError:        # deleted meanwhile (a vacuum, a retention run)
                continue


def _s3_sizes(client, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            yield obj["Key"], int(obj["Size"])
