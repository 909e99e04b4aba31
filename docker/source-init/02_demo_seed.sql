-- Seed rows of the compose stack's source database (run once by the postgres image's entrypoint on an
-- empty data directory, as POSTGRES_USER in POSTGRES_DB, after 01_demo_schema.sql, which is the package's
-- include/tidemark/local/demo_schema.sql mounted in). Changes: the `workload` service (compose profile
-- `workload`) or `docker compose run --rm workload`.

-- seed: 200 customers, about 300 orders with their items
INSERT INTO customers (name, email, balance, tags, profile)
SELECT 'Customer ' || g, 'customer' || g || '@example.com', (g * 37 % 100000) / 100.0,
       CASE WHEN g % 3 = 0 THEN ARRAY['vip'] WHEN g % 3 = 1 THEN ARRAY['new', 'eu'] ELSE NULL END,
       jsonb_build_object('tier', 1 + g % 3, 'newsletter', g % 2 = 0)
  FROM generate_series(1, 200) g;
INSERT INTO orders (customer_id, status, total, placed_on, notes)
SELECT 1 + g % 200, (ARRAY['new', 'paid', 'shipped', 'cancelled']::order_status[])[1 + g % 4], 0,
       current_date - g % 900, CASE WHEN g % 2 = 0 THEN repeat('note ', 1 + g * 13 % 4000) END
  FROM generate_series(1, 300) g;
INSERT INTO order_items (order_id, line_no, sku, qty, price)
SELECT o.id, l, 'SKU-' || lpad((1 + (o.id * 7 + l) % 59)::text, 4, '0'), 1 + (o.id + l) % 5, (100 + o.id * l % 9900) / 100.0
  FROM orders o, generate_series(1, 1 + o.id % 4) l;
UPDATE orders o SET total = s.total
  FROM (SELECT order_id, sum(qty * price) AS total FROM order_items GROUP BY order_id) s WHERE s.order_id = o.id;
