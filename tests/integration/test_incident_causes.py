"""One incident per cause in the control database when the failure's text changes between occurrences
the way Spark's does (object, stage and task ids, pids, attempt numbers), and a one-line reason when it
holds a Java stack trace or a Py4J dump. Before: each retry of such a failure opened a new incident, and
the reason held the whole dump."""

from __future__ import annotations

DUMP = """An error occurred while calling o{oid}.save.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage {stage}.0 failed 4 times, \
most recent failure: Lost task 0.3 in stage {stage}.0 (TID {tid}) (10.0.0.7 executor 1): \
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/opt/spark/python/lib/pyspark.zip/pyspark/worker.py", line 1247, in main
ModuleNotFoundError: No module named 'pyarrow'

\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:572)
\tat org.apache.spark.scheduler.Task.run(Task.scala:141)
"""

OOM = """An error occurred while calling o{oid}.collectToPython.
: java.lang.OutOfMemoryError: Java heap space
\tat java.base/java.util.Arrays.copyOf(Arrays.java:3537)
"""


def _detail(cfg, reason: str, attempt: int) -> dict:
    return {"stream": cfg.stream, "table": "public.t", "step": "decoding the segments (Spark job)",
            "segment": {"seq": 3, "uri": "file:///l/3.avro"}, "position": "0/16B3748", "reason": reason,
            "at": f"2026-11-24T12:0{attempt}:00+00:00", "attempt": attempt, "remedy": "ship pyarrow"}


def test_the_same_spark_failure_twice_is_one_incident_with_count_2(control, make_stream):
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    first = control.open_incident(cfg.stream, "consolidate_failed",
                                  _detail(cfg, DUMP.format(oid=123, stage=3, tid=7), 1))
    again = control.open_incident(cfg.stream, "consolidate_failed",
                                  _detail(cfg, DUMP.format(oid=980, stage=11, tid=42), 2))
    assert again == first
    [inc] = control.incidents(cfg.stream)
    assert inc["count"] == 2 and inc["last_seen_at"] >= inc["opened_at"]
    assert inc["reason"] == inc["detail"]["reason"] == "ModuleNotFoundError: No module named 'pyarrow'"
    assert inc["step"] == "decoding the segments (Spark job)"
    # another cause on the same step is another incident; its reason is the OOM, not what followed it
    oom = control.open_incident(cfg.stream, "consolidate_failed", _detail(cfg, OOM.format(oid=5), 3))
    assert oom != first
    reasons = {i["id"]: (i["count"], i["reason"]) for i in control.incidents(cfg.stream)}
    assert reasons == {first: (2, "ModuleNotFoundError: No module named 'pyarrow'"),
                       oom: (1, "java.lang.OutOfMemoryError: Java heap space")}


def test_migration_0010_fills_step_and_reason_of_older_incidents(control, make_stream):
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    with control.tx() as cur:       # an incident as the code before the migration wrote it
        cur.execute("""INSERT INTO tidemark.incidents (stream, kind, detail) VALUES (%s, 'consolidate_failed',
                       '{"step": "merging", "reason": "ValueError: x\\n  at frame"}') RETURNING id""", (cfg.stream,))
        old = cur.fetchone()[0]
        cur.execute("SELECT version, name FROM tidemark.schema_migrations WHERE version = 10")
        _, name = cur.fetchone()
        from importlib import resources

        text = resources.files("tidemark.control").joinpath("migrations", name).read_text()
        update = text[text.index("UPDATE tidemark.incidents"):text.index(";", text.index("UPDATE tidemark.incidents"))]
        cur.execute(update)
    [inc] = [i for i in control.incidents(cfg.stream) if i["id"] == old]
    assert (inc["step"], inc["reason"]) == ("merging", "ValueError: x")
