"""Consolidation: landed segments → Delta Lake tables equal to the source, plus a changelog.

Public face: `consolidate_stream(cfg, spark=None) -> ConsolidateResult`. A batch passes its stages
in order, each a module returning a frozen result (`job`'s doc): `plan` (`BatchPlan`: coverage,
slices, completeness, frontier), `decoded` (`Decoded`: the segments decoded by `decode` in the
executors), `prepare` (`TablePrep`: snapshots loaded, shapes evolved, by `columns`), `batch`
(`MergeOutcome`: one Spark job merging every table, `merge` in the executors), `committed`
(`CommitResult`: `changelog`, `history`, each commit through the one lake writer
`tidemark.lake.writer`), then `job.advance`; `failure` tells where a run failed. `interval` rebuilds
the changelog of a data interval from retained segments and Delta history through the same stages,
so it lives here rather than in `tidemark.lake`, which this package writes and must not depend on.

Imports `tidemark.landing` (segments), `tidemark.lake`, `tidemark.control`, `tidemark.pgtypes`,
`tidemark.config` and `tidemark.errors`; never `tidemark.capture` except the slot advance and the
source connection after a commit (`tidemark.capture.source`).
"""

from tidemark.consolidate.job import ConsolidateError, ConsolidateResult, consolidate_stream, follow_stream
from tidemark.sparkconf import spark_session   # the Spark settings' module (`tidemark.sparkconf`)

__all__ = ["ConsolidateError", "ConsolidateResult", "consolidate_stream", "follow_stream", "spark_session"]
