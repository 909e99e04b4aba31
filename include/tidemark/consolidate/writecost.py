"""Write cost of a batch: per lake table, the bytes the batch rewrote (its Delta versions' add and
remove actions, its changelog's adds) against the bytes its changes hold (the decoded ``data``
parts); write amplification is rewritten (added) ÷ changed. Definitions: docs/internals/batch.md.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from tidemark.lake import changelog_uri, open_delta, storage_options, table_uri
from tidemark.lake.delta import log_files, tidemark_meta

log = logging.getLogger(__name__)

HISTORY_LIMIT = 64           # newest Delta versions looked at: a batch commits a few per table


def record_batch(ctl, cfg, decoded, start: int | None, frontier: int, tables: list[str],
                 frontiers: dict[str, int] | None = None) -> list[dict]:
    """Record the write cost of the batch that brought ``tables`` from ``start`` to ``frontier`` (an
    external feed's tables: each to its own, ``frontiers``) in the control database, after the
    tables' commits and before the frontier moves; return the rows (none when it failed: logged, never
    raised)."""
    try:
        rows = batch_costs(cfg, list(decoded.shapes), start, frontier, tables,
                           frontiers=frontiers, recorded=ctl.write_cost_versions(cfg.stream))
        ctl.record_write_costs(cfg.stream, rows)
        return rows
    except Exception as exc:  # noqa: BLE001 - a measurement must not fail the batch it measures
        log.warning("stream %s: the batch's write cost was not recorded: %s", cfg.stream, exc)
        return []


def batch_costs(cfg, shapes: list[dict], start: int | None, frontier: int, tables: list[str], *,
                frontiers: dict[str, int] | None = None,
                recorded: dict[str, tuple[int, int]] | None = None) -> list[dict]:
    """The rows `record_batch` records (docs/internals/batch.md); ``recorded``: {table: (frontier, last
    Delta version) of its newest recorded batch} (`Control.write_cost_versions`)."""
    import pyarrow as pa

    opts = storage_options(cfg)
    out = []
    for table in tables:
        upto = (frontiers or {}).get(table, frontier)
        uri = table_uri(cfg, table)
        dt = open_delta(uri, opts)
        if dt is None:
            continue
        versions = batch_versions(dt, cfg.stream, start, upto)
        last = (recorded or {}).get(table)
        if last is not None and last[1] <= dt.version():       # (a table made again starts at version 0)
            versions = [(v, op) for v, op in versions if v > last[1]]
        if not versions:
            continue
        acts = [(kind, size) for v, _ in versions for kind, _, size in log_files(uri, opts, v)]
        added = [size for kind, size in acts if kind == "add"]
        removed = [size for kind, size in acts if kind != "add"]
        log_dt = open_delta(changelog_uri(cfg, table), opts)
        changelog_bytes = None
        if log_dt is not None:
            changelog_bytes = sum(size for v, _ in batch_versions(log_dt, cfg.stream, start, upto)
                                  for kind, _, size in log_files(changelog_uri(cfg, table), opts, v) if kind == "add")
        parts = [r for r in shapes if r.get("table") == table and r.get("time") is not None
                 and r["time"] < upto and (start is None or r["time"] >= start)]
        live = pa.table(dt.get_add_actions(flatten=True)).column("size_bytes").to_pylist()
        out.append({"table_name": table, "frontier": upto, "frontier_before": start,
                    "version_from": versions[0][0], "version_to": versions[-1][0],
                    "added_files": len(added), "added_bytes": sum(added),
                    "removed_files": len(removed), "removed_bytes": sum(removed),
                    "change_records": sum(int(r.get("position") or 0) for r in parts),
                    "change_bytes": sum(int(r.get("size") or 0) for r in parts),
                    "changelog_bytes": changelog_bytes, "live_bytes": sum(int(s or 0) for s in live),
                    "snapshot_load": any(op == "snapshot" for _, op in versions)})
    return out


def batch_versions(dt, stream: str, start: int | None, frontier: int) -> list[tuple[int, str | None]]:
    """(version, operation) of the table's versions, oldest first, that ``stream`` committed with a
    Tidemark frontier in ``(start, frontier]``, compactions left out (they change no row)."""
    out = []
    for h in dt.history(HISTORY_LIMIT):
        m = tidemark_meta(h, stream)
        if m is None or m.get("frontier") is None or m.get("operation") == "compact":
            continue
        f = int(m["frontier"])
        if f <= frontier and (start is None or f > start):
            out.append((int(h["version"]), m.get("operation")))
    return sorted(out)


def amplification(row: dict) -> float | None:
    """Bytes rewritten (added) per byte changed of one recorded batch; None when nothing changed
    (a snapshot load alone, an event)."""
    return row["added_bytes"] / row["change_bytes"] if row.get("change_bytes") else None


def summary(rows: list[dict]) -> dict[str, Any]:
    """One table's recorded batches (oldest first) in brief: the latest and the median write
    amplification (batches that loaded a snapshot left out: they write the whole table by design),
    the latest batch's bytes rewritten and changed, and how many batches."""
    plain = [r for r in rows if not r.get("snapshot_load") and amplification(r) is not None]
    latest = rows[-1] if rows else None
    return {"batches": len(rows),
            "latest": amplification(plain[-1]) if plain else None,
            "median": statistics.median(amplification(r) for r in plain) if plain else None,
            "latest_added_bytes": latest["added_bytes"] if latest else None,
            "latest_removed_bytes": latest["removed_bytes"] if latest else None,
            "latest_change_bytes": latest["change_bytes"] if latest else None,
            "live_bytes": latest.get("live_bytes") if latest else None}
