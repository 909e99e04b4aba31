"""The Delta log keeps what `lake.retention` needs and no more (issue 36): `tidemark maintain` sets each
table's ``delta.logRetentionDuration`` to the window and a margin, so the log's entries older than that
(up to the newest checkpoint before the cut) are deleted, while every version inside the window loads
and reads as it did. Before, the log kept Delta's default 30 days whatever the window: a stream
consolidating every minute with ``lake.retention: 1 minute`` grew its log by every batch for a month
(the soak measured log ÷ live bytes 0.09 → 0.50 over 200 batches)."""

from __future__ import annotations

import os
import time

from tidemark.capture.snapshot import snapshot_stream
from tidemark.lake import changelog_uri, open_delta, storage_options, table_uri
from tidemark.lake.retention import table_window, window_start_ms
from tidemark.maintain import log_retention_seconds, maintain

from oracle import assert_lake_equals_source, consolidate, drain_until_current, rows

TABLE = "public.lr_keyed"


def _batch(source_conn, i: int) -> None:
    with source_conn, source_conn.cursor() as cur:
        cur.execute("UPDATE public.lr_keyed SET v = v || %s WHERE id %% 5 = %s", (f".{i}", i % 5))
        cur.execute("INSERT INTO public.lr_keyed VALUES (%s, 'new')", (1000 + i,))


def _log_versions(uri: str) -> list[int]:
    return sorted(int(f.split(".")[0]) for f in os.listdir(os.path.join(uri, "_delta_log")) if f.endswith(".json"))


def test_the_log_keeps_the_window_and_a_margin_not_thirty_days(make_stream, source_conn, spark):
    with source_conn, source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.lr_keyed (id int PRIMARY KEY, v text)")
        cur.execute("INSERT INTO public.lr_keyed SELECT i, 'v' || i FROM generate_series(1, 100) i")
    cfg = make_stream([TABLE], consolidate={"buckets": 2}, lake={"retention": "2 seconds"})
    assert log_retention_seconds(cfg) == 4
    snapshot_stream(cfg)
    for i in range(4):
        if i:
            _batch(source_conn, i)
        drain_until_current(cfg)
        consolidate(cfg, spark)
    maintain(cfg)                 # sets the log's retention and writes a checkpoint: the cut's anchor
    uris = {"table": table_uri(cfg, TABLE), "changelog": changelog_uri(cfg, TABLE)}
    before = {kind: _log_versions(uri) for kind, uri in uris.items()}
    for kind, uri in uris.items():
        dt = open_delta(uri, storage_options(cfg))
        assert dt.metadata().configuration.get("delta.logRetentionDuration") == "interval 4 seconds", kind
    time.sleep(5)                 # every entry so far is now older than the log's retention
    for i in range(4, 6):
        _batch(source_conn, i)
        drain_until_current(cfg)
        consolidate(cfg, spark)
    dt = open_delta(uris["table"], storage_options(cfg))
    _, _, inside = table_window(dt, cfg.stream, window_start_ms(cfg))
    want = {}
    for v in inside:
        dt.load_as_version(v)
        want[v] = rows(dt.to_pyarrow_table())
    maintain(cfg)
    for kind, uri in uris.items():
        after = _log_versions(uri)
        assert min(after) > min(before[kind]), (kind, "no log entry older than the retention was deleted",
                                                before[kind], after)
    dt = open_delta(uris["table"], storage_options(cfg))
    for v, expected in want.items():          # every version inside the window still loads, the same
        dt.load_as_version(v)
        assert rows(dt.to_pyarrow_table()) == expected, v
    assert_lake_equals_source(cfg, TABLE)
