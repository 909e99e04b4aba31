-- Per-table positions of external feeds (source kind: feed): each table lands and consolidates up to
-- its own first incomplete time; the stream's landed_upper is the greatest and its frontier the
-- least of them. PostgreSQL-sourced streams keep one frontier per stream and have no rows here.
CREATE TABLE tidemark.table_frontiers (
    stream        text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    table_name    text        NOT NULL,
    landed_upper  bigint,                  -- the table's updates below it are in landed segments
    frontier      bigint,                  -- the table's lake (and changelog) is committed up to it
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, table_name)
);
