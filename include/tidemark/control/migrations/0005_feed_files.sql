-- External feeds (source kind: feed): the Materialize CDC files another producer puts in the
-- landing store under STREAM/feed/TABLE/, registered per table with what their records say, and
-- the times given up on (`tidemark feed forget`).
CREATE TABLE tidemark.feed_files (
    stream        text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    key           text        NOT NULL,
    table_name    text        NOT NULL,
    checksum      text        NOT NULL,
    byte_size     bigint      NOT NULL,
    update_count  bigint      NOT NULL,
    min_time      bigint,                  -- of its updates (NULL: none)
    max_time      bigint,
    progress      jsonb       NOT NULL,    -- [{"lower": l, "upper": u, "counts": {"time": count}}]
    status        text        NOT NULL DEFAULT 'registered',   -- registered | quarantined
    detail        text,                    -- why it was quarantined
    registered_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, key)
);

CREATE TABLE tidemark.feed_forgotten (
    stream      text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    table_name  text        NOT NULL,
    time        bigint      NOT NULL,
    expected    bigint      NOT NULL,
    seen        bigint      NOT NULL,
    reason      text        NOT NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, table_name, time)
);
