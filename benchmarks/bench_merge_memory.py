"""Benchmark: one merge group's memory as its bucket's lake files grow (`merge.merge_records`, no Spark).

Writes one bucket of a keyed table shaped like the memory benchmark's ``orders`` (an int8 key, two
int8 columns, a status and a ~225-byte note) as files of ``target_rows`` rows, for each of
``--rows`` lake sizes; then merges the same kind of batch into each (``--records`` records: updates
that leave the note unchanged, deletes and inserts, keys spread over the whole bucket) in a fresh
Python process, with the allocators' settings the executors' Python workers run with
(`sparkconf.MEMORY_ENV`). Prints, per size, the Arrow memory pool's peak (``max_memory``), the
process's peak RSS above its RSS just before the merge, the lake rows the merge read and its time.
A task's memory must follow configuration (one file of ``target_rows`` rows and the batch's
records), not the bucket's size. Not a test.

    .venv/bin/python benchmarks/bench_merge_memory.py --rows 25000 100000 400000
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, pickle, sys, time
import pyarrow as pa
from tidemark.consolidate import merge
from tidemark.lake import layout
plan, recs = pickle.load(open(sys.argv[1], "rb"))
read = [0]
_read = layout.read_files
def counted(bp, paths):
    t = _read(bp, paths)
    read[0] += t.num_rows
    return t
layout.read_files = counted
pool = pa.default_memory_pool()
base_pool = pool.bytes_allocated()
def status(field):            # kB; VmHWM (the peak) is this process's own (ru_maxrss keeps the parent's across exec)
    return int(next(l for l in open("/proc/self/status") if l.startswith(field + ":")).split()[1])
rss0 = status("VmRSS")
t0 = time.perf_counter()
actions, log = merge.merge_records(plan, 0, recs)
took = time.perf_counter() - t0
print(json.dumps({"pool_peak": pool.max_memory() - base_pool, "rss_peak_above": (status("VmHWM") - rss0) * 1024,
    "read_rows": read[0], "seconds": took, "adds": sum(a["op"] == "add" for a in actions), "log": log.num_rows}))
"""


def build(work: Path, rows: int, records: int, target_rows: int, seed: int = 5):
    """(plan, records) for a bucket of ``rows`` rows in files of ``target_rows`` and a batch over it."""
    import numpy as np
    import pyarrow as pa

    from tidemark.consolidate import merge
    from tidemark.lake import layout
    from tidemark.consolidate.work_area import meta_arrow_fields
    from tidemark.pgtypes import Column, TableSchema, arrow_schema

    shape = TableSchema(schema="public", name="orders", oid=1, columns=(
        Column("id", "int64", "int8", 20, key=True, nullable=False), Column("customer", "int64", "int8", 20),
        Column("status", "text", "text", 25), Column("total_cents", "int64", "int8", 20),
        Column("note", "text", "text", 25)))
    target = arrow_schema(shape)
    rng = np.random.default_rng(seed)
    ids = np.arange(1, rows + 1, dtype=np.int64) * 16            # one bucket's keys of a 16-bucket table
    notes = np.array(["n" * k for k in range(50, 401)], dtype=object)
    lake = pa.table({"id": ids, "customer": rng.integers(0, 10_000, rows), "status": ["new"] * rows,
                     "total_cents": rng.integers(0, 100_000, rows),
                     "note": notes[rng.integers(0, len(notes), rows)]}, schema=target)
    bp = layout.BucketPlan(uri=str(work), options=None, schema=target, keys=["id"],
                           sort=["id"], target_rows=target_rows, tag="T0")
    bp.files = {0: [{"path": a["path"], "size": a["size"], "rows": a["rows"],
                     "min": json.loads(a["stats"])["minValues"], "max": json.loads(a["stats"])["maxValues"]}
                    for a in layout.write_sorted(bp, lake, 0)]}
    bp.tag = "T1"
    del lake
    # updates (key image, new image leaving the note unchanged), deletes (key image), inserts
    n_upd, n_del = records * 4 // 10, records // 10
    n_ins = records - 2 * n_upd - n_del
    keys = rng.choice(ids, n_upd + n_del, replace=False)
    new = (np.arange(n_ins, dtype=np.int64) + rows + 1) * 16
    t = np.arange(n_upd + n_del + n_ins, dtype=np.int64) * 10 + 100
    rec = {"_tm_time": np.r_[np.repeat(t[:n_upd], 2), t[n_upd:]],
           "_tm_pos": np.r_[np.tile([0, 1], n_upd), np.zeros(n_del + n_ins, np.int64)].astype(np.int32),
           "_tm_diff": np.r_[np.tile([-1, 1], n_upd), -np.ones(n_del, np.int64), np.ones(n_ins, np.int64)],
           "id": np.r_[np.repeat(keys[:n_upd], 2), keys[n_upd:], new]}
    n = len(rec["id"])
    is_new = np.r_[np.tile([False, True], n_upd), np.zeros(n_del, bool), np.ones(n_ins, bool)]
    ins = np.r_[np.zeros(2 * n_upd + n_del, bool), np.ones(n_ins, bool)]
    schema = pa.schema(meta_arrow_fields() + list(target))
    cols = {**rec, "_tm_full": is_new, "_tm_unknown": [[] if i else (["note"] if u else
                                                                        ["customer", "status", "total_cents", "note"])
                                                       for u, i in zip(is_new, ins)],
            "_tm_xid": np.ones(n, np.int64), "_tm_cts": rec["_tm_time"],
            "customer": np.where(is_new, 1, 0), "status": np.where(is_new, "paid", None).tolist(),
            "total_cents": np.where(is_new, 5, 0), "note": np.where(ins, "inserted", None).tolist()}
    table = pa.table({f.name: pa.array(cols[f.name], type=f.type) if not isinstance(cols[f.name], pa.Array)
                      else cols[f.name] for f in schema}, schema=schema)
    return merge.TablePlan("public.orders", bp, lower=0, frontier=1 << 62), table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[25_000, 100_000, 400_000])
    parser.add_argument("--records", type=int, default=6_000)
    parser.add_argument("--target-rows", type=int, default=65_536)
    args = parser.parse_args()
    from tidemark.sparkconf import MEMORY_ENV

    env = {**os.environ, **MEMORY_ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "include")}
    out = []
    with tempfile.TemporaryDirectory(prefix="tidemark-bench-merge-memory-") as tmp:
        for rows in args.rows:
            work = Path(tmp) / str(rows)
            plan, recs = build(work, rows, args.records, args.target_rows)
            pkl = work / "case.pkl"
            pkl.write_bytes(pickle.dumps((plan, recs)))
            got = json.loads(subprocess.run([sys.executable, "-c", CHILD, str(pkl)], env=env, check=True,
                                            capture_output=True, text=True).stdout)
            files = len(plan.bucket_plan.files[0])
            out.append((rows, files, got))
            print(f"{rows:>9,} lake rows in {files:>2} files, {recs.num_rows:,} records: Arrow pool peak "
                  f"{got['pool_peak'] / 2**20:7.1f} MB, RSS peak +{got['rss_peak_above'] / 2**20:7.1f} MB, "
                  f"read {got['read_rows']:,} lake rows, {got['seconds']:.2f} s (a first call: imports too)", flush=True)
    first = out[0]
    for rows, _, got in out[1:]:
        print(f"  {rows / first[0]:.0f}x the lake rows: Arrow pool peak "
              f"{got['pool_peak'] / first[2]['pool_peak']:.2f}x, "
              f"RSS peak {got['rss_peak_above'] / first[2]['rss_peak_above']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
