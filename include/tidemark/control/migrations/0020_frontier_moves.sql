-- When the consolidated frontier moved, and from where to where: with the landed segments' commit-time
-- bounds this gives the commit -> lake lag the status page shows (`Control.commit_lag`). One row per
-- move (`Control.advance_frontier`); a stream's rows older than a week are pruned as new ones come.
CREATE TABLE tidemark.frontier_moves (
    stream          text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    at              timestamptz NOT NULL DEFAULT clock_timestamp(),
    frontier_before bigint,               -- NULL: the stream had no frontier yet
    frontier_after  bigint      NOT NULL
);
CREATE INDEX frontier_moves_stream_at ON tidemark.frontier_moves (stream, at);
