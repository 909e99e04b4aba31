-- Commit-time bounds of a segment's transactions (µs since the epoch, UTC, as in segments'
-- `commit_ts`), so the changelog of a data interval can select the segments that may hold its
-- commits. NULL: not known (registered before this migration, or a segment without records).
ALTER TABLE tidemark.segments ADD COLUMN min_commit_ts bigint;
ALTER TABLE tidemark.segments ADD COLUMN max_commit_ts bigint;
