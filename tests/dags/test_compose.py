"""docker-compose.yaml: validated offline with Debian's docker-compose (Docker cannot run here),
plus structural checks on the resolved file: start order gated by health checks, no secrets, pinned
images, every variable in .env.example, a shared volume the Airflow user can write, the Dockerfile's
steps (read, not built), and the source's init SQL run against the test cluster."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from airflow_env import ROOT

COMPOSE = ROOT / "docker-compose.yaml"
SECRETS = ["AIRFLOW_DB_PASSWORD", "SOURCE_DB_PASSWORD", "CONTROL_DB_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY",
           "AIRFLOW_FERNET_KEY", "AIRFLOW_JWT_SECRET", "AIRFLOW_API_SECRET_KEY"]
AIRFLOW = ["airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"]
BINARY = shutil.which("docker-compose")
needs_binary = pytest.mark.skipif(BINARY is None, reason="docker-compose binary not installed "
                                  "(apt-get install -y docker-compose); the offline validation cannot run")


def compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([BINARY, "-f", str(COMPOSE), *args], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))


@pytest.fixture(scope="module")
def resolved() -> dict:
    if BINARY is None:
        pytest.skip("docker-compose binary not installed")
    proc = compose("config", env={k: f"test-{k.lower()}" for k in SECRETS})
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@needs_binary
def test_compose_file_validates_offline():
    proc = compose("config", "-q", env={k: f"test-{k.lower()}" for k in SECRETS})
    assert proc.returncode == 0, proc.stderr


@needs_binary
@pytest.mark.parametrize("missing", SECRETS)
def test_compose_refuses_to_start_without_each_secret(missing):
    proc = compose("config", "-q", env={k: "x" for k in SECRETS if k != missing})
    assert proc.returncode != 0
    assert missing in proc.stderr


def test_no_secret_is_written_in_the_file():
    raw = yaml.safe_load(COMPOSE.read_text())
    found = []

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, str) and re.search(r"PASSWORD|SECRET|ACCESS_KEY|FERNET", str(k)):
                    if not re.fullmatch(r"\$\{[A-Z0-9_]+:\?[^}]*\}", v):
                        found.append(f"{path}.{k}")
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
    walk(raw, "")
    assert found == []
    uris = re.findall(r"postgresql(?:\+psycopg2)?://[^:@/\s]+:(.*?)@", COMPOSE.read_text())
    assert len(uris) >= 3
    for password in uris:
        assert re.fullmatch(r"\$\{[A-Z0-9_]+:\?[^}]*\}", password), f"credential {password!r} in a URI"


def test_services_and_start_order(resolved):
    services = resolved["services"]
    assert set(AIRFLOW + ["airflow-init", "airflow-db", "source-db", "control-db", "spark-master", "spark-worker",
                          "minio"]) <= set(services)
    for name in AIRFLOW:
        svc = services[name]
        deps = svc["depends_on"]
        assert deps["airflow-init"]["condition"] == "service_completed_successfully", name
        assert deps["airflow-db"]["condition"] == "service_healthy", name
        assert deps["source-db"]["condition"] == "service_healthy", name
        assert svc["environment"]["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert svc["environment"]["AIRFLOW_CONN_SPARK_DEFAULT"] == "spark://spark-master:7077"
        assert svc["environment"]["AIRFLOW_CONN_TIDEMARK_SOURCE"].startswith("postgresql://")
        assert "healthcheck" in svc, name
    assert services["airflow-scheduler"]["depends_on"]["spark-master"]["condition"] == "service_healthy"
    assert services["spark-worker"]["depends_on"]["spark-master"]["condition"] == "service_healthy"
    for name in ("airflow-db", "source-db", "control-db", "minio", "spark-master", "spark-worker"):
        assert "healthcheck" in services[name], name
    assert "wal_level=logical" in services["source-db"]["command"]


def test_spark_runs_the_same_image_as_airflow(resolved):
    services = resolved["services"]
    image = services["airflow-scheduler"]["image"]
    assert services["spark-master"]["image"] == image == services["spark-worker"]["image"]
    assert (ROOT / "docker" / "Dockerfile").exists()


# -- the stack runs: pinned images, every variable listed, writable volumes, an initialised source --------

SERVICE_IMAGE = "tidemark-airflow"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENV_EXAMPLE = ROOT / ".env.example"


def _compose_variables() -> set[str]:
    return set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", COMPOSE.read_text()))  # $${X}: the container's own


def _mounts(svc: dict) -> dict[str, str]:
    """target -> source of a resolved service's volumes (short "src:dst:mode" or long form)."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        out[target] = source
    return out


def _example_variables() -> list[str]:
    return [ln.split("=", 1)[0] for ln in ENV_EXAMPLE.read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def test_every_image_is_pinned(resolved):
    for name, svc in resolved["services"].items():
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: {image} is not pinned"
        if repo.endswith("postgres"):
            assert re.fullmatch(r"\d+\.\d+", tag), f"{name}: {image} names a major version only"
    airflow_pin = re.search(r"^apache-airflow==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert resolved["services"]["airflow-scheduler"]["image"] == f"{SERVICE_IMAGE}:{airflow_pin}-tidemark"


def test_env_example_lists_every_variable_and_no_value():
    names = _example_variables()
    assert sorted(names) == sorted(_compose_variables())
    assert sorted(names) == sorted(SECRETS)
    assert all(ln.endswith("=") for ln in ENV_EXAMPLE.read_text().splitlines() if ln and not ln.startswith("#"))


@needs_binary
def test_compose_env_script_writes_a_private_env_that_the_stack_accepts(tmp_path):
    import stat

    from cryptography.fernet import Fernet

    out = tmp_path / ".env"
    run = [sys.executable, str(ROOT / "scripts" / "compose_env.py"), "--out", str(out)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    values = dict(ln.split("=", 1) for ln in out.read_text().splitlines() if ln and not ln.startswith("#"))
    assert sorted(values) == sorted(_example_variables())
    assert len(set(values.values())) == len(values) and all(len(v) >= 14 for v in values.values())
    assert not any(v in proc.stdout for v in values.values())           # names only, never the values
    Fernet(values["AIRFLOW_FERNET_KEY"].encode())                        # a valid key
    assert compose("--env-file", str(out), "config", "-q", env={}).returncode == 0
    assert subprocess.run(run, capture_output=True, text=True, timeout=30).returncode == 1   # never overwrites
    empty = compose("--env-file", str(ENV_EXAMPLE), "config", "-q", env={})
    assert empty.returncode != 0 and "set " in empty.stderr             # the example alone does not start


def test_the_shared_volume_is_writable_by_the_airflow_user(resolved):
    services = resolved["services"]
    init = services["tidemark-volume-init"]
    assert str(init["user"]) == "0:0"
    assert "chown -R 50000:0 /opt/tidemark" in " ".join(init["command"])
    assert _mounts(init) == {"/opt/tidemark": "tidemark-data"}
    users = {}
    for name, svc in services.items():
        mounts = {t: src for t, src in _mounts(svc).items() if src == "tidemark-data"}
        if not mounts or name == "tidemark-volume-init":
            continue
        assert list(mounts) == ["/opt/tidemark"]
        assert svc["depends_on"]["tidemark-volume-init"]["condition"] == "service_completed_successfully", name
        users[name] = str(svc.get("user", "image default (airflow, uid 50000)"))
    assert set(AIRFLOW) | {"spark-master", "spark-worker"} <= set(users)
    assert {users[n] for n in AIRFLOW} == {"50000:0"}
    assert services["workload"]["profiles"] == ["workload"]
    assert "tidemark.cli workload demo" in " ".join(services["workload"]["command"])


def test_dockerfile_steps():
    """Docker cannot build here: read the Dockerfile's steps and check what they rely on."""
    text = DOCKERFILE.read_text()
    steps = [ln.strip() for ln in re.sub(r"\\\n\s*", " ", text).splitlines() if ln.strip() and not ln.startswith("#")]
    airflow_pin = re.search(r"^apache-airflow==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert steps[0] == f"FROM apache/airflow:{airflow_pin}-python3.11"
    runs = [s for s in steps if s.startswith("RUN ")]
    assert any("openjdk-17-jre-headless" in r for r in runs)
    assert any("mkdir -p /opt/tidemark" in r and "chown -R 50000:0 /opt/tidemark" in r for r in runs)
    pip = next(r for r in runs if "-r /tmp/requirements.txt" in r)
    assert "--force-reinstall --no-deps" in pip and "pyspark==" in pip   # pyspark repaired after pyspark-client
    assert any("pip install" in r and "-e /opt/airflow/include" in r for r in runs)
    for step in steps:
        if step.startswith("COPY "):
            source = step.split()[-2]
            assert (ROOT / source).exists(), f"{step}: {source} is not in the checkout"
    # the user switches back to airflow before installing Python packages
    assert steps.index("USER airflow") < steps.index(pip)


def test_the_source_init_sql_creates_the_demo_schema(resolved, pg_cluster, monkeypatch):
    """Run the scripts mounted into /docker-entrypoint-initdb.d with psql as the postgres image's entrypoint does, then compare the
    schema with the demo's own and check the compose stack's demo stream file against it."""
    import psycopg2

    from tidemark.config import load_config, validate_against_source
    from tidemark.local.demo import load_demo_schema, run_workload

    mounts = _mounts(resolved["services"]["source-db"])
    scripts = {target: Path(source) for target, source in mounts.items()
               if target.startswith("/docker-entrypoint-initdb.d/")}
    assert scripts["/docker-entrypoint-initdb.d/01_demo_schema.sql"] == ROOT / "include" / "tidemark" / "local" / \
        "demo_schema.sql"
    db, reference = f"initsql_{secrets.token_hex(3)}", f"initref_{secrets.token_hex(3)}"
    dsn, ref_dsn = pg_cluster.ensure_database(db), pg_cluster.ensure_database(reference)
    try:
        for _, script in sorted(scripts.items()):          # the entrypoint runs them in name order
            proc = subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-X", "-q", "-d", db, "-f", str(script)],
                                  env={**os.environ, **pg_cluster.libpq_env()}, capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, proc.stderr
        load_demo_schema(ref_dsn, customers=5)
        assert _catalog(dsn) == _catalog(ref_dsn)

        monkeypatch.setenv("TIDEMARK_S3_ENDPOINT", "http://minio:9000")
        cfg = load_config(ROOT / "docker" / "streams" / "demo.yaml")
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            validate_against_source(cfg, conn)
            counts = {}
            for ref in cfg.source.tables:
                cur.execute(f"SELECT count(*) FROM {ref.schema}.{ref.name}")
                counts[ref.name] = cur.fetchone()[0]
            cur.execute("""SELECT count(*) FROM orders o WHERE total <> (SELECT COALESCE(sum(qty * price), 0)
                             FROM order_items i WHERE i.order_id = o.id)""")
            assert cur.fetchone()[0] == 0
        assert counts["customers"] == 200 and counts["orders"] == 300 and counts["order_items"] > 300
        done = run_workload(dsn, transactions=20, seed=1)                   # what the workload service runs
        assert sum(done.values()) > 0
    finally:
        conn = psycopg2.connect(pg_cluster.dsn())
        conn.autocommit = True
        with conn.cursor() as cur:
            for name in (db, reference):
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


def _catalog(dsn: str) -> dict:
    import psycopg2

    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("""SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                              pg_get_expr(d.adbin, d.adrelid), c.relreplident
                         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public'
                         JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                         LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
                        WHERE c.relkind = 'r' ORDER BY 1, 2""")
        columns = cur.fetchall()
        cur.execute("""SELECT conrelid::regclass::text, contype, pg_get_constraintdef(oid) FROM pg_constraint
                        WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2, 3""")
        constraints = cur.fetchall()
        cur.execute("SELECT enumlabel FROM pg_enum WHERE enumtypid = 'order_status'::regtype ORDER BY enumsortorder")
        labels = cur.fetchall()
    return {"columns": columns, "constraints": constraints, "order_status": labels}
