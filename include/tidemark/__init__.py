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

import importlib
from typing import Any

__all__ = ["load_config", "snapshot", "drain", "consolidate", "gaps", "read"]

# each public name: (the module that defines it, its name there), imported on first use
_PUBLIC = {"load_config": ("tidemark.config", "load_config"),
           "snapshot": ("tidemark.capture.snapshot", "snapshot_stream"),
           "drain": ("tidemark.capture.drain", "drain_stream"),
           "read": ("tidemark.lake", "read_table")}


def __getattr__(name: str) -> Any:
    if name in ("gaps", "consolidate"):      # packages; `tidemark.consolidate(cfg)` calls consolidate_stream
        return importlib.import_module(f"tidemark.{name}")
    if name in _PUBLIC:
        module, attr = _PUBLIC[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'tidemark' has no attribute {name!r}")
