"""Consolidation: landed segments → Delta Lake tables equal to the source, plus a changelog.

Public face: `consolidate_stream(cfg, spark=None) -> ConsolidateResult` (`job`; its stages:
docs/internals/batch.md). `interval` rebuilds the changelog of a data interval through the same
stages, so it lives here rather than in `tidemark.lake`, which this package writes and must not
depend on. Of `tidemark.capture` it imports only `source` (the slot advance, the source's catalog)
and `ranges` (a resend's kept key ranges).
"""

import sys
import types

from tidemark.consolidate.job import ConsolidateError, ConsolidateResult, consolidate_stream, follow_stream
from tidemark.sparkconf import spark_session   # the Spark settings' module (`tidemark.sparkconf`)

__all__ = ["ConsolidateError", "ConsolidateResult", "consolidate_stream", "follow_stream", "spark_session"]


class _Package(types.ModuleType):
    """``tidemark.consolidate(cfg, ...)`` is `consolidate_stream`: importing this package sets the name
    ``tidemark.consolidate`` to the package, so the public face's call must be the package's own."""

    def __call__(self, cfg, **kw):
        return self.consolidate_stream(cfg, **kw)


sys.modules[__name__].__class__ = _Package
