"""The lake: Delta Lake tables (current state, consolidated changelog, history), how to read them
(`read_table`, `read_tables` at a frontier or as of a position or time, `read_changelog`,
`register_table`, `history`) and the one lake writer (`writer`). The consolidation
(`tidemark.consolidate`) decides what to write and imports this package; this package imports only
`tidemark.config`, `tidemark.errors` and `tidemark.pgtypes` (and the control database, for reads as of
a position).
"""

from tidemark.lake.delta import (BUCKET_COLUMN, LakeError, changelog_between, changelog_uri, committed_frontier,
                                 data_files, exact_schema, filesystem, history_uri, lake_schema, open_delta,
                                 read_changelog, read_table, read_tables, register_table, storage_options,
                                 strip_scheme, table_info, table_uri, version_at)
from tidemark.lake.history import read_history, register_history

__all__ = [
    "BUCKET_COLUMN", "LakeError", "changelog_between", "changelog_uri", "committed_frontier", "data_files",
    "exact_schema", "filesystem", "history_uri", "lake_schema", "open_delta", "read_changelog", "read_history",
    "read_table", "read_tables", "register_history", "register_table", "storage_options", "strip_scheme",
    "table_info", "table_uri", "version_at",
]
