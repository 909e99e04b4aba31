"""Consolidation: landed segments → Delta Lake tables equal to the source, plus a changelog.

Public face: `consolidate_stream(cfg, spark=None) -> ConsolidateResult`. The pieces are importable
on their own, in the order the data flows: `plan` (coverage, slices, completeness, frontier),
`decode` (executor-side segment decoding), `batch` (one Spark job per slice: each table prepared,
grouped by bucket, merged, committed), `merge` (the executors' merge of one group: every change
shape, the exact changelog, the new files), `layout` (bucketed files), `changelog` (the changelog's Delta table and Materialize CDC files), `interval`
(rebuild the changelog of a data interval from retained segments and Delta history with the same
merge, so it lives here rather than in `tidemark.lake`, which this package writes and must not
depend on). Every commit goes through the one lake writer, `tidemark.lake.writer`.

Imports `tidemark.landing` (segments), `tidemark.lake`, `tidemark.control`, `tidemark.pgtypes`,
`tidemark.config` and `tidemark.errors`; never `tidemark.capture` except the slot advance and the
source connection after a commit (`tidemark.capture.source`).
"""

from tidemark.consolidate.job import ConsolidateError, ConsolidateResult, consolidate_stream
from tidemark.sparkconf import spark_session   # the Spark settings' module (`tidemark.sparkconf`)

__all__ = ["ConsolidateError", "ConsolidateResult", "consolidate_stream", "spark_session"]
