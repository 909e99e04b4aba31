-- One incident per cause: a failure that repeats (a retried task, every poke of the gap sensor)
-- updates its open incident (`occurrences`, `last_seen_at`, the latest `detail`) instead of opening
-- a new one. The cause is (stream, kind, table, cause_key); `cause_key` is a digest of the detail
-- without the keys that change from one occurrence to the next (wall-clock times, counts seen;
-- `Control.open_incident`). Incidents opened before this migration keep cause_key NULL.
ALTER TABLE tidemark.incidents ADD COLUMN table_name text;
ALTER TABLE tidemark.incidents ADD COLUMN cause_key text;
ALTER TABLE tidemark.incidents ADD COLUMN occurrences bigint NOT NULL DEFAULT 1;
ALTER TABLE tidemark.incidents ADD COLUMN last_seen_at timestamptz;
UPDATE tidemark.incidents SET last_seen_at = opened_at;
ALTER TABLE tidemark.incidents ALTER COLUMN last_seen_at SET NOT NULL;
ALTER TABLE tidemark.incidents ALTER COLUMN last_seen_at SET DEFAULT now();
CREATE UNIQUE INDEX incidents_open_cause ON tidemark.incidents (stream, kind, cause_key)
    WHERE resolved_at IS NULL AND cause_key IS NOT NULL;
