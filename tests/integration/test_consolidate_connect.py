"""``tidemark consolidate`` as a thin Spark Connect client (``TIDEMARK_SPARK_REMOTE``) of a long-running
local server (`tidemark.local.sparkconnect`) gives the lake the reference applier computes: the batch
path (plain keyed tables), the per-table path (a truncate) and a table without a key, over two batches."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from consolidate_kit import Lander, shape, truncate, up
from refapply import apply_capture, arrow_rows
from tidemark.landing.segments import read_segment
from tidemark.lake import read_table

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory):
    from tidemark.local import sparkconnect

    jars = sparkconnect.spark_home() / "jars"
    if not any(p.name.startswith("spark-connect_") for p in jars.glob("*.jar")):
        pytest.skip("this PySpark ships no Spark Connect server")
    proc, url = sparkconnect.start(tmp_path_factory.mktemp("connect") / "server.log", master="local[2]",
                                   conf={"spark.sql.shuffle.partitions": "4"})
    yield url
    sparkconnect.stop(proc)


def _workload(rng: random.Random, tables, t0: int, n: int, state: dict):
    """``n`` random transactions from time ``t0``: inserts, updates (some changing the key), deletes;
    a truncate of the second table once. ``state`` tracks each table's live rows."""
    txns, t = [], t0
    truncated = False
    for _ in range(n):
        t += 10
        ups, evs, pos = [], [], 0
        for tab in rng.sample(tables, rng.randint(1, len(tables))):
            live = state[tab.name]
            keyed = tab.replica_identity != "f"
            kind = rng.choice(["insert", "insert", "update", "delete"]) if live else "insert"
            if kind == "insert":
                k = max((r["k"] for r in live), default=0) + 1 + rng.randrange(3)
                row = {"k": k, "v": f"v{rng.randrange(1000)}"}
                ups.append(up(tab, row, t, 1, pos))
                live.append(row)
                pos += 1
            else:
                old = rng.choice(live)
                image = "key" if keyed else "full"
                ups.append(up(tab, old if not keyed else {"k": old["k"]}, t, -1, pos, image=image))
                live.remove(old)
                pos += 1
                if kind == "update":
                    new = {"k": old["k"] if rng.random() < 0.7 else max(r["k"] for r in live + [old]) + 5,
                           "v": f"u{rng.randrange(1000)}"}
                    ups.append(up(tab, new, t, 1, pos))
                    live.append(new)
                    pos += 1
        if not truncated and t > t0 + 10 * (n // 2):
            truncated = True
            evs.append(truncate(tables[1], t, pos))
            state[tables[1].name].clear()
        txns.append((ups, evs))
    return txns, t + 1


def test_consolidate_through_spark_connect(connect_server, make_stream, control, tmp_path):
    names = ["public.ka", "public.kb", "public.mc"]
    tables = [shape("ka", [("k", "int64", True), ("v", "text")], oid=11),
              shape("kb", [("k", "int32", True), ("v", "text")], oid=12),
              shape("mc", [("k", "int64"), ("v", "text")], oid=13, replica_identity="f")]
    cfg = make_stream(names)
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    lander = Lander(cfg, control)
    rng = random.Random(10)
    state = {t.name: [] for t in tables}
    lower, segments = 0, []
    # no Spark installation for the client: a run that started its own JVM instead of connecting fails
    env = {**os.environ, "TIDEMARK_SPARK_REMOTE": connect_server, "PYSPARK_PYTHON": sys.executable,
           "SPARK_HOME": str(tmp_path / "no-spark-here")}
    for batch in range(2):
        txns, upper = _workload(rng, tables, lower, 40, state)
        seg = lander.land(lower, upper, txns)
        segments.append(read_segment(_read(seg.uri), seg.uri.rsplit("/", 1)[-1]))
        out = subprocess.run([sys.executable, "-m", "tidemark.cli", "--streams", str(streams), "consolidate",
                              cfg.stream], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert control.stream(cfg.stream).frontier == upper
        expected = apply_capture({n: (t, []) for n, t in zip(names, tables)}, 0, segments)
        for name in names:
            assert Counter(arrow_rows(read_table(cfg, name))) == expected[name], (batch, name)
        lower = upper


def _read(uri: str) -> bytes:
    from tidemark.landing.store import read_uri

    return read_uri(uri)


CLIENT = r'''
import os, sys, types
from tidemark.sparkconf import spark_session

spark = spark_session("t", cfg=types.SimpleNamespace(stream=sys.argv[1]))


def uuid_of_worker(batches):
    import os
    import pyarrow as pa
    for _ in batches:
        yield pa.RecordBatch.from_pydict({"u": [os.environ.get("SPARK_JOB_ARTIFACT_UUID", "")],
                                          "pid": [os.getppid()]})


row = spark.range(0, 1, 1, 1).mapInArrow(uuid_of_worker, "u string, pid long").collect()[0]
print(row.u, row.pid)
if len(sys.argv) > 2:                  # a client that closes the session on the server
    spark.release_session_on_close = True
spark.stop()
'''


def _session_of(url: str, stream: str, *extra: str) -> tuple[tuple[str, str], str]:
    """((the session's artifact id, its Python workers' daemon pid) as a UDF of a run of ``stream``
    saw them, the client's stderr)."""
    env = {**os.environ, "TIDEMARK_SPARK_REMOTE": url}
    env.pop("TIDEMARK_SPARK_SHIP", None)
    out = subprocess.run([sys.executable, "-c", CLIENT, stream, *extra], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return tuple(out.stdout.split()[-2:]), out.stderr


def test_a_streams_runs_share_one_session_and_its_python_workers(connect_server):
    """Each run is a new client process; the runs of one stream use one session of the server, so
    its Python workers (started per session) are warm and no daemon is left behind per run; another
    stream has its own. A session closed on the server is replaced, with a line saying so."""
    first, _ = _session_of(connect_server, "s-one")
    again, _ = _session_of(connect_server, "s-one")
    other, _ = _session_of(connect_server, "s-two")
    assert first == again and first[0]              # same session, same worker daemon
    assert other[0] != first[0] and other[1] != first[1]
    _session_of(connect_server, "s-two", "release")    # closed on the server: its id cannot be used again
    after, err = _session_of(connect_server, "s-two")
    assert after[0] not in ("", other[0]), (after, other)
    assert "session was closed on the server" in err, err[-2000:]
