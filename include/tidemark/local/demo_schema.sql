-- The demo shop schema: the tables `tidemark demo` creates (tidemark.local.demo.load_demo_schema) and the
-- compose stack's source database runs first on an empty data directory (docker-compose.yaml mounts this
-- file into /docker-entrypoint-initdb.d). Idempotent.
DO $$ BEGIN
    CREATE TYPE order_status AS ENUM ('new', 'paid', 'shipped', 'cancelled');
EXCEPTION WHEN duplicate_object THEN NULL; END $$;

CREATE TABLE IF NOT EXISTS customers (
    id          bigserial PRIMARY KEY,
    name        text NOT NULL,
    email       text,
    balance     numeric(12, 2) NOT NULL DEFAULT 0,
    tags        text[],
    profile     jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS orders (
    id           bigserial PRIMARY KEY,
    customer_id  bigint NOT NULL REFERENCES customers(id) ON DELETE CASCADE ON UPDATE CASCADE,
    status       order_status NOT NULL DEFAULT 'new',
    total        numeric(12, 2) NOT NULL DEFAULT 0,
    placed_on    date NOT NULL DEFAULT current_date,
    notes        text
);

CREATE TABLE IF NOT EXISTS order_items (
    order_id  bigint NOT NULL REFERENCES orders(id) ON DELETE CASCADE,
    line_no   integer NOT NULL,
    sku       varchar(32) NOT NULL,
    qty       smallint NOT NULL,
    price     numeric(10, 2) NOT NULL,
    PRIMARY KEY (order_id, line_no)
);

CREATE TABLE IF NOT EXISTS audit_log (
    at       timestamptz NOT NULL DEFAULT now(),
    kind     text NOT NULL,
    payload  jsonb
);
ALTER TABLE audit_log REPLICA IDENTITY FULL;
