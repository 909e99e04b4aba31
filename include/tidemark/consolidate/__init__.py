"""Consolidation: landed segments → Delta Lake tables equal to the source, plus a changelog.

Public face: `consolidate_stream(cfg, spark=None) -> ConsolidateResult`. The pieces are importable
on their own: `plan` (coverage, completeness, frontier), `decode` (executor-side segment decoding),
`transform` (pure DataFrame transforms), `layout` (bucketed files, per-bucket rewrite), `commit`
(Delta transactions), `changelog` (Materialize CDC files), `interval` (rebuild the changelog of a data
interval from retained segments and Delta history: it re-runs this package's exact-log machinery, so it
lives here rather than in `tidemark.lake`, which this package writes and must not depend on it).

Imports `tidemark.landing` (segments), `tidemark.lake`, `tidemark.control`, `tidemark.pgtypes`,
`tidemark.config` and `tidemark.errors`; never `tidemark.capture` except the slot advance and the
source connection after a commit (`tidemark.capture.source`).
"""

from tidemark.consolidate.job import ConsolidateError, ConsolidateResult, consolidate_stream
from tidemark.sparkconf import spark_session   # the Spark settings' module (`tidemark.sparkconf`)

__all__ = ["ConsolidateError", "ConsolidateResult", "consolidate_stream", "spark_session"]
