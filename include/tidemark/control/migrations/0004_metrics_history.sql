-- A history of each stream's metrics, one row per sample (every `stream_status`: the DAGs'
-- record_metrics task, `tidemark status`), for the status page's plots of lag and changes/s.
-- Bounded: `Control.record_metrics_sample` prunes a stream's rows older than the retention and
-- beyond a row cap.
CREATE TABLE tidemark.metrics_history (
    stream             text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    at                 timestamptz NOT NULL DEFAULT clock_timestamp(),
    frontier           bigint,                -- consolidated upper (LSN)
    landed_upper       bigint,                -- upper of the newest landed segment (LSN)
    source_lsn         bigint,                -- the source's pg_current_wal_lsn() when sampled
    confirmed_lsn      bigint,                -- the slot's confirmed_flush_lsn when sampled
    slot_lag_bytes     bigint,
    slot_lag_seconds   double precision,      -- since the source was at confirmed_lsn (sampling resolution)
    landed_changes     bigint      NOT NULL,  -- change records in landed segments so far (cumulative)
    current_segment    bigint,
    committed_segment  bigint
);
CREATE INDEX metrics_history_stream_at ON tidemark.metrics_history (stream, at);
