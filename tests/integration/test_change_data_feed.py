"""Delta's change data feed on the lake tables, end to end: PostgreSQL → drain → consolidate (several
batches, a snapshot load, inserts, TOAST-kept updates, key changes, deletes, a truncate, a table
without a key, a re-snapshot correcting the lake) → ``deltalake.DeltaTable.load_cdf``. Replaying the feed version by version gives the
table at every version; each batch's changes agree with the consolidated changelog's rows between the
frontiers of the versions; each version names its frontier (the LSN) in its commit metadata."""

from __future__ import annotations

import random
from collections import Counter

import pyarrow as pa
import pytest

from oracle import drain_until_current, row_tuples, rows, source_table
from test_changelog import SETUP, TABLES, _phase
from tidemark.capture.snapshot import snapshot_stream
from tidemark.consolidate import consolidate_stream
from tidemark.lake import read_changelog, table_uri
from tidemark.lake.delta import tidemark_meta
from tidemark.pgtypes import table_schema_from_catalog

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SIGN = {"insert": 1, "update_postimage": 1, "delete": -1, "update_preimage": -1}


def _feed(uri) -> dict[int, list]:
    """{version: [(row, change type)]} of the table's whole change data feed."""
    from deltalake import DeltaTable

    got = pa.table(DeltaTable(uri).load_cdf(starting_version=0).read_all())
    names = [c for c in got.column_names if c not in ("_change_type", "_commit_version", "_commit_timestamp")]
    out: dict[int, list] = {}
    for row, kind, v in zip(row_tuples(got.select(names)), got.column("_change_type").to_pylist(),
                            got.column("_commit_version").to_pylist()):
        out.setdefault(v, []).append((row, kind))
    return out


def test_load_cdf_replays_every_version_and_agrees_with_the_changelog(make_stream, source_conn, spark):
    from deltalake import DeltaTable

    rng = random.Random(11)
    cur = source_conn.cursor()
    cur.execute("SET synchronous_commit = on")
    cur.execute(SETUP)
    cur.execute("INSERT INTO items SELECT g, 'init', repeat('z', 3000), 1.00 FROM generate_series(1, 12) g")
    cur.execute("INSERT INTO bag VALUES (1, 'init', 'b'), (1, 'init', 'b')")
    next_id = [13]
    cfg = make_stream(TABLES, drain={"idle_timeout_seconds": 0.5, "max_changes": 60}, consolidate={"buckets": 3})
    snapshot_stream(cfg)
    shapes = {t: table_schema_from_catalog(source_conn, *t.split(".")) for t in TABLES}
    for phase in range(5):
        if phase == 4:
            # a re-snapshot correcting the lake (rows taken out behind Tidemark's back): merged in the
            # batch as a truncate and the copy's rows, its change rows the difference
            DeltaTable(table_uri(cfg, "public.items")).delete("id % 5 = 1")
            snapshot_stream(cfg, tables=["public.items"], mode="table")
        _phase(cur, rng, next_id, truncate=phase == 2)
        drain_until_current(cfg)
        consolidate_stream(cfg, spark=spark)
    kinds: Counter = Counter()
    for t in TABLES:
        uri = table_uri(cfg, t)
        dt = DeltaTable(uri)
        assert dt.metadata().configuration.get("delta.enableChangeDataFeed") == "true", t
        names = [c.name for c in shapes[t].columns]
        feed = _feed(uri)
        history = {h["version"]: tidemark_meta(h, cfg.stream) for h in dt.history()}
        log = read_changelog(cfg, t)
        log_rows = list(zip(row_tuples(log.select(names)), log.column("_time").to_pylist(),
                            log.column("_diff").to_pylist()))
        state: Counter = Counter()
        frontier, batches = None, 0
        for v in range(dt.version() + 1):
            changes = feed.get(v, [])
            kinds.update(k for _, k in changes)
            net: Counter = Counter()
            for row, kind in changes:
                net[row[:len(names)]] += SIGN[kind]
                state[row] += SIGN[kind]
            assert all(n >= 0 for n in state.values()), (t, v, "a row deleted that the table did not hold")
            at = DeltaTable(uri, version=v).to_pyarrow_table()
            assert +state == rows(at.select(names + ["_bucket"])), (t, v)       # the replay is the version
            meta = history[v]
            if meta is None:              # a version not Tidemark's (the damage above): replayed, nothing more
                continue
            assert "frontier" in meta, (t, v)                                    # its LSN, in the commit info
            if meta.get("operation") == "consolidate" and frontier is not None:
                # the batch's changes are the changelog's rows between the frontiers, summed
                want: Counter = Counter()
                for row, time, diff in log_rows:
                    if frontier <= time < int(meta["frontier"]):
                        want[row] += diff
                assert +net == +want and -net == -want, (t, v)
                batches += 1
            frontier = int(meta["frontier"])
        assert batches >= 3, (t, batches)        # the batches' versions were compared with the changelog
        # the table equals PostgreSQL now (without the partition column)
        assert Counter(r[:len(names)] for r in (+state).elements()) == rows(source_table(cur.connection, shapes[t]))
    assert kinds["update_preimage"] == kinds["update_postimage"] > 0
    assert kinds["insert"] and kinds["delete"]
