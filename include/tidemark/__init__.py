"""Tidemark: change data capture from PostgreSQL into Delta Lake, in micro-batches.

The packages follow the data: `tidemark.capture` (snapshot and slot drain) → `tidemark.landing`
(segments in the landing store) → `tidemark.consolidate` (Spark job) → `tidemark.lake` (Delta
tables and reads), with `tidemark.control` (the control database), `tidemark.gaps` (detect,
repair, resend, sweep) and `tidemark.pgtypes` beside them.

The public face, each callable without Airflow::

    cfg = tidemark.load_config("include/streams/demo.yaml")
    tidemark.snapshot(cfg)           # initial consistent snapshot (or a resend)
    tidemark.drain(cfg)              # land the slot's committed transactions, in bounded segments
    tidemark.consolidate(cfg)        # segments -> Delta tables + changelog, frontier advanced
    tidemark.gaps.detect(cfg)        # and gaps.repair / gaps.resend / gaps.sweep
    tidemark.read(cfg, "public.orders")  # a lake table as Arrow

Imports are lazy, so ``import tidemark`` stays cheap (DAG files import it at parse time).
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_config", "snapshot", "drain", "consolidate", "gaps", "read"]


def load_config(path):
    """Load and validate one stream's YAML file (`tidemark.config.load_config`)."""
    # deferred: this package's __init__ runs before every `tidemark.<module>` import; it imports none of them
    from tidemark.config import load_config as _load

    return _load(path)


def snapshot(cfg, **kwargs):
    """Snapshot the stream's tables at a new consistent point (`tidemark.capture.snapshot.snapshot_stream`)."""
    # deferred: this package's __init__ runs before every `tidemark.<module>` import; it imports none of them
    from tidemark.capture.snapshot import snapshot_stream

    return snapshot_stream(cfg, **kwargs)


def drain(cfg, **kwargs):
    """Drain the slot up to the server's position at the start, in bounded segments (`tidemark.capture.drain.drain_stream`)."""
    # deferred: this package's __init__ runs before every `tidemark.<module>` import; it imports none of them
    from tidemark.capture.drain import drain_stream

    return drain_stream(cfg, **kwargs)


def consolidate(cfg, **kwargs):
    """Consolidate landed segments into the lake (`tidemark.consolidate.consolidate_stream`)."""
    # deferred: this package's __init__ runs before every `tidemark.<module>` import; it imports none of them
    from tidemark.consolidate import consolidate_stream

    return consolidate_stream(cfg, **kwargs)


def read(cfg, table):
    """A lake table's current state as an Arrow table (`tidemark.lake.read_table`)."""
    # deferred: this package's __init__ runs before every `tidemark.<module>` import; it imports none of them
    from tidemark.lake import read_table

    return read_table(cfg, table)


def __getattr__(name: str) -> Any:
    if name == "gaps":
        import importlib

        return importlib.import_module("tidemark.gaps")
    raise AttributeError(f"module 'tidemark' has no attribute {name!r}")
