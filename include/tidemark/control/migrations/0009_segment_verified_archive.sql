-- A segment's file is decoded and checked once: `verified_at` marks it (cleared when its file or status
-- changes), so the gap sensor's every poke does not decode the whole backlog again.
ALTER TABLE tidemark.segments ADD COLUMN verified_at timestamptz;

-- Manifest rows below the retention floor (consolidated, below every subscriber's checkpoint) move to
-- the archive, so that what gap detection and the status read stays small. They are still read by
-- `Control.segments` (a changelog rebuild of a past interval, a sweep), never by the gap detector.
-- `archived_seq` is the first sequence number left in tidemark.segments, `archived_upper` the end of
-- the archived rows that cover the LSN line: the tiling resumes there.
CREATE TABLE tidemark.segments_archive (
    stream        text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    seq           bigint      NOT NULL,
    lower_lsn     bigint      NOT NULL,
    upper_lsn     bigint      NOT NULL,
    uri           text        NOT NULL,
    record_count  bigint      NOT NULL,
    txn_count     bigint      NOT NULL,
    byte_size     bigint      NOT NULL,
    checksum      text        NOT NULL,
    status        text        NOT NULL,
    origin        text        NOT NULL,
    created_at    timestamptz NOT NULL,
    min_commit_ts bigint,
    max_commit_ts bigint,
    verified_at   timestamptz,
    archived_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, seq)
);
CREATE INDEX segments_archive_stream_upper ON tidemark.segments_archive (stream, upper_lsn);
ALTER TABLE tidemark.streams ADD COLUMN archived_seq bigint;
ALTER TABLE tidemark.streams ADD COLUMN archived_upper bigint;
