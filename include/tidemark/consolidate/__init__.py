"""Consolidation: landed segments → Delta Lake tables equal to the source, plus a changelog.

Public face: `consolidate_stream(cfg, spark=None) -> ConsolidateResult`. The pieces are importable
on their own: `plan` (coverage, completeness, frontier), `decode` (executor-side segment decoding),
`transform` (pure DataFrame transforms), `layout` (bucketed files, per-bucket rewrite), `commit`
(Delta transactions), `changelog` (Materialize CDC files).
"""

from tidemark.consolidate.job import ConsolidateError, ConsolidateResult, consolidate_stream, spark_session

__all__ = ["ConsolidateError", "ConsolidateResult", "consolidate_stream", "spark_session"]
