"""The embedded default: where the command line keeps its state (``TIDEMARK_HOME``, the streams directory,
``$TIDEMARK_HOME/env``: the local PostgreSQL's connection variables) and its commands: that PostgreSQL,
the demo (snapshot, workload, drain, consolidate, parity, then Airflow), the workload generator, Airflow's."""

from __future__ import annotations

import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

from tidemark.cli.output import Progress
from tidemark.cli.show import print_parity
from tidemark.errors import TidemarkError
from tidemark.lsn import format_lsn

PACKAGE_DIR = Path(__file__).resolve().parents[1]       # include/tidemark
CHECKOUT = PACKAGE_DIR.parent.parent if (PACKAGE_DIR.parent / "streams").is_dir() else None


def default_home() -> Path:
    if os.environ.get("TIDEMARK_HOME"):
        return Path(os.environ["TIDEMARK_HOME"]).resolve()
    if CHECKOUT is not None:
        return CHECKOUT / ".tidemark"
    return Path.home() / ".tidemark"


def default_streams_dir() -> Path:
    if os.environ.get("TIDEMARK_STREAMS_DIR"):
        return Path(os.environ["TIDEMARK_STREAMS_DIR"])
    if CHECKOUT is not None:
        return CHECKOUT / "include" / "streams"
    return Path.cwd() / "streams"


def load_env_file(path: Path) -> None:
    """Set ``KEY=VALUE`` lines of ``path`` into the environment unless already set."""
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            os.environ.setdefault(key.strip(), value.strip())


def embedded_cluster(home: Path):
    # deferred: the command line loads only the command it runs (this one starts or stops PostgreSQL)
    from tidemark.local.localpg import LocalCluster

    return LocalCluster(home / "pg")


def write_embedded_env(home: Path, cluster) -> Path:
    """Write the connection variables of the embedded cluster to ``home/env``."""
    from tidemark.local.localpg import replace_private   # deferred: the command line loads only the command it runs

    env = {"AIRFLOW_CONN_TIDEMARK_SOURCE": cluster.uri("demo"),
           "AIRFLOW_CONN_TIDEMARK_CONTROL": cluster.uri("tidemark"), "TIDEMARK_HOME": str(home)}
    path = home / "env"
    replace_private(path, "# written by `tidemark db start` (mode 0600: the URIs carry the password of the local "
                          "PostgreSQL); the real environment takes precedence\n"
                    + "".join(f"{k}={v}\n" for k, v in env.items()))
    os.environ.update(env)  # this process just (re)started the cluster: its port is the truth
    return path


def cmd_db(args) -> int:
    home = args.home
    cluster = embedded_cluster(home)
    if args.action == "start":
        from tidemark.local.embedded import prepare   # deferred: the command line loads only the command it runs

        cluster = prepare(home)     # the cluster started, its databases created, the control schema migrated
        env = write_embedded_env(home, cluster)
        print(f"PostgreSQL {cluster.datadir} on 127.0.0.1:{cluster.port} (wal_level=logical)")
        print(f"databases: demo (source), tidemark (control), airflow (metadata); connections in {env}")
    elif args.action == "stop":
        cluster.stop()
        print("PostgreSQL stopped")
    elif args.action == "status":
        running = cluster.running()
        print(f"PostgreSQL {cluster.datadir}: {'running on 127.0.0.1:' + str(cluster.port) if running else 'stopped'}")
        return 0 if running else 3
    elif args.action == "env":
        print((home / "env").read_text() if (home / "env").exists() else "", end="")
    return 0


def cmd_workload(args) -> int:
    # deferred: the command line loads only the command it runs
    from tidemark.local import demo
    from tidemark.capture.source import source_dsn

    done = demo.run_workload(source_dsn(args.cfg), transactions=args.transactions, seconds=args.seconds,
                             seed=args.seed)
    print("committed: " + ", ".join(f"{v} {k}" for k, v in sorted(done.items())))
    return 0


def cmd_airflow(args) -> int:
    """Run the ``airflow`` command line with the embedded default's environment."""
    import subprocess

    from tidemark.local import embedded   # deferred: the command line loads only the command it runs

    return subprocess.run([embedded.airflow_bin(), *args.args], env=embedded.cli_env(args.home)).returncode


def cmd_demo(args) -> int:
    """The embedded default: snapshot, workload, drain, consolidate, parity; then Airflow (unless headless)."""
    # deferred: the command line loads only the command it runs
    from tidemark.local import demo, embedded
    from tidemark.config import load_config
    from tidemark.consolidate import consolidate_stream
    from tidemark.capture.drain import drain_stream
    from tidemark.capture.snapshot import snapshot_stream
    from tidemark.capture.source import apply_stream

    home = args.home
    if args.stop:
        stopped = embedded.down(home)
        embedded_cluster(home).stop()
        print(f"stopped: {', '.join(stopped + ['postgresql'])}; nothing is left running")
        return 0
    if embedded.running(home):
        if args.headless:
            raise TidemarkError("the embedded Airflow is running and drains the demo stream itself; "
                                "stop it first (make demo-stop) to run the headless flow")
        _print_airflow(embedded.up(home))
        return 0
    args.action = "start"
    cmd_db(args)
    source_dsn = embedded_cluster(home).dsn("demo")
    demo.load_demo_schema(source_dsn)
    cfg = load_config(demo.DEMO_STREAM_YAML)
    state = apply_stream(cfg)
    print(f"stream {cfg.stream}: {', '.join(t.qualified for t in cfg.source.tables)}")
    if state.consistent_lsn is None:
        progress = Progress("snapshot")
        res = snapshot_stream(cfg, progress=progress)
        progress.done()
        print(f"snapshot at {format_lsn(res.lsn)}: " + ", ".join(f"{t} {n:,} rows" for t, n in sorted(res.tables.items())))
    done = demo.run_workload(source_dsn, transactions=args.transactions)
    print("workload: " + ", ".join(f"{v} {k}" for k, v in sorted(done.items())))
    result = drain_stream(cfg)
    for r in result.segments:
        print(f"landed segment {r.seq} [{format_lsn(r.lower)}, {format_lsn(r.upper)}): {r.records:,} records, "
              f"{r.txns:,} transactions -> {r.uri}")
    _print_landed_summary(result.segments)
    res = consolidate_stream(cfg)
    print(f"consolidated up to frontier {format_lsn(res.frontier_after)}: "
          + ", ".join(f"{t} v{v}" for t, v in sorted(res.versions.items())))
    report = embedded.parity_report(cfg)
    print("parity of the lake with the source (row counts and content checksums):")
    print_parity(report)
    if not all(r["equal"] for r in report.values()):
        print("tidemark: error: the lake differs from the source", file=sys.stderr)
        return 1
    if args.headless:
        return 0
    print("starting Airflow (api-server, scheduler, dag-processor, triggerer) …", flush=True)
    _print_airflow(embedded.up(home))
    return 0


def _print_airflow(info: dict) -> None:
    print(f"Airflow UI: {info.get('ui_url')}  user: {info.get('username')}  password: {info.get('password')}")
    print("the demo stream's DAGs are unpaused: drain every minute, consolidate on new segments")
    print("make changes:  .venv/bin/tidemark workload demo --seconds 30")
    print("compare:       .venv/bin/tidemark parity demo")
    print("stop all:      make demo-stop")


def _print_landed_summary(results) -> None:
    # deferred: the command line loads only the command it runs
    from tidemark.landing.segments import read_segment_at

    per_table: dict[str, Counter] = defaultdict(lambda: Counter({"+1": 0, "-1": 0}))
    for r in results:
        if r.uri is None:  # an empty interval writes nothing
            continue
        content = read_segment_at(r.uri)
        for u in content.updates:
            per_table[u.table.qualified]["+1" if u.diff > 0 else "-1"] += 1
        for e in content.events:
            per_table[e.table][e.kind] += 1
    for table, counts in sorted(per_table.items()):
        print(f"  {table}: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
