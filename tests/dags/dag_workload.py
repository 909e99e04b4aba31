"""The two tables both DAG tests stream, their seed rows, and one round of changes to them."""

from __future__ import annotations

import json

TABLES = ["public.items", "public.events"]
SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int, price numeric(10,2), tags text[],
                    at timestamptz DEFAULT '2024-01-01 00:00:00+00', notes text);
CREATE TABLE events (kind text NOT NULL, payload jsonb);
ALTER TABLE events REPLICA IDENTITY FULL;
INSERT INTO items SELECT g, 'item ' || g, g % 7, g * 1.25, ARRAY['t' || g % 3],
                         '2024-01-01'::timestamptz + g * interval '1 hour', repeat('x', 3000)
                    FROM generate_series(1, 60) g;
INSERT INTO events SELECT 'seed', jsonb_build_object('n', g) FROM generate_series(1, 10) g;
"""


def workload(conn, round_: int) -> None:
    """Inserts, updates (TOAST left unchanged), deletes and multiset changes in several transactions."""
    base = 1000 * (round_ + 1)
    with conn.cursor() as cur:
        cur.execute("INSERT INTO items (id, name, qty, price, tags) SELECT %s + g, 'new ' || g, g, g * 0.5, "
                    "ARRAY['n'] FROM generate_series(1, 20) g", (base,))
        cur.execute("UPDATE items SET qty = qty + 1, price = price + 0.01 WHERE id %% 5 = %s", (round_ % 5,))
        cur.execute("DELETE FROM items WHERE id IN (SELECT id FROM items ORDER BY id LIMIT 3)")
        cur.execute("INSERT INTO events VALUES ('round', %s), ('round', %s)",
                    (json.dumps({"r": round_}), json.dumps({"r": round_})))
        cur.execute("DELETE FROM events WHERE ctid = (SELECT ctid FROM events WHERE kind = 'seed' LIMIT 1)")
