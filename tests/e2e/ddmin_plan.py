"""Delta-debug a plan of the property test (property_kit): find a small plan that still fails with the
same error, for test_property_regressions.py. Not a test; run it with the code that fails on the path:

    PYTHONPATH=<include dir of the failing code> .venv/bin/python tests/e2e/ddmin_plan.py \
        NAME 'SIGNATURE[&&SIGNATURE...]' OUT.py [SEEDS.py]

NAME is a plan of test_property_regressions.py (e.g. HYPOTHESIS_ARROW_TYPE); a candidate "still fails"
when run_plan raises and every SIGNATURE string occurs in the traceback text. SEEDS.py may define
SEEDS, a list of hand-made candidate plans (``K`` and ``ROW`` are in scope) tried first; the first that
fails replaces the plan. The reduction: drop or merge cycles, ddmin over transactions, ddmin over
operations, then simplifications one at a time (shorter chains, no TOASTed value, plainer values);
the current best plan is written to OUT.py after each step. Every check runs in-process on one
PostgreSQL cluster and one SparkSession, started here and stopped at the end.
"""
from __future__ import annotations

import os
import pprint
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests/e2e")]
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import property_kit as K  # noqa: E402
import test_property_regressions as R  # noqa: E402
from test_property_oracle import run_plan  # noqa: E402
from tidemark.control import Control  # noqa: E402
from dbkit import TEST_SETTINGS, start_own_cluster  # noqa: E402
import tidemark  # noqa: E402

NAME, SIG, OUT = sys.argv[1], sys.argv[2].split("&&"), sys.argv[3]
print("library:", tidemark.__file__, "signature:", SIG, flush=True)

home, cluster = start_own_cluster("i8d-pg-", TEST_SETTINGS)
control_dsn = cluster.ensure_database("tidemark_control")
with Control(control_dsn) as ctl:
    ctl.migrate()
from pyspark.sql import SparkSession  # noqa: E402
spark = (SparkSession.builder.master("local[2]").appName("i8d-ddmin")
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
         .config("spark.default.parallelism", "2").config("spark.sql.session.timeZone", "UTC")
         .config("spark.sql.execution.arrow.pyspark.enabled", "true")
         .config("spark.driver.memory", "2g").config("spark.sql.adaptive.enabled", "true").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")

checks = [0]
cache = {}


def fails(plan) -> bool:
    key = repr(plan)
    if key in cache:
        return cache[key]
    checks[0] += 1
    t0 = time.time()
    try:
        run_plan(cluster, control_dsn, spark, plan)
        res, why = False, "passed"
    except Exception as exc:  # noqa: BLE001
        text = "".join(traceback.format_exception(exc))
        res = all(s in text for s in SIG)
        why = " ".join(str(exc).split())[-200:]
    print(f"  check {checks[0]}: {size(plan)} -> {'FAILS' if res else 'no'} ({time.time() - t0:.0f}s) {why if not res else ''}",
          flush=True)
    cache[key] = res
    return res


def size(plan):
    ini, bat, aft = plan
    txns = list(ini) + [t for b in bat for t in b[0]] + list(aft)
    return f"{len(txns)} txns, {sum(len(t[1]) for t in txns)} ops, {len(bat)} cycles"


def save(plan, note):
    with open(OUT, "w") as f:
        f.write(f"# {note}; {size(plan)}; {checks[0]} checks\n{NAME} = ")
        f.write(pprint.pformat(plan, width=110))
        f.write("\n")
    print("saved:", note, size(plan), flush=True)


def ddmin(items, test):
    """Zeller's ddmin over a list: test(sublist) -> bool (still fails)."""
    n = 2
    while len(items) >= 2:
        chunk = max(1, len(items) // n)
        subsets = [items[i:i + chunk] for i in range(0, len(items), chunk)]
        reduced = False
        for i in range(len(subsets)):          # complements first: removing a chunk
            comp = [x for j, s in enumerate(subsets) if j != i for x in s]
            if test(comp):
                items, n, reduced = comp, max(n - 1, 2), True
                break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    if len(items) == 1 and test([]):
        items = []
    return items


# -- plan <-> atoms ------------------------------------------------------------------------------------
def txn_atoms(plan):
    ini, bat, aft = plan
    out = [("i", 0, k, t) for k, t in enumerate(ini)]
    out += [("b", bi, k, t) for bi, (txns, _) in enumerate(bat) for k, t in enumerate(txns)]
    return out


def from_txn_atoms(plan, atoms):
    ini, bat, aft = plan
    new_ini = [t for s, _, _, t in atoms if s == "i"]
    new_bat = [([t for s, bi2, _, t in atoms if s == "b" and bi2 == bi], mc) for bi, (_, mc) in enumerate(bat)]
    return (new_ini, new_bat, aft)


def op_atoms(plan):
    return [(ti, oi, o) for ti, (_, _, _, t) in enumerate(txn_atoms(plan)) for oi, o in enumerate(t[1])]


def from_op_atoms(plan, atoms):
    ta = txn_atoms(plan)
    keep = [(s, bi, k, (t[0], [o for ti2, _, o in atoms if ti2 == ti], t[2])) for ti, (s, bi, k, t) in enumerate(ta)]
    keep = [a for a in keep if a[3][1]]
    return from_txn_atoms(plan, keep)


def reduce(plan):
    best = plan
    # 1. cycles: drop one (with its transactions) or merge it into the next; plain list of tries
    changed = True
    while changed:
        changed = False
        ini, bat, aft = best
        for i in range(len(bat)):
            tries = []
            if len(bat) > 1:
                tries.append((ini, bat[:i] + bat[i + 1:], aft))                                   # drop cycle
            if i + 1 < len(bat):
                tries.append((ini, bat[:i] + [(bat[i][0] + bat[i + 1][0], bat[i + 1][1])] + bat[i + 2:], aft))
            if i > 0:
                tries.append((ini, bat[:i - 1] + [(bat[i - 1][0] + bat[i][0], bat[i][1])] + bat[i + 1:], aft))
            for c in tries:
                if fails(c):
                    best, changed = c, True
                    save(best, "cycles")
                    break
            if changed:
                break
    # 2. transactions
    base = best
    atoms = ddmin(txn_atoms(base), lambda a: fails(from_txn_atoms(base, a)))
    best = from_txn_atoms(base, atoms)
    save(best, "transactions")
    # drop cycles that are now empty
    ini, bat, aft = best
    c = (ini, [b for b in bat if b[0]] or bat[-1:], aft)
    if c != best and fails(c):
        best = c
    # 3. operations
    base = best
    atoms = ddmin(op_atoms(base), lambda a: fails(from_op_atoms(base, a)))
    best = from_op_atoms(base, atoms)
    save(best, "operations")
    # 4. simplifications, one at a time
    for _ in range(3):
        progress = False
        for cand in simplifications(best):
            if cand != best and fails(cand):
                best, progress = cand, True
                save(best, "simplified")
        if not progress:
            break
    return best


def simplifications(plan):
    ini, bat, aft = plan
    for i, (txns, mc) in enumerate(bat):
        if mc is not None:
            yield (ini, bat[:i] + [(txns, None)] + bat[i + 1:], aft)
    # merge transactions of a section into one
    yield ([("txn", [o for t in ini for o in t[1]], "commit")] if ini else ini, bat, aft)
    ops = op_atoms(plan)
    for idx, (ti, oi, o) in enumerate(ops):
        for o2 in simpler(o):
            yield from_op_atoms(plan, ops[:idx] + [(ti, oi, o2)] + ops[idx + 1:])


def simpler(o):
    kind = o[0]
    if kind == "savepoint_rollback":
        for k in range(len(o[1])):
            if len(o[1]) > 1:
                yield (kind, o[1][:k] + o[1][k + 1:])
    if kind in ("keychain", "ckeychain") and len(o[1]) > 2:
        for k in range(1, len(o[1]) - 1):
            yield (kind, o[1][:k] + o[1][k + 1:])
        if kind == "ckeychain":
            yield ("ckey", *o[1][0], *o[1][-1])
    if kind in ("cins",):
        if o[5] is not None:
            yield o[:5] + (None,)
        if o[4] is not None and o[4] != "2000-01-01 00:00:00":
            yield o[:4] + ("2000-01-01 00:00:00",) + o[5:]
        if o[3] != 0:
            yield o[:3] + (0,) + o[4:]
    if kind == "bins":
        if o[4] is not None:
            yield o[:4] + (None,) + o[5:]
        if o[5] != 1:
            yield o[:5] + (1,)
    if kind in ("ins", "reins"):
        if o[2] != R.ROW:
            yield (kind, o[1], R.ROW)
        for c in ("big", "bigb"):
            if o[2].get(c) is not None:
                yield (kind, o[1], {**o[2], c: None})
    if kind == "keyset" and len(o[3]) > 1:
        yield (kind, o[1], o[2], dict(list(o[3].items())[:1]))


if __name__ == "__main__":
    try:
        plan = getattr(R, NAME) if len(sys.argv) < 5 else None
        if len(sys.argv) >= 5:                      # seed candidates: a python file defining SEEDS
            ns = {"K": K, "ROW": R.ROW}
            exec(open(sys.argv[4]).read(), ns)
            for s in ns["SEEDS"]:
                if fails(s):
                    plan = s
                    print("seed candidate fails:", size(s), flush=True)
                    break
            if plan is None:
                plan = getattr(R, NAME)
        ini, bat, aft = plan
        plan = (list(ini), [(list(t), mc) for t, mc in bat], [])      # the tail never consolidates
        save(plan, "start")
        best = reduce(plan)
        save(best, "done")
        print("DONE", size(best), "checks", checks[0], flush=True)
    finally:
        spark.stop()
        cluster.stop()
        shutil.rmtree(home, ignore_errors=True)
