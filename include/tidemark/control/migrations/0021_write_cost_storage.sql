-- Write cost, storage and maintenance runs (issue 36 points 4 and 5).
--
-- One row per batch and lake table the batch committed (`tidemark.consolidate.writecost`): what the
-- batch's Delta versions of the table rewrote (their add and remove actions' sizes, read from the Delta
-- log) against what the table's changes in the batch hold (its decoded updates). Keyed by the batch's
-- frontier: a retried frontier records nothing twice. A stream's rows older than 30 days are pruned as
-- new ones come.
CREATE TABLE tidemark.write_costs (
    stream           text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    table_name       text        NOT NULL,
    frontier         bigint      NOT NULL,   -- the batch's frontier (its commits' app transaction)
    frontier_before  bigint,                 -- where the batch started (NULL: the stream's first)
    at               timestamptz NOT NULL DEFAULT clock_timestamp(),
    version_from     bigint      NOT NULL,   -- the lake table's Delta versions the batch committed
    version_to       bigint      NOT NULL,
    added_files      integer     NOT NULL,   -- data files the versions added, and their bytes
    added_bytes      bigint      NOT NULL,
    removed_files    integer     NOT NULL,   -- data files the versions removed (replaced), and their bytes
    removed_bytes    bigint      NOT NULL,
    change_records   bigint      NOT NULL,   -- the table's updates in the batch (decoded records)
    change_bytes     bigint      NOT NULL,   -- the bytes they take decoded (compressed Arrow parts)
    changelog_bytes  bigint,                 -- bytes the batch added to the table's changelog
    live_bytes       bigint,                 -- the table's live bytes after the batch
    snapshot_load    boolean     NOT NULL DEFAULT false,   -- a snapshot was loaded as one of the versions
    PRIMARY KEY (stream, table_name, frontier)
);
CREATE INDEX write_costs_stream_at ON tidemark.write_costs (stream, at);

-- What each `tidemark maintain` run did (its `MaintainReport`), newest kept per stream: the status
-- page's "last maintenance run".
CREATE TABLE tidemark.maintenance_runs (
    stream       text        NOT NULL REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    started_at   timestamptz NOT NULL,
    finished_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    report       jsonb       NOT NULL
);
CREATE INDEX maintenance_runs_stream_finished ON tidemark.maintenance_runs (stream, finished_at);

-- The stream's storage figures (`tidemark.lake.storage`: lake bytes live and on disk, files, the
-- landing store's bytes, the oldest readable position) as last computed by `tidemark status` (the
-- record_metrics task) or a maintenance run: the status page reads them from here, walking nothing.
CREATE TABLE tidemark.storage_figures (
    stream   text        PRIMARY KEY REFERENCES tidemark.streams(name) ON DELETE CASCADE,
    at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    figures  jsonb       NOT NULL
);
