-- Tidemark control database: streams, subscribers, the segment manifest, snapshots, incidents.
-- LSNs are stored as bigint (pg_lsn as a 64-bit integer), as they appear in segments' `time`.

CREATE TABLE tidemark.streams (
    name            text PRIMARY KEY,
    config          jsonb       NOT NULL,
    slot_name       text        NOT NULL,
    publication     text        NOT NULL,
    consistent_lsn  bigint,                 -- where the slot's history begins (snapshot point)
    landed_upper    bigint,                 -- upper of the newest landed segment
    frontier        bigint,                 -- consolidated upper: everything below is in the lake
    next_seq        bigint      NOT NULL DEFAULT 0,
    state           text        NOT NULL DEFAULT 'new',
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE tidemark.subscribers (
    stream      text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    name        text        NOT NULL,
    checkpoint  bigint,                      -- upper this subscriber has durably processed
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, name)
);

CREATE TABLE tidemark.segments (
    stream        text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    seq           bigint      NOT NULL,
    lower_lsn     bigint      NOT NULL,
    upper_lsn     bigint      NOT NULL,
    uri           text        NOT NULL,
    record_count  bigint      NOT NULL,
    txn_count     bigint      NOT NULL,
    byte_size     bigint      NOT NULL,
    checksum      text        NOT NULL,     -- sha256 of the file's bytes
    status        text        NOT NULL DEFAULT 'landed',   -- landed | forgotten | quarantined
    origin        text        NOT NULL DEFAULT 'drain',    -- drain | repair | sweep | external
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, seq),
    CHECK (lower_lsn <= upper_lsn)
);
CREATE INDEX segments_stream_lower ON tidemark.segments (stream, lower_lsn);

CREATE TABLE tidemark.snapshots (
    stream        text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    snapshot_id   text        NOT NULL,
    lsn           bigint      NOT NULL,     -- consistent point: changes with time >= lsn come from the slot
    mode          text        NOT NULL DEFAULT 'initial',   -- initial | resend
    status        text        NOT NULL DEFAULT 'running',   -- running | complete | failed | loaded
    tables        jsonb       NOT NULL DEFAULT '{}'::jsonb,  -- table -> {rows, files, columns}
    started_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    PRIMARY KEY (stream, snapshot_id)
);

CREATE TABLE tidemark.snapshot_chunks (
    stream        text        NOT NULL,
    snapshot_id   text        NOT NULL,
    table_name    text        NOT NULL,
    chunk_no      integer     NOT NULL,
    page_lo       bigint      NOT NULL,
    page_hi       bigint,                  -- NULL: to the end of the table
    uri           text,
    row_count     bigint,
    status        text        NOT NULL DEFAULT 'pending',   -- pending | done | failed
    error         text,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, snapshot_id, table_name, chunk_no),
    FOREIGN KEY (stream, snapshot_id) REFERENCES tidemark.snapshots(stream, snapshot_id) ON DELETE CASCADE
);

CREATE TABLE tidemark.incidents (
    id           bigserial   PRIMARY KEY,
    stream       text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    kind         text        NOT NULL,     -- gap | counts_unmet | bad_segment | slot_lost | ...
    detail       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    opened_at    timestamptz NOT NULL DEFAULT now(),
    resolved_at  timestamptz,
    resolution   text
);
CREATE INDEX incidents_open ON tidemark.incidents (stream) WHERE resolved_at IS NULL;

CREATE TABLE tidemark.metrics (
    stream                 text        PRIMARY KEY REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    current_segment        bigint,     -- newest landed segment's seq
    committed_segment      bigint,     -- newest consolidated segment's seq
    committed_position     bigint,     -- frontier LSN
    last_segment_at        timestamptz,
    slot_lag_bytes         bigint,
    updated_at             timestamptz NOT NULL DEFAULT now()
);
