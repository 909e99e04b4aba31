-- An incident's cause as columns: the step that failed and its reason on one line (never a stack
-- trace: `tidemark.errors.reason_line`), kept up to date by each repeat of the same cause
-- (`Control.open_incident`, which also counts `occurrences` and moves `last_seen_at`). The cause key
-- (migration 0007) is computed from the same reason with what changes between occurrences removed
-- (times, attempt numbers, pids, Spark stage/task ids: `tidemark.errors.normalize_reason`).
ALTER TABLE tidemark.incidents ADD COLUMN step text;
ALTER TABLE tidemark.incidents ADD COLUMN reason text;
UPDATE tidemark.incidents
   SET step = detail->>'step',
       reason = left(btrim(split_part(detail->>'reason', E'\n', 1)), 500)
 WHERE jsonb_typeof(detail) = 'object';
-- What the job that met the failure said of it (deterministic | transient): read by the Airflow task
-- when the job's own result does not reach it (spark-submit in cluster deploy mode).
ALTER TABLE tidemark.incidents ADD COLUMN failure_class text
    CHECK (failure_class IS NULL OR failure_class IN ('deterministic', 'transient'));
