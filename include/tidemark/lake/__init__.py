"""The lake: Delta Lake tables (current state, consolidated changelog, history), how to read them
(`read_table`, `read_tables` at a frontier or as of a position or time, `read_changelog`,
`register_table`, `read_history`) and the one lake writer (`writer`). Its modules, each importing only
those before it: `delta` (names, URIs, commit metadata), `retention`, `scd2`, `changelog`, `history`,
`read` (the readers); `writer`, `storage` and `layout` (the tables' buckets and sorted files: it loads
pyarrow, so this package does not import it) beside them. `tidemark.consolidate` imports this package.
"""

from tidemark.lake.changelog import changelog_between, read_changelog
from tidemark.lake.delta import (BUCKET_COLUMN, LakeError, changelog_uri, committed_frontier, data_files, exact_schema,
                                 filesystem, history_uri, lake_schema, open_delta, storage_options, strip_scheme,
                                 table_info, table_uri, version_at)
from tidemark.lake.history import read_history
from tidemark.lake.read import read_table, read_tables, register_history, register_table

__all__ = [
    "BUCKET_COLUMN", "LakeError", "changelog_between", "changelog_uri", "committed_frontier", "data_files",
    "exact_schema", "filesystem", "history_uri", "lake_schema", "open_delta", "read_changelog", "read_history",
    "read_table", "read_tables", "register_history", "register_table", "storage_options", "strip_scheme",
    "table_info", "table_uri", "version_at",
]
