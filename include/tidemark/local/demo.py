"""The demo: a small shop schema with the awkward cases CDC must get right, and a workload.

Tables: ``customers`` (arrays, jsonb, numeric, timestamptz), ``orders`` (an enum, a date, a large
TOAST-able ``notes`` column that most updates leave untouched), ``order_items`` (a composite primary
key), and ``audit_log`` (no primary key, REPLICA IDENTITY FULL: a multiset).
"""

from __future__ import annotations

import random
import time
from contextlib import closing
from pathlib import Path

import psycopg2

SCHEMA_SQL = (Path(__file__).with_name("demo_schema.sql")).read_text()

DEMO_TABLES = ["public.customers", "public.orders", "public.order_items", "public.audit_log"]

DEMO_STREAM_YAML = Path(__file__).resolve().parents[2] / "streams" / "demo.yaml"

_NAMES = ["Ada", "Grace", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Margaret", "Niklaus", "Radia"]
_SKUS = [f"SKU-{i:04d}" for i in range(1, 60)]


def load_demo_schema(dsn: str, *, customers: int = 200, seed: int = 7) -> None:
    """Create the demo tables (idempotent) and seed them if empty."""
    rng = random.Random(seed)
    with closing(psycopg2.connect(dsn)) as conn:
        with conn, conn.cursor() as cur:
            cur.execute(SCHEMA_SQL)
            cur.execute("SELECT count(*) FROM customers")
            if cur.fetchone()[0] == 0:
                for _ in range(customers):
                    _insert_customer(cur, rng)
                cur.execute("SELECT id FROM customers")
                for (cid,) in cur.fetchall():
                    for _ in range(rng.randint(0, 3)):
                        _insert_order(cur, rng, cid)


def _insert_customer(cur, rng: random.Random) -> None:
    name = f"{rng.choice(_NAMES)} {rng.randint(1, 9999)}"
    cur.execute(
        """INSERT INTO customers (name, email, balance, tags, profile)
           VALUES (%s, %s, %s, %s, %s::jsonb) RETURNING id""",
        (name, f"{name.split()[0].lower()}{rng.randint(1, 10**6)}@example.com",
         f"{rng.randint(0, 10**6) / 100:.2f}", rng.sample(["vip", "new", "b2b", "eu", "us", "late"], rng.randint(0, 3)),
         f'{{"tier": {rng.randint(1, 3)}, "newsletter": {str(rng.random() < 0.5).lower()}}}'),
    )


def _insert_order(cur, rng: random.Random, customer_id: int) -> None:
    notes = None if rng.random() < 0.5 else ("note " * rng.randint(1, 4000))  # large ones are TOASTed
    cur.execute("INSERT INTO orders (customer_id, total, notes, placed_on) VALUES (%s, 0, %s, current_date - %s) "
                "RETURNING id", (customer_id, notes, rng.randint(0, 900)))
    order_id = cur.fetchone()[0]
    total = 0.0
    for line in range(1, rng.randint(1, 4) + 1):
        qty, price = rng.randint(1, 5), rng.randint(100, 99999) / 100
        total += qty * price
        cur.execute("INSERT INTO order_items VALUES (%s, %s, %s, %s, %s)",
                    (order_id, line, rng.choice(_SKUS), qty, f"{price:.2f}"))
    cur.execute("UPDATE orders SET total = %s WHERE id = %s", (f"{total:.2f}", order_id))


def _one_transaction(cur, rng: random.Random) -> str:
    """Run one random business transaction; return its kind."""
    r = rng.random()
    if r < 0.25:
        _insert_customer(cur, rng)
        return "new customer"
    cur.execute("SELECT id FROM customers ORDER BY random() LIMIT 1")
    row = cur.fetchone()
    if row is None:
        _insert_customer(cur, rng)
        return "new customer"
    cid = row[0]
    if r < 0.55:
        _insert_order(cur, rng, cid)
        cur.execute("INSERT INTO audit_log (kind, payload) VALUES ('order', %s::jsonb)", (f'{{"customer": {cid}}}',))
        return "new order"
    if r < 0.80:
        # status change: leaves the TOASTed notes untouched
        cur.execute("""UPDATE orders SET status = (ARRAY['paid','shipped','cancelled']::order_status[])[1 + floor(random()*3)::int]
                        WHERE id = (SELECT id FROM orders WHERE customer_id = %s ORDER BY random() LIMIT 1)""", (cid,))
        return "order status"
    if r < 0.90:
        cur.execute("UPDATE customers SET balance = balance + %s, tags = array_append(tags, 'touched') WHERE id = %s",
                    (f"{rng.randint(-500, 500)}.{rng.randint(0, 99):02d}", cid))
        return "balance"
    if r < 0.95:
        cur.execute("DELETE FROM customers WHERE id = %s", (cid,))  # cascades to orders and items
        cur.execute("INSERT INTO audit_log (kind, payload) VALUES ('delete', %s::jsonb)", (f'{{"customer": {cid}}}',))
        return "delete customer"
    cur.execute("UPDATE customers SET id = id + 1000000 WHERE id = %s AND id < 1000000", (cid,))  # key change
    return "rekey customer"


def run_workload(dsn: str, *, transactions: int = 200, seconds: float | None = None, seed: int | None = None,
                 rollback_ratio: float = 0.05) -> dict[str, int]:
    """Run random business transactions (a few rolled back); return how many of each kind committed."""
    rng = random.Random(seed)
    done: dict[str, int] = {}
    deadline = time.monotonic() + seconds if seconds else None
    with closing(psycopg2.connect(dsn)) as conn:
        n = 0
        while (deadline is None and n < transactions) or (deadline is not None and time.monotonic() < deadline):
            n += 1
            with conn.cursor() as cur:
                kind = _one_transaction(cur, rng)
            if rng.random() < rollback_ratio:
                conn.rollback()
                kind = "rolled back"
            else:
                conn.commit()
            done[kind] = done.get(kind, 0) + 1
    return done
