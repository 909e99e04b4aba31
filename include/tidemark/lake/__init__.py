"""The lake: Delta Lake tables (current state and consolidated changelog) and how to read them.

Owns the lake's layout (where each table lives, its ``_bucket`` partitioning), opening Delta tables
with the stream's storage options, the ``(stream, frontier)`` application transaction each commit
carries, and the reads (`read_table`, `read_tables` at one frontier or as of a source position or
time, `read_changelog`, `register_table`, and `history`: tables as of a position, a key's versions), and the one lake writer (`writer`: every
commit, the consolidation's and maintenance's). The consolidation (`tidemark.consolidate`) decides
what to write and imports this package; this package imports only
`tidemark.config`, `tidemark.errors` and `tidemark.pgtypes` (and, for reads as of a position, the
control database's frontier and snapshots).
"""

from tidemark.lake.delta import (BUCKET_COLUMN, HIDDEN_COLUMNS, LakeError, changelog_between, changelog_uri,
                                 committed_frontier, data_files, exact_schema, filesystem, history_uri, lake_root,
                                 lake_schema, open_delta, read_changelog, read_delta, read_table, read_tables,
                                 register_table, storage_options, strip_scheme, table_info, table_uri,
                                 version_at)
from tidemark.lake.history import read_history, register_history

__all__ = [
    "BUCKET_COLUMN", "HIDDEN_COLUMNS", "LakeError", "changelog_between", "changelog_uri", "committed_frontier",
    "data_files", "exact_schema", "filesystem", "history_uri", "lake_root", "lake_schema", "open_delta",
    "read_changelog", "read_delta", "read_history", "read_table", "read_tables", "register_history",
    "register_table", "storage_options", "strip_scheme", "table_info", "table_uri", "version_at",
]
