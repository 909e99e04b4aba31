"""The ``tidemark`` command line: the same library the DAGs call, for operators and tests.

Streams are found by name in the streams directory (``--streams``, ``TIDEMARK_STREAMS_DIR``, or the
checkout's ``include/streams``). The embedded default keeps its state in ``TIDEMARK_HOME``
(default: ``.tidemark`` in the checkout); ``tidemark db start`` writes the connection variables of
the local cluster to ``$TIDEMARK_HOME/env`` (mode 0600: they carry the password from
``$TIDEMARK_HOME/pg/pgpass``), which every command loads (real environment wins).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

# Every command imports what it runs inside its own function: `tidemark --help` and a command start
# without loading the consolidation, the drain, Delta or psycopg2 (the library's layers: .importlinter).
from tidemark.errors import TidemarkError
from tidemark.lsn import format_lsn

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT = PACKAGE_DIR.parent.parent if (PACKAGE_DIR.parent / "streams").is_dir() else None


# -- environment ---------------------------------------------------------------------------------

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
    from tidemark.local.localpg import LocalCluster

    return LocalCluster(home / "pg")


def write_embedded_env(home: Path, cluster) -> Path:
    """Write the connection variables of the embedded cluster to ``home/env``."""
    env = {
        "AIRFLOW_CONN_TIDEMARK_SOURCE": cluster.uri("demo"),
        "AIRFLOW_CONN_TIDEMARK_CONTROL": cluster.uri("tidemark"),
        "TIDEMARK_HOME": str(home),
    }
    path = home / "env"
    tmp = home / f".env-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the URIs carry the password
    with os.fdopen(fd, "w") as fh:
        fh.write("# written by `tidemark db start` (mode 0600: the URIs carry the password of the local "
                 "PostgreSQL); the real environment takes precedence\n"
                 + "".join(f"{k}={v}\n" for k, v in env.items()))
    os.replace(tmp, path)
    for k, v in env.items():
        os.environ[k] = v  # this process just (re)started the cluster: its port is the truth
    return path


# -- output helpers ----------------------------------------------------------------------------------

class Progress:
    """Print progress on stderr: one rewritten line on a terminal, a line every few seconds otherwise."""

    def __init__(self, label: str, every: float = 5.0):
        self.label = label
        self.every = every
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.started = time.monotonic()

    def __call__(self, info: dict) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last < self.every:
            return
        self.last = now
        text = " ".join(f"{k}={_fmt(v)}" for k, v in info.items())
        if self.tty:
            sys.stderr.write(f"\r{self.label}: {text}\033[K")
        else:
            sys.stderr.write(f"{self.label}: {text}\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _json_default(o: Any) -> Any:
    if isinstance(o, (dt.datetime, dt.date, dt.time)):
        return o.isoformat()
    if isinstance(o, bytes):
        return "\\x" + o.hex()
    if hasattr(o, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(o)
    if hasattr(o, "_asdict"):
        return o._asdict()
    return str(o)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))


# -- stream lookup --------------------------------------------------------------------------------

def find_stream(name: str, streams_dir: Path):
    from tidemark.config import load_config, load_stream_dir

    if name.endswith((".yaml", ".yml")) and Path(name).exists():
        return load_config(name)
    if not streams_dir.is_dir():
        raise TidemarkError(f"streams directory {streams_dir} does not exist (use --streams DIR)")
    for cfg in load_stream_dir(streams_dir):
        if cfg.stream == name:
            return cfg
    raise TidemarkError(f"no stream named {name!r} in {streams_dir} (use --streams DIR or pass the YAML file)")


# -- commands --------------------------------------------------------------------------------------

def cmd_db(args) -> int:
    home = args.home
    cluster = embedded_cluster(home)
    if args.action == "start":
        home.mkdir(parents=True, exist_ok=True)
        cluster.start()
        for db in ("demo", "tidemark", "airflow"):
            cluster.ensure_database(db)
        env = write_embedded_env(home, cluster)
        from tidemark.control import Control

        with Control(cluster.dsn("tidemark")) as ctl:
            ctl.migrate()
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


def cmd_stream(args) -> int:
    if args.action == "apply":
        from tidemark.config import load_config
        from tidemark.capture.source import apply_stream

        cfg = load_config(args.file)
        if cfg.source.is_feed:
            from tidemark.feeds import feed_prefix, register_feed_stream

            register_feed_stream(cfg)
            print(f"stream {cfg.stream}: an external feed of {', '.join(t.qualified for t in cfg.source.tables)}; "
                  f"producers write Materialize CDC files under {feed_prefix(cfg.stream)}TABLE/ in {cfg.landing.url}")
            return 0
        aligned: list[str] = []
        notes: list[str] = []
        state = apply_stream(cfg, aligned=aligned, notes=notes)
        for problem in aligned:
            print(f"aligned: {problem}")
        for note in notes:
            print(f"not captured: {note}")
        print(f"stream {state.name}: publication {state.publication} covers "
              f"{', '.join(t.qualified for t in cfg.source.tables)}; slot {state.slot_name}; state {state.state}")
        if state.consistent_lsn is None:
            print(f"next: tidemark snapshot {state.name}")
            return 0
        from tidemark.capture.snapshot import resnapshot_refiltered

        res = resnapshot_refiltered(cfg)      # a column list or row filter changed: that table is copied again
        if res is not None:
            print(f"re-snapshotted {', '.join(sorted(res.tables))} online (column list or row filter changed): "
                  f"snapshot {res.snapshot_id} at {format_lsn(res.lsn)}; the consolidation that reaches it "
                  "replaces the table's rows")
        return 0
    if args.action == "list":
        from tidemark.config import load_stream_dir
        from tidemark.control import open_control

        rows = []
        for cfg in load_stream_dir(args.streams):
            row = {"stream": cfg.stream, "file": cfg.origin, "tables": len(cfg.source.tables)}
            try:
                with open_control(cfg) as ctl:
                    st = ctl.stream(cfg.stream)
                row.update(state=st.state, landed_upper=format_lsn(st.landed_upper), frontier=format_lsn(st.frontier))
            except TidemarkError as exc:
                row.update(state=f"unregistered ({exc.__class__.__name__})")
            except Exception as exc:  # control database down: still list the configs
                row.update(state=f"unknown: {exc}".splitlines()[0])
            rows.append(row)
        print_table(rows, ["stream", "state", "landed_upper", "frontier", "tables", "file"])
        return 0
    raise AssertionError(args.action)


def cmd_snapshot(args) -> int:
    from tidemark.capture import snapshot
    from tidemark.capture.ranges import describe_copy

    cfg = find_stream(args.stream, args.streams)
    tables = [t for t in args.tables.split(",") if t] if args.tables is not None else None
    progress = Progress(f"snapshot {cfg.stream}")
    result = snapshot.snapshot_stream(cfg, tables=tables, mode=args.mode, chunk_pages=args.chunk_pages,
                                      parallelism=args.parallelism, progress=progress)
    progress.done()
    print(f"snapshot {result.snapshot_id} at {format_lsn(result.lsn)}")
    for table, rows in sorted(result.tables.items()):
        print(f"  {table}: {describe_copy(result.copies.get(table), rows)}")
    for table in result.waiting:
        print(f"  {table}: not copied; its changes wait for its snapshot: tidemark snapshot {cfg.stream} --mode add "
              f"--tables {table}")
    return 0


def cmd_drain(args) -> int:
    from tidemark.capture import drain

    cfg = find_stream(args.stream, args.streams)
    progress = Progress(f"drain {cfg.stream}")
    lsns = ("lsn", "decoded", "target")       # positions as LSNs; "waiting" = seconds without data

    def show(info: dict) -> None:
        progress({k: format_lsn(v) if k in lsns else v for k, v in info.items() if k != "stream"})

    result = drain.drain_stream(cfg, max_changes=args.max_changes, max_bytes=args.max_bytes,
                                progress=None if args.json else show)
    progress.done()
    if args.json:
        print(json.dumps(dataclasses.asdict(result), default=_json_default, indent=1))
        return 0
    for r in result.segments:
        kind = "progress only" if r.empty else f"{r.records:,} records in {r.txns:,} transactions"
        print(f"segment {r.seq} [{format_lsn(r.lower)}, {format_lsn(r.upper)}): {kind}, {r.byte_size:,} bytes -> {r.uri or 'nothing written (empty interval)'}")
    if len(result.segments) > 1:
        print(f"{len(result.segments)} segments [{format_lsn(result.lower)}, {format_lsn(result.upper)}): "
              f"{result.records:,} records in {result.txns:,} transactions, {result.byte_size:,} bytes")
    return 0


def cmd_segments(args) -> int:
    from tidemark.control import open_control

    cfg = find_stream(args.stream, args.streams)
    with open_control(cfg) as ctl:
        segs = ctl.segments(cfg.stream, status=None if args.all else "landed")
    if args.json:
        print(json.dumps([s.__dict__ for s in segs], default=_json_default, indent=1))
        return 0
    rows = [{"seq": s.seq, "lower": format_lsn(s.lower), "upper": format_lsn(s.upper), "records": s.record_count,
             "txns": s.txn_count, "bytes": s.byte_size, "status": s.status, "origin": s.origin,
             "uri": s.uri} for s in segs]
    print_table(rows, ["seq", "lower", "upper", "records", "txns", "bytes", "status", "origin", "uri"])
    return 0


def cmd_status(args) -> int:
    from tidemark.status import storage_lines, stream_status

    cfg = find_stream(args.stream, args.streams)
    status = stream_status(cfg)
    if args.json:
        print(json.dumps(status, default=_json_default, indent=1, sort_keys=True))
        return 0
    for reason in status["freshness"]["late"]:     # first: no incident says it (no job ran to open one)
        print(f"{'LATE':>22}: {reason}")
    worded = {"storage", "storage_error", "write_cost", "subscribers", "last_maintenance"}   # (storage_lines)
    for key in sorted(status):
        value = status[key]
        if key in worded:
            continue
        if key == "incidents":
            for i in value:     # one line each: the same cause repeated is one incident with its count
                print(f"{'incident':>22}: #{i['id']} {i['kind']}{' ' + i['table'] if i.get('table') else ''}, "
                      f"seen {i['count']} time(s), opened {_when(i['opened_at'])}, last seen "
                      f"{_when(i['last_seen_at'])}: {_incident_text(i['detail'])}")
            continue
        if key == "freshness":     # the alarm of DAGs that have not run when their schedules say
            for job in ("drain", "consolidation"):
                print(f"{job + ' freshness':>22}: {_freshness_text(value.get(job))}")
            continue
        if key.endswith(("_lsn", "upper", "frontier", "position")) and isinstance(value, int):
            value = f"{format_lsn(value)} ({value})"
        print(f"{key:>22}: {value}")
    for label, text in storage_lines(status):
        print(f"{label:>22}: {text}")
    return 0


def _freshness_text(check: dict | None) -> str:
    if check is None:
        return "not judged (no snapshot yet, a snapshot running, or a feed's drain)"
    if check["late"]:
        return f"LATE: {check['reason']}"
    if check["age_seconds"] is None:
        return f"ok: nothing waits (allowed {check['allowance_seconds']:.0f} s)"
    return f"ok: last {check['age_seconds']:.0f} s ago (allowed {check['allowance_seconds']:.0f} s)"


def _when(at) -> str:
    return at.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if at is not None else "-"


def _incident_text(detail) -> str:
    if isinstance(detail, dict) and detail.get("reason"):
        return " ".join(str(detail["reason"]).split())
    return json.dumps(detail, default=_json_default)


def cmd_consolidate(args) -> int:
    from tidemark.consolidate import consolidate_stream

    cfg = find_stream(args.stream, args.streams)
    with spark_output_to(Path(os.environ.get("TIDEMARK_HOME") or default_home()) / "logs" / f"spark-{cfg.stream}.log"):
        result = consolidate_stream(cfg)
    print(json.dumps(result, default=_json_default, indent=1))
    return 0


def cmd_maintain(args) -> int:
    from tidemark.maintain import maintain

    cfg = find_stream(args.stream, args.streams)
    print(json.dumps(maintain(cfg).as_dict(), default=_json_default, indent=1))
    return 0


@contextlib.contextmanager
def spark_output_to(path: Path):
    """Send what a Spark JVM started inside writes — its log4j lines, an executor's Java stack trace,
    the tracebacks its Python workers' daemon prints when a failed job's pipes close — to ``path``
    (appended), not to the terminal: the JVM and its workers inherit the process's file descriptor 2,
    which points there while this process's own ``sys.stderr`` (progress, warnings, the error line)
    stays on the terminal. ``TIDEMARK_DEBUG=1``: everything on the terminal."""
    if _debug():
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:        # no log file to write: Spark's output stays where it was
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    before = sys.stderr
    sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)       # a JVM started meanwhile keeps the log file as its stderr
        os.close(saved)
        sys.stderr.close()
        sys.stderr = before


def cmd_spark_cds(args) -> int:
    from tidemark import cds

    print(f"building the Spark class-data-sharing archive ({cds.archive_path()}); about a minute...",
          file=sys.stderr, flush=True)
    print(json.dumps(cds.build(force=args.force), indent=1))
    return 0


def cmd_read(args) -> int:
    from tidemark import lake

    cfg = find_stream(args.stream, args.streams)
    if args.as_of is not None:  # as the source held it at a commit position or time
        from tidemark.lake.history import read_table_at

        table = read_table_at(cfg, args.table, args.as_of)
    elif args.at_frontier:      # as of the stream frontier: every table of a batch at the same frontier
        from tidemark.control import open_control

        with open_control(cfg) as ctl:
            frontier = ctl.stream(cfg.stream).frontier
        if frontier is None:
            raise TidemarkError(f"stream {cfg.stream} has no frontier yet (nothing consolidated)")
        table = lake.read_table(cfg, args.table, frontier=frontier)
    else:
        table = lake.read_table(cfg, args.table)
    if args.limit is not None:
        table = table.slice(0, args.limit)
    rows = table.to_pylist()
    if args.format == "jsonl":
        for row in rows:
            sys.stdout.write(json.dumps(row, default=_json_default, ensure_ascii=False) + "\n")
    else:
        writer = csv.writer(sys.stdout)
        writer.writerow(table.column_names)
        for row in rows:
            writer.writerow([_csv_value(row[c]) for c in table.column_names])
    return 0


def cmd_history(args) -> int:
    from tidemark.lake.history import key_history

    cfg = find_stream(args.stream, args.streams)
    key = {}
    for item in args.key:
        column, sep, value = item.partition("=")
        if not sep or not column:
            raise TidemarkError(f"--key {item!r}: write COLUMN=VALUE (e.g. --key id=42)")
        key[column] = value
    versions = key_history(cfg, args.table, key)
    if args.format == "jsonl":
        for v in versions:
            sys.stdout.write(json.dumps(v, default=_json_default, ensure_ascii=False) + "\n")
        return 0
    if not versions:
        print(f"no version of {', '.join(f'{k}={v}' for k, v in key.items())} in {args.table}")
        return 0
    meta = ["_valid_from_lsn", "_valid_to_lsn", "_valid_from", "_valid_to", "_is_current", "_deleted"]
    columns = [c for c in versions[0] if c not in meta]
    rows = [{**{c: _csv_value(v[c]) for c in columns}, "valid_from": format_lsn(v["_valid_from_lsn"]),
             "valid_to": format_lsn(v["_valid_to_lsn"]) if v["_valid_to_lsn"] is not None else "(current)",
             "from_time": _when(v["_valid_from"]) if v["_valid_from"] else "", "to_time": _when(v["_valid_to"]) if
             v["_valid_to"] else "", "ended_by": "delete" if v["_deleted"] else ("" if v["_is_current"] else "update")}
            for v in versions]
    print_table(rows, ["valid_from", "valid_to", "from_time", "to_time", "ended_by", *columns])
    return 0


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, (list, dict)):
        return json.dumps(v, default=_json_default)
    if isinstance(v, bytes):
        return "\\x" + v.hex()
    return v


def cmd_gaps(args) -> int:
    from tidemark import gaps

    cfg = find_stream(args.stream, args.streams)
    report = gaps.detect(cfg)
    print(json.dumps(report, default=_json_default, indent=1))
    if args.repair:
        print(json.dumps(gaps.repair(cfg, report), default=_json_default, indent=1))
    elif args.resend:
        print(json.dumps(gaps.resend(cfg), default=_json_default, indent=1))
    return 0


def cmd_sweep(args) -> int:
    from tidemark import gaps

    cfg = find_stream(args.stream, args.streams)
    print(json.dumps(gaps.sweep(cfg), default=_json_default, indent=1))
    return 0


def cmd_incidents(args) -> int:
    from tidemark.control import open_control

    cfg = find_stream(args.stream, args.streams)
    with open_control(cfg) as ctl:
        rows = ctl.incidents(cfg.stream, open_only=not args.all)
    for r in rows:
        print(json.dumps(r, default=_json_default))
    if not rows:
        print("no open incidents" if not args.all else "no incidents")
    return 0


def cmd_parity(args) -> int:
    from tidemark.control import open_control
    from tidemark.parity import moved_since, parity_report

    cfg = find_stream(args.stream, args.streams)
    with open_control(cfg) as ctl:
        frontier = ctl.stream(cfg.stream).frontier
    report = parity_report(cfg)
    _print_parity(report)
    differ = sorted(t for t, r in report.items() if not r["equal"])
    if differ:
        moved = moved_since(cfg, frontier, differ)
        past = [t for t in differ if moved[t]]
        unknown = [t for t in differ if moved[t] is None]
        if past:
            print(f"note: the source has moved past the frontier {format_lsn(frontier)} for {', '.join(past)}: "
                  "changes after the frontier are not in the lake yet (drain and consolidate, then compare again)")
        if unknown:
            print(f"note: whether {', '.join(unknown)} changed after the frontier {format_lsn(frontier)} cannot be "
                  "told now (the slot is in use by a drain); compare again after the next consolidation")
        still = [t for t in differ if moved[t] is False]
        if still:
            print(f"MISMATCH at the frontier: {', '.join(still)} did not change in the source after "
                  f"{format_lsn(frontier)}, yet the lake differs; see `tidemark incidents {cfg.stream} --all`")
    return 0 if not differ else 1


def _print_parity(report: dict) -> None:
    rows = [{"table": t, "source_rows": r["source_rows"], "lake_rows": r["lake_rows"],
             "checksums": "equal" if r["source_checksum"] == r["lake_checksum"] else "DIFFERENT",
             "parity": ("ok" if not r.get("not_captured") else "ok on the captured columns; not captured: "
                        + ", ".join(f"{c} (generated)" for c in r["not_captured"])) if r["equal"] else "MISMATCH"}
            for t, r in sorted(report.items())]
    print_table(rows, ["table", "source_rows", "lake_rows", "checksums", "parity"])


def cmd_workload(args) -> int:
    from tidemark.local import demo

    cfg = find_stream(args.stream, args.streams)
    from tidemark.capture.source import source_dsn

    done = demo.run_workload(source_dsn(cfg), transactions=args.transactions, seconds=args.seconds, seed=args.seed)
    print("committed: " + ", ".join(f"{v} {k}" for k, v in sorted(done.items())))
    return 0


def cmd_airflow(args) -> int:
    """Run the ``airflow`` command line with the embedded default's environment."""
    import subprocess

    from tidemark.local import embedded

    return subprocess.run([embedded.airflow_bin(), *args.args], env=embedded.cli_env(args.home)).returncode


def cmd_demo(args) -> int:
    """The embedded default: snapshot, workload, drain, consolidate, parity; then Airflow (unless headless)."""
    from tidemark.local import demo
    from tidemark.local import embedded
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
    _print_parity(report)
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
    from tidemark.landing.segments import read_segment
    from tidemark.landing.store import read_uri

    per_table: dict[str, dict[str, int]] = {}
    for r in results:
        if r.uri is None:  # an empty interval writes nothing
            continue
        content = read_segment(read_uri(r.uri), r.uri)
        for u in content.updates:
            t = per_table.setdefault(u.table.qualified, {"+1": 0, "-1": 0})
            t["+1" if u.diff > 0 else "-1"] += 1
        for e in content.events:
            per_table.setdefault(e.table, {"+1": 0, "-1": 0})[e.kind] = per_table.get(e.table, {}).get(e.kind, 0) + 1
    for table, counts in sorted(per_table.items()):
        print(f"  {table}: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))


def cmd_subscriber(args) -> int:
    from tidemark import subscribers

    cfg = find_stream(args.stream, args.streams)
    if args.action == "list":
        rows = subscribers.list_subscribers(cfg)
        if args.name:
            rows = [r for r in rows if r["name"] == args.name]
        print_table([{**r, "checkpoint": format_lsn(r["checkpoint"] or 0)} for r in rows],
                    ["name", "checkpoint", "lag_bytes", "lagging", "updated_at"])
        return 0
    if not args.name:
        raise subscribers.SubscriberError(f"tidemark subscriber {args.action} needs STREAM NAME")
    if args.action == "add":
        print(json.dumps(subscribers.add_subscriber(cfg, args.name, from_frontier=args.from_frontier)))
    else:
        subscribers.drop_subscriber(cfg, args.name)
    return 0


def cmd_changes(args) -> int:
    """Every change since the subscriber's checkpoint; acknowledged (``--ack``) only once written."""
    from tidemark import subscribers

    cfg = find_stream(args.stream, args.streams)
    changes = subscribers.read_changes(cfg, args.subscriber, max_transactions=args.max_transactions)
    if args.format == "jsonl":
        for tx in changes.transactions():
            sys.stdout.write(json.dumps({"lsn": format_lsn(tx["time"]), **tx}, default=_json_default) + "\n")
        sys.stdout.flush()
    else:
        import pyarrow as pa

        if args.out is None:
            raise subscribers.SubscriberError("--format arrow needs --out DIR (one Arrow IPC file per table)")
        args.out.mkdir(parents=True, exist_ok=True)
        for table, rows in changes.tables.items():
            path = args.out / f"{table}.arrow"
            with pa.OSFile(str(path) + ".tmp", "wb") as sink, pa.ipc.new_file(sink, rows.schema) as w:
                w.write_table(rows)
            os.replace(str(path) + ".tmp", path)
        (args.out / "changes.json").write_text(json.dumps({"lower": changes.lower, "upper": changes.upper,
                                                           "tables": sorted(changes.tables)}))
    acked = subscribers.ack(cfg, args.subscriber, changes.upper) if args.ack else None
    print(json.dumps({"stream": cfg.stream, "subscriber": args.subscriber, "lower": changes.lower,
                      "upper": changes.upper, "changes": changes.num_changes, "acknowledged": acked}), file=sys.stderr)
    return 0


def cmd_feed(args) -> int:
    from tidemark import feeds

    cfg = find_stream(args.stream, args.streams)
    if args.action == "ingest":
        print(json.dumps(feeds.ingest(cfg), default=_json_default, indent=1))
        return 0
    if args.table is None or args.time is None:
        raise feeds.FeedError("tidemark feed forget needs STREAM TABLE TIME")
    print(json.dumps(feeds.forget(cfg, args.table, args.time, args.reason), default=_json_default))
    return 0


# -- parser -----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidemark", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", type=Path, default=None, help="state of the embedded default (TIDEMARK_HOME)")
    p.add_argument("--streams", type=Path, default=None, help="directory of stream YAML files (TIDEMARK_STREAMS_DIR)")
    p.add_argument("--debug", action="store_true", help="print an error's traceback and Spark's own output "
                                                        "(its log otherwise goes to $TIDEMARK_HOME/logs; TIDEMARK_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("db", cmd_db, "the embedded default's local PostgreSQL (wal_level=logical)")
    sp.add_argument("action", choices=["start", "stop", "status", "env"])
    sp = add("stream", cmd_stream, "validate and register streams")
    sp.add_argument("action", choices=["apply", "list"])
    sp.add_argument("file", nargs="?", help="stream YAML (for apply)")
    sp = add("snapshot", cmd_snapshot, "take a consistent snapshot (creates the slot), or snapshot tables added "
                                       "to a running stream (--mode add)")
    sp.add_argument("stream")
    sp.add_argument("--tables", default=None, help="comma-separated subset; empty string: slot only")
    sp.add_argument("--mode", choices=["initial", "resend", "add", "table"], default="initial",
                    help="initial: the first snapshot, creates the slot (tables added to a running stream and "
                         "waiting for their snapshot are taken as with add); resend: every table at a new "
                         "consistent point (with --tables and the slot intact: as table); add: tables added to a "
                         "running stream, copied at a new consistent point of their own while the stream goes "
                         "on; table: tables the stream captures, copied again that way, the lake corrected "
                         "there (the changelog records the difference)")
    sp.add_argument("--chunk-pages", type=int, default=None)
    sp.add_argument("--parallelism", type=int, default=None)
    sp = add("drain", cmd_drain, "drain the slot into segments, whole transactions only")
    sp.add_argument("stream")
    sp.add_argument("--max-changes", type=int, default=None, help="a segment's size in changes (not the run's)")
    sp.add_argument("--max-bytes", type=int, default=None, help="a segment's size in WAL bytes read (not the run's)")
    sp.add_argument("--json", action="store_true", help="print the run's result (its segments under 'segments')")
    sp = add("segments", cmd_segments, "list the segment manifest")
    sp.add_argument("stream")
    sp.add_argument("--all", action="store_true", help="include forgotten and quarantined segments")
    sp.add_argument("--json", action="store_true")
    sp = add("status", cmd_status, "positions, metrics and slot lag of a stream")
    sp.add_argument("stream")
    sp.add_argument("--json", action="store_true")
    sp = add("consolidate", cmd_consolidate, "consolidate landed segments into the lake")
    sp.add_argument("stream")
    sp = add("maintain", cmd_maintain, "compact, checkpoint and vacuum the stream's lake tables (keeping what "
                                       "lake.retention can read) and delete landing files below the floor")
    sp.add_argument("stream")
    sp = add("spark-cds", cmd_spark_cds, "build the class-data-sharing archive that makes a new Spark JVM start "
             "faster (once per JDK and Spark installation; TIDEMARK_SPARK_CDS=off to not use it)")
    sp.add_argument("--force", action="store_true", help="build it again even if it exists")
    sp = add("read", cmd_read, "print a lake table")
    sp.add_argument("stream")
    sp.add_argument("table")
    sp.add_argument("--format", choices=["csv", "jsonl"], default="csv")
    sp.add_argument("--limit", type=int, default=None)
    sp.add_argument("--at-frontier", action="store_true",
                    help="read the table as of the stream frontier (ignores commits of a batch that failed part-way; an external feed's table otherwise reads at its own frontier)")
    sp.add_argument("--as-of", default=None, metavar="LSN|TIME",
                    help="the table as the source held it right after the commit at this LSN (16/B374D848), or "
                         "at this time (2026-11-24T10:00:00Z: the last commit at or before it)")
    sp = add("history", cmd_history, "the versions of one key of a table (SCD type 2, from the changelog)")
    sp.add_argument("stream")
    sp.add_argument("table")
    sp.add_argument("--key", action="append", required=True, metavar="COLUMN=VALUE",
                    help="a key column and its value; repeat for a composite key")
    sp.add_argument("--format", choices=["table", "jsonl"], default="table")
    sp = add("gaps", cmd_gaps, "detect gaps (and repair or resend)")
    sp.add_argument("stream")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--repair", action="store_true")
    g.add_argument("--resend", action="store_true")
    sp = add("sweep", cmd_sweep, "register or quarantine segments written but never registered")
    sp.add_argument("stream")
    sp = add("incidents", cmd_incidents, "list a stream's incidents")
    sp.add_argument("stream")
    sp.add_argument("--all", action="store_true")
    sp = add("parity", cmd_parity, "compare each lake table with its source table (rows and checksum)")
    sp.add_argument("stream")
    sp = add("workload", cmd_workload, "run the demo workload generator against a stream's source")
    sp.add_argument("stream")
    sp.add_argument("--transactions", type=int, default=200)
    sp.add_argument("--seconds", type=float, default=None, help="run for this long instead of a count")
    sp.add_argument("--seed", type=int, default=None)
    sp = add("subscriber", cmd_subscriber, "add, list or drop a subscriber (a reader of changes with a checkpoint)")
    sp.add_argument("action", choices=["add", "list", "drop"])
    sp.add_argument("stream")
    sp.add_argument("name", nargs="?")
    sp.add_argument("--from-frontier", action="store_true", help="start at the current frontier, not at 0")
    sp = add("changes", cmd_changes, "the changes since a subscriber's checkpoint, whole transactions, up to the frontier")
    sp.add_argument("stream")
    sp.add_argument("--subscriber", required=True)
    sp.add_argument("--format", choices=["jsonl", "arrow"], default="jsonl")
    sp.add_argument("--out", type=Path, default=None, help="directory for --format arrow")
    sp.add_argument("--max-transactions", type=int, default=None)
    sp.add_argument("--ack", action="store_true", help="move the checkpoint to the upper once written")
    sp = add("feed", cmd_feed, "an external feed: ingest the producers' Materialize CDC files, or forget a time")
    sp.add_argument("action", choices=["ingest", "forget"])
    sp.add_argument("stream")
    sp.add_argument("table", nargs="?")
    sp.add_argument("time", nargs="?", type=int)
    sp.add_argument("--reason", default="given up by the operator")
    sp = add("airflow", cmd_airflow, "run the airflow command line against the embedded default "
                                     "(e.g. tidemark airflow dags list)")
    sp.add_argument("args", nargs=argparse.REMAINDER)
    sp = add("demo", cmd_demo, "run the embedded default: PostgreSQL, demo stream, snapshot, drain, consolidate, Airflow")
    sp.add_argument("--headless", action="store_true", help="run the flow once and print a parity report")
    sp.add_argument("--stop", action="store_true", help="stop everything the demo started")
    sp.add_argument("--transactions", type=int, default=300)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    args.home = (args.home or default_home()).resolve()
    os.environ.setdefault("TIDEMARK_HOME", str(args.home))
    load_env_file(args.home / "env")
    args.streams = args.streams or default_streams_dir()
    try:
        return args.fn(args) or 0
    except KeyboardInterrupt:
        print("tidemark: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - said as the error's message, never as a traceback
        print_error(exc)
        return 2 if isinstance(exc, TidemarkError) else 1


DEBUG_ENV = "TIDEMARK_DEBUG"


def _debug() -> bool:
    """``TIDEMARK_DEBUG`` set (not 0/false/no/off): tracebacks and Spark's own output on the terminal."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def print_error(exc: BaseException, out=None) -> None:
    """An error as an operator reads it (`tidemark.errors.describe`): one line of what failed and
    where, the remedy on a line of its own, no traceback — unless ``TIDEMARK_DEBUG`` is set (then the
    traceback follows). An error Tidemark did not raise on purpose is its type and first meaningful
    line (a PySpark exception's own error, not its Java or Python frames)."""
    import traceback

    from tidemark.errors import describe

    out = out or sys.stderr
    what, remedy = describe(exc)
    print(f"tidemark: error: {what}", file=out)
    if remedy:
        print(f"tidemark: remedy: {remedy}", file=out)
    if _debug():
        traceback.print_exception(exc, file=out)
    elif not isinstance(exc, TidemarkError):
        print(f"tidemark: (not an error Tidemark names: {DEBUG_ENV}=1 prints its traceback)", file=out)
    out.flush()


if __name__ == "__main__":
    sys.exit(main())
