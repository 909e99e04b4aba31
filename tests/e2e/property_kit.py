"""The property-based oracle's workload: random transactions over tables that together cover every
type the capture supports, as plain data (a *plan*) that hypothesis generates and shrinks, and an
executor that runs a plan against a real PostgreSQL database.

A plan is a list of steps: ``("txn", ops, end)`` — a transaction of operations ending in ``commit``
or ``rollback`` (an operation may be ``("savepoint_rollback", ops)``: ops undone by ROLLBACK TO
SAVEPOINT) — or ``("cycle", max_changes)``: drain to the source's position in segments of at most
``max_changes`` row changes, consolidate, and compare every lake table with the source.

Every operation runs under its own savepoint, so one that fails in PostgreSQL (a duplicate key, a
domain check) is undone alone and the plan goes on: the source stays the oracle whatever it did.
"""

from __future__ import annotations

from hypothesis import strategies as st

SETUP = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy', 'very happy');
CREATE DOMAIN posint AS int CHECK (VALUE > 0);
CREATE TABLE typed (
    id int PRIMARY KEY,
    ts timestamp, tstz timestamptz, n numeric(12, 3), nn numeric, f8 float8, f4 float4, bo bool,
    c char(5), iv interval, e mood, dm posint, arr int[], tarr text[], j jsonb, js json, by bytea,
    big text, bigb bytea);
ALTER TABLE typed ALTER COLUMN big SET STORAGE EXTERNAL;
ALTER TABLE typed ALTER COLUMN bigb SET STORAGE EXTERNAL;
CREATE TABLE comp (a int, b text, w int, ts timestamp, big text, PRIMARY KEY (a, b));
ALTER TABLE comp ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE bag (x int, y text, tstz timestamptz, big text);
ALTER TABLE bag ALTER COLUMN big SET STORAGE EXTERNAL;
ALTER TABLE bag REPLICA IDENTITY FULL;
"""
TABLES = ["public.typed", "public.comp", "public.bag"]
IDS = st.integers(0, 6)

# -- values: the edge cases of each type, as SQL literals (text) or Python values ---------------------
TS = st.sampled_from(["2000-01-01 00:00:00", "1999-12-31 23:59:59.999999", "infinity", "-infinity",
                      "0044-03-15 12:00:00 BC", "2026-11-22 16:57:27.123456", None])
TSTZ = st.sampled_from(["2000-01-01 00:00:00+00", "2020-06-30 23:30:00-07:30", "infinity", "-infinity",
                        "0001-01-01 00:00:00+00 BC", None])
NUM = st.sampled_from(["0", "-0.001", "123456789.125", "-999999999.999", None])
NUMU = st.sampled_from(["0", "NaN", "1e-30", "-123456789012345678901234567890.123456789", "3.14", None])
F8 = st.sampled_from([0.0, -0.0, 1.5, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324, None])
F4 = st.sampled_from([0.0, -0.0, 0.1, float("nan"), float("inf"), float("-inf"), 3.4e38, None])
BOOL = st.sampled_from([True, False, None])
CHAR = st.sampled_from(["ab", "abcde", "", " x", None])
IV = st.sampled_from(["0", "1 day", "-1 mon 2 days 03:04:05.5", "1 year 2 mons", "-00:00:00.000001", None])
ENUM = st.sampled_from(["sad", "ok", "happy", "very happy", None])
DOM = st.sampled_from([1, 7, 2147483647, None])
ARR = st.sampled_from([[1, None, 3], [], [-2147483648], None])
TARR = st.sampled_from([["a", None, "b c"], ['q"uote', "back\\slash", "{}"], [], None])
JSON = st.sampled_from(['{"a": 1, "b": [true, null]}', '[]', '"x"', '{"k": "ü\\u00e9"}', 'null', None])
BYTES = st.sampled_from([b"", b"\x00\x01\xff", b"\\x", None])
# TOASTed values: above the ~2 kB threshold, kept out of line (STORAGE EXTERNAL); a seed makes them distinct
def big(seed: int) -> str:
    return f"big{seed}-" + "abcdefghij" * 300


def bigb(seed: int) -> bytes:
    return bytes([seed]) * 4000


BIG = st.integers(-1, 9).map(lambda s: None if s < 0 else big(s))
BIGB = st.integers(-1, 9).map(lambda s: None if s < 0 else bigb(s))

TYPED_COLS = ["ts", "tstz", "n", "nn", "f8", "f4", "bo", "c", "iv", "e", "dm", "arr", "tarr", "j", "js", "by",
              "big", "bigb"]
TYPED_VALUES = [TS, TSTZ, NUM, NUMU, F8, F4, BOOL, CHAR, IV, ENUM, DOM, ARR, TARR, JSON, JSON, BYTES, BIG, BIGB]
SMALL_COLS = TYPED_COLS[:-2]          # every column but the TOASTed ones


def typed_row():
    return st.tuples(*TYPED_VALUES).map(lambda vs: dict(zip(TYPED_COLS, vs)))


def some_columns():
    """A non-empty subset of the non-TOAST columns with new values (an update that leaves TOAST alone)."""
    return st.lists(st.sampled_from(range(len(SMALL_COLS))), min_size=1, max_size=4, unique=True).flatmap(
        lambda idx: st.tuples(*[TYPED_VALUES[i] for i in idx]).map(
            lambda vs, idx=idx: {SMALL_COLS[i]: v for i, v in zip(idx, vs)}))


def weighted(*choices):
    """One of the strategies, picked with the given integer weights (``st.one_of`` flattens nested
    one_ofs and weighs every leaf alike, so it cannot make an operation rare or common)."""
    pool = [s for w, s in choices for _ in range(w)]
    return st.integers(0, len(pool) - 1).flatmap(lambda i: pool[i])


FRESH = st.integers(10, 40)             # keys no seed uses: a chain through them is not undone by a collision
B = st.sampled_from(["x", "y"])
# a -> b -> c ...: from a key that may exist, through fresh keys
TYPED_CHAIN = st.tuples(IDS, st.lists(FRESH, min_size=2, max_size=4, unique=True)).map(lambda t: [t[0], *t[1]])
COMP_CHAIN = st.tuples(st.tuples(st.integers(0, 3), B),
                       st.lists(st.tuples(FRESH, B), min_size=2, max_size=4, unique=True)).map(lambda t: [t[0], *t[1]])


def typed_op():
    return weighted(
        (3, st.tuples(st.just("ins"), IDS, typed_row())),
        (3, st.tuples(st.just("upd"), IDS, some_columns())),                        # TOAST untouched
        (2, st.tuples(st.just("upd"), IDS, st.fixed_dictionaries({"big": BIG}))),   # TOAST changed
        (3, st.tuples(st.just("key"), IDS, st.one_of(IDS, FRESH))),                 # key change, TOAST untouched
        (2, st.tuples(st.just("keyset"), IDS, st.one_of(IDS, FRESH), some_columns())),  # key change + other values
        (3, st.tuples(st.just("keychain"), TYPED_CHAIN)),      # one row's key changed again and again
        (2, st.tuples(st.just("del"), IDS)),
        (2, st.tuples(st.just("reins"), IDS, typed_row())),                          # delete + re-insert the key
    )


def comp_op():
    return weighted(
        (3, st.tuples(st.just("cins"), st.integers(0, 3), B, st.integers(-5, 5), TS, BIG)),
        (2, st.tuples(st.just("cupd"), st.integers(0, 3), B, st.integers(-5, 5))),
        (2, st.tuples(st.just("ckey"), st.integers(0, 3), B, st.integers(0, 3), B)),
        (2, st.tuples(st.just("ckeychain"), COMP_CHAIN)),
        (1, st.tuples(st.just("cdel"), st.integers(0, 3), B)),
    )


def bag_op():
    return weighted(
        (2, st.tuples(st.just("bins"), st.integers(0, 2), st.sampled_from(["d", "e"]), TSTZ, BIG, st.integers(1, 2))),
        (2, st.tuples(st.just("bupd"), st.integers(0, 2), st.sampled_from(["u", None]))),   # TOAST untouched
        (1, st.tuples(st.just("bdel"), st.integers(0, 2))),
    )


TRUNC = st.tuples(st.just("trunc"), st.sampled_from(["typed", "comp", "bag"]))


def op():
    return weighted((6, typed_op()), (3, comp_op()), (2, bag_op()))


def txn():
    item = weighted((16, op()), (2, st.tuples(st.just("savepoint_rollback"), st.lists(op(), min_size=1, max_size=3))),
                    (1, TRUNC))
    return st.tuples(st.just("txn"), st.lists(item, min_size=1, max_size=8),
                     st.sampled_from(["commit", "commit", "commit", "commit", "rollback"]))


def chain_links():
    """The operations of one row's chain of key changes (TOAST untouched), each link its own operation;
    half of the time the row is inserted first (in the batch), else it is a row the lake may hold."""
    def typed(t):
        chain, row = t
        return ([] if row is None else [("ins", chain[0], row)]) + [("key", a, b) for a, b in zip(chain, chain[1:])]

    def comp(t):
        chain, row = t
        return (([] if row is None else [("cins", *chain[0], *row)])
                + [("ckey", *a, *b) for a, b in zip(chain, chain[1:])])

    return st.one_of(st.tuples(TYPED_CHAIN, st.none() | typed_row()).map(typed),
                     st.tuples(COMP_CHAIN, st.none() | st.tuples(st.integers(-5, 5), TS, BIG)).map(comp))


@st.composite
def batch(draw):
    """A run of transactions then a cycle (drain in segments of at most N changes, consolidate). Often
    one row's key changes again and again across the batch's transactions: each link a committed
    transaction of its own, interleaved with the others (a link's old key is the previous link's new
    key, whose unchanged TOASTed values the batch does not carry)."""
    txns = draw(st.lists(txn(), min_size=1, max_size=10))
    links = draw(st.one_of(st.just([]), chain_links()))
    at = sorted(draw(st.lists(st.integers(0, len(txns)), min_size=len(links), max_size=len(links))))
    for i, (pos, link) in enumerate(zip(at, links)):
        txns.insert(pos + i, ("txn", [link], "commit"))
    return txns, draw(st.sampled_from([None, None, 7, 40]))


def seed_txn():
    """Rows (with TOASTed values) for the snapshot, so the first batch changes rows the lake holds."""
    typed = st.tuples(st.just("ins"), IDS, typed_row())
    comp = st.tuples(st.just("cins"), st.integers(0, 3), B, st.integers(-5, 5), TS, BIG)
    bag = st.tuples(st.just("bins"), st.integers(0, 2), st.sampled_from(["d", "e"]), TSTZ, BIG, st.integers(1, 2))
    return st.tuples(st.just("txn"), st.lists(st.one_of(typed, typed, comp, bag), min_size=1, max_size=8),
                     st.just("commit"))


def plan():
    """(initial transactions before the snapshot, batches, transactions after the last cycle)."""
    return st.tuples(st.lists(st.one_of(seed_txn(), txn()), min_size=1, max_size=4),
                     st.lists(batch(), min_size=1, max_size=3), st.lists(txn(), max_size=3))


# -- execution --------------------------------------------------------------------------------------

def _sql_typed_values(row: dict) -> list:
    import psycopg2

    out = []
    for c in TYPED_COLS:
        v = row.get(c)
        out.append(psycopg2.Binary(v) if isinstance(v, bytes) else v)
    return out


CASTS = {"ts": "timestamp", "tstz": "timestamptz", "n": "numeric", "nn": "numeric", "f8": "float8", "f4": "float4",
         "bo": "bool", "c": "char(5)", "iv": "interval", "e": "mood", "dm": "posint", "arr": "int[]", "tarr": "text[]",
         "j": "jsonb", "js": "json", "by": "bytea", "big": "text", "bigb": "bytea"}


def _set_clause(values: dict):
    from psycopg2 import sql

    return sql.SQL(", ").join(sql.SQL("{} = %s::" + CASTS[c]).format(sql.Identifier(c)) for c in values)


def _params(values: dict) -> list:
    import psycopg2

    return [psycopg2.Binary(v) if isinstance(v, bytes) else v for v in values.values()]


INSERT_TYPED = ("INSERT INTO typed (id, " + ", ".join(TYPED_COLS) + ") VALUES (%s, "
                + ", ".join("%s::" + CASTS[c] for c in TYPED_COLS) + ")")


def run_op(cur, o) -> None:
    from psycopg2 import sql

    kind = o[0]
    if kind == "ins":
        cur.execute(INSERT_TYPED, [o[1], *_sql_typed_values(o[2])])
    elif kind == "upd":
        cur.execute(sql.SQL("UPDATE typed SET {} WHERE id = %s").format(_set_clause(o[2])), [*_params(o[2]), o[1]])
    elif kind == "key":
        cur.execute("UPDATE typed SET id = %s WHERE id = %s", (o[2], o[1]))
    elif kind == "keyset":
        cur.execute(sql.SQL("UPDATE typed SET id = %s, {} WHERE id = %s").format(_set_clause(o[3])),
                    [o[2], *_params(o[3]), o[1]])
    elif kind == "keychain":           # one row's key changed again and again, TOAST untouched
        for old, new in zip(o[1], o[1][1:]):
            cur.execute("UPDATE typed SET id = %s WHERE id = %s", (new, old))
    elif kind == "del":
        cur.execute("DELETE FROM typed WHERE id = %s", (o[1],))
    elif kind == "reins":
        cur.execute("DELETE FROM typed WHERE id = %s", (o[1],))
        cur.execute(INSERT_TYPED, [o[1], *_sql_typed_values(o[2])])
    elif kind == "trunc":
        cur.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(o[1])))
    elif kind == "cins":
        cur.execute("INSERT INTO comp VALUES (%s, %s, %s, %s::timestamp, %s)", o[1:])
    elif kind == "cupd":
        cur.execute("UPDATE comp SET w = %s WHERE a = %s AND b = %s", (o[3], o[1], o[2]))
    elif kind == "ckey":
        cur.execute("UPDATE comp SET a = %s, b = %s WHERE a = %s AND b = %s", (o[3], o[4], o[1], o[2]))
    elif kind == "ckeychain":          # a composite key changed again and again, TOAST untouched
        for (a, b), (a2, b2) in zip(o[1], o[1][1:]):
            cur.execute("UPDATE comp SET a = %s, b = %s WHERE a = %s AND b = %s", (a2, b2, a, b))
    elif kind == "cdel":
        cur.execute("DELETE FROM comp WHERE a = %s AND b = %s", (o[1], o[2]))
    elif kind == "bins":
        cur.execute("INSERT INTO bag SELECT %s, %s, %s::timestamptz, %s FROM generate_series(1, %s)", o[1:])
    elif kind == "bupd":
        cur.execute("UPDATE bag SET y = %s WHERE ctid = (SELECT min(ctid) FROM bag WHERE x = %s)", (o[2], o[1]))
    elif kind == "bdel":
        cur.execute("DELETE FROM bag WHERE ctid = (SELECT min(ctid) FROM bag WHERE x = %s)", (o[1],))
    else:
        raise AssertionError(f"unknown operation {o!r}")


def run_txn(conn, t, counter: list[int]) -> None:
    """One transaction of the plan; each operation under its own savepoint (a failing one is undone alone)."""
    import psycopg2

    _, items, end = t
    with conn.cursor() as cur:
        cur.execute("BEGIN")

        def guarded(o):
            counter[0] += 1
            name = f"op{counter[0]}"
            cur.execute(f"SAVEPOINT {name}")
            try:
                if o[0] == "savepoint_rollback":
                    for inner in o[1]:
                        guarded(inner)
                    cur.execute(f"ROLLBACK TO SAVEPOINT {name}")
                else:
                    run_op(cur, o)
                cur.execute(f"RELEASE SAVEPOINT {name}")
            except psycopg2.Error:
                cur.execute(f"ROLLBACK TO SAVEPOINT {name}")
                cur.execute(f"RELEASE SAVEPOINT {name}")

        for o in items:
            guarded(o)
        cur.execute("COMMIT" if end == "commit" else "ROLLBACK")


def _op_table(o) -> str | None:
    kind = o[0]
    if kind == "trunc":
        return f"public.{o[1]}"
    if kind == "savepoint_rollback":
        return None                        # undone
    if kind.startswith("c"):
        return "public.comp"
    if kind.startswith("b"):
        return "public.bag"
    return "public.typed"


def touched_tables(txns) -> set[str]:
    """Tables a committed transaction of ``txns`` may have changed (an upper bound)."""
    out = set()
    for _, items, end in txns:
        if end == "commit":
            out |= {t for t in map(_op_table, items) if t}
    return out
