-- The landing store's retention (`tidemark.maintain`): the files of archived segments below the floor
-- (the frontier, every subscriber's checkpoint and the lake's retention window) are deleted; the
-- archive row stays and says when its file went. The changelog feed's Avro files below the same floor
-- are deleted too; each is listed here (they have no manifest row of their own).
ALTER TABLE tidemark.segments_archive ADD COLUMN file_deleted_at timestamptz;

CREATE TABLE tidemark.deleted_feed_files (
    stream      text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    key         text        NOT NULL,
    upper_lsn   bigint      NOT NULL,
    byte_size   bigint,
    deleted_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, key)
);
