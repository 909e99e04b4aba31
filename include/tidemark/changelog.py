"""The consolidated changelog per data interval (for the Airflow changelog DAG and backfills).

See `tidemark.consolidate.changelog.write_changelog`.
"""

from tidemark.consolidate.changelog import write_changelog

__all__ = ["write_changelog"]
