-- Each table's own state in a PostgreSQL-sourced stream, when it is not simply "captured since the
-- stream's consistent point" (a table with no row here is that):
--   awaiting_snapshot  added to a running stream (`stream apply`): its changes land, but the lake
--                      takes them only from its own snapshot's LSN (`snapshot --mode add`) on;
--   capturing          its own snapshot completed at since_lsn: loaded once the frontier reaches it;
--   frozen             removed from the stream file: no longer captured, its lake table is kept as
--                      it was at since_lsn (the stream frontier when it was removed).
CREATE TABLE tidemark.stream_tables (
    stream      text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    table_name  text        NOT NULL,
    state       text        NOT NULL CHECK (state IN ('awaiting_snapshot', 'capturing', 'frozen')),
    since_lsn   bigint,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, table_name)
);
