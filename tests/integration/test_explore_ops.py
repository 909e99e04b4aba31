"""Operating a stream as a new user does (real PostgreSQL): what the command line and the status say
after the steps the manual names, and what it says about bad input."""

from __future__ import annotations

import datetime as dt
import json
import os

import pyarrow as pa
import pytest
import yaml

from tidemark import cli
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import apply_stream
from tidemark.config import parse_config
from tidemark.control import Control, control_dsn
from tidemark.status import stream_status

from oracle import drain_until_current


def _with_tables(cfg, tables):
    doc = cfg.as_dict()
    doc["source"]["tables"] = list(tables)
    return parse_config(doc, origin="<test>")


def _state(cfg) -> str:
    with Control(control_dsn(cfg)) as ctl:
        return ctl.stream(cfg.stream).state


def test_a_per_table_snapshot_leaves_the_stream_capturing_and_its_freshness_judged(make_stream, source_conn):
    """`snapshot --mode add` and `--mode table` (and `stream apply`'s re-snapshot of a refiltered table,
    the resend step's of one table) left the stream 'snapshotting' for good: `tidemark status` and the
    status page said so, and the freshness alarm, not judged while a snapshot runs, was off for ever."""
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.a (id int PRIMARY KEY, v text); CREATE TABLE public.b (id int PRIMARY KEY)")
        cur.execute("INSERT INTO public.a VALUES (1, 'x'); INSERT INTO public.b VALUES (1)")
    only_a = make_stream(["public.a"])
    snapshot_stream(only_a)
    drain_until_current(only_a)
    assert _state(only_a) == "capturing"
    both = _with_tables(only_a, ["public.a", "public.b"])
    apply_stream(both)
    snapshot_stream(both, tables=["public.b"], mode="add")
    assert _state(both) == "capturing"
    snapshot_stream(both, tables=["public.a"], mode="table")
    assert _state(both) == "capturing"
    status = stream_status(both)
    assert status["state"] == "capturing"
    assert status["freshness"]["drain"] is not None and status["freshness"]["consolidation"] is not None

    # a stream an earlier Tidemark left 'snapshotting' so captures again after its next per-table snapshot
    with Control(control_dsn(both)) as ctl, ctl.tx() as cur:
        cur.execute("UPDATE tidemark.streams SET state = 'snapshotting' WHERE name = %s", (both.stream,))
    snapshot_stream(both, tables=["public.b"], mode="table")
    assert _state(both) == "capturing"


def _stream_file(tmp_path, cfg, name: str | None = None) -> None:
    folder = tmp_path / "streams"
    folder.mkdir(exist_ok=True)
    (folder / f"{name or cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))


def test_a_broken_stream_file_does_not_stop_the_other_streams_commands(tmp_path, make_stream, source_conn, capsys):
    """Every command that takes a stream read the whole streams directory and failed on the first
    broken file, whichever stream it was asked about (Airflow leaves that file out and goes on)."""
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.a (id int PRIMARY KEY)")
    cfg = make_stream(["public.a"])
    apply_stream(cfg)
    _stream_file(tmp_path, cfg)
    (tmp_path / "streams" / "aaa_typo.yaml").write_text("stream: other\nsnapshto: {}\n")
    folder = str(tmp_path / "streams")
    assert cli.main(["--streams", folder, "segments", cfg.stream]) == 0
    capsys.readouterr()
    # a stream in no valid file: the broken files are named (it may be in one of them)
    assert cli.main(["--streams", folder, "segments", "other"]) == 2
    err = capsys.readouterr().err
    assert "no stream named 'other'" in err and "aaa_typo.yaml: snapshto: unknown key" in err, err
    # stream list lists the valid streams, names the broken file and says so in its exit code
    assert cli.main(["--streams", folder, "stream", "list"]) == 2
    out = capsys.readouterr()
    assert cfg.stream in out.out and "new" in out.out.split(cfg.stream, 1)[1].splitlines()[0]
    assert "aaa_typo.yaml: snapshto: unknown key" in out.err
    # two files of one stream: which is meant is not guessed
    _stream_file(tmp_path, cfg, name="zzz_copy")
    assert cli.main(["--streams", folder, "segments", cfg.stream]) == 2
    assert f"'{cfg.stream}' is also defined in" in capsys.readouterr().err


def test_a_control_database_that_refuses_the_login_is_named_by_every_command(make_stream, source_conn, monkeypatch,
                                                                            tmp_path, capsys):
    """Only `stream apply` named the control database's connection; `status`, `segments`, `read
    --at-frontier`, ... printed libpq's bare OperationalError as "not an error Tidemark names" (exit 1)."""
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.a (id int PRIMARY KEY)")
    cfg = make_stream(["public.a"])
    apply_stream(cfg)
    _stream_file(tmp_path, cfg)
    env = f"AIRFLOW_CONN_{cfg.control_connection.upper()}"
    uri = os.environ[env]
    user, rest = uri.split("://", 1)[1].split("@", 1)
    monkeypatch.setenv(env, f"postgresql://{user.split(':')[0]}:wrong-password@{rest}")
    for command in (["status", cfg.stream], ["segments", cfg.stream], ["incidents", cfg.stream],
                    ["read", cfg.stream, "public.a", "--at-frontier"]):
        assert cli.main(["--streams", str(tmp_path / "streams"), *command]) == 2, command
        err = capsys.readouterr().err
        assert (f"stream {cfg.stream}: cannot connect to the control database (connection "
                f"'{cfg.control_connection}'" in err and "password authentication failed" in err
                and f"fix the login or password of connection '{cfg.control_connection}' ({env}" in err), err
        assert "not an error Tidemark names" not in err and "Traceback" not in err


def test_reads_by_name_and_key_on_a_stream_of_quoted_tables(tmp_path, make_stream, source_conn, spark, capsys):
    """The manual's reads on tables whose names need quoting: `snapshot --tables` split a quoted name
    at its comma, a name that is no table of the stream was 'not a Delta table (nothing consolidated
    yet?)' under a mangled directory name, `history --key id=abc` printed pyarrow's ArrowInvalid (exit
    1), and a time still to come read as the last commit."""
    with source_conn.cursor() as cur:
        cur.execute('CREATE SCHEMA "Sales"; CREATE TABLE "Sales"."Order Items" ("Order ID" int, "Line" int, qty int, '
                    'PRIMARY KEY ("Order ID", "Line")); CREATE TABLE public."x,y" (id int PRIMARY KEY, v text)')
        cur.execute('INSERT INTO "Sales"."Order Items" SELECT g, 1, g FROM generate_series(1, 5) g; '
                    "INSERT INTO public.\"x,y\" SELECT g, 'v' || g FROM generate_series(1, 5) g")
        cur.execute('CREATE TABLE public."a/../b" (id int PRIMARY KEY); INSERT INTO public."a/../b" VALUES (7)')
    cfg = make_stream(['"Sales"."Order Items"', 'public."x,y"', 'public."a/../b"'])
    _stream_file(tmp_path, cfg)
    run = ["--streams", str(tmp_path / "streams")]
    assert cli.main([*run, "snapshot", cfg.stream]) == 0
    with source_conn.cursor() as cur:
        cur.execute('UPDATE "Sales"."Order Items" SET qty = 20 WHERE "Order ID" = 2; UPDATE public."x,y" SET v = \'w\'')
    from oracle import consolidate
    drain_until_current(cfg)
    consolidate(cfg, spark)
    capsys.readouterr()

    # one --tables value naming both tables, the second with a comma in its quoted name
    assert cli.main([*run, "snapshot", cfg.stream, "--mode", "table", "--tables",
                     '"Sales"."Order Items", public."x,y"']) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert '"Sales"."Order Items": 5 rows' in out and 'public."x,y": 5 rows' in out, out

    assert cli.main([*run, "history", cfg.stream, '"Sales"."Order Items"', "--key", "Order ID=2", "--key", "Line=1",
                     "--format", "jsonl"]) == 0
    versions = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(v["qty"], v["_is_current"]) for v in versions] == [(2, False), (20, True)]

    for name, key in (('sales."Order Items"', "Order ID=2"), ("public.xy", "id=1")):
        assert cli.main([*run, "history", cfg.stream, name, "--key", key]) == 2
        err = capsys.readouterr().err
        assert f"is not a table of stream {cfg.stream} (\"Sales\".\"Order Items\", public.\"x,y\", " in err, err
        assert cli.main([*run, "read", cfg.stream, name]) == 2
        assert "is not a table of stream" in capsys.readouterr().err
    assert cli.main([*run, "history", cfg.stream, 'public."x,y"', "--key", "id=abc"]) == 2
    err = capsys.readouterr().err
    assert "public.\"x,y\": key column id holds int32 values; 'abc' is not one" in err, err
    assert "not an error Tidemark names" not in err

    assert cli.main([*run, "read", cfg.stream, 'public."x,y"', "--as-of", "2099-01-01T00:00:00Z"]) == 2
    assert "that time is still to come" in capsys.readouterr().err
    assert cli.main([*run, "read", cfg.stream, 'public."x,y"', "--as-of",
                     dt.datetime.now(dt.timezone.utc).isoformat(), "--format", "jsonl"]) == 0
    assert sorted(json.loads(line)["v"] for line in capsys.readouterr().out.splitlines()) == ["w"] * 5
    # a subscriber's changes as Arrow files: a quoted name with '/' and '..' names no path of its own
    assert cli.main([*run, "subscriber", "add", cfg.stream, "reader"]) == 0
    out = tmp_path / "out"
    assert cli.main([*run, "changes", cfg.stream, "--subscriber", "reader", "--format", "arrow", "--out",
                     str(out)]) == 0, capsys.readouterr().err
    listing = json.loads((out / "changes.json").read_text())
    assert sorted(listing["files"]) == sorted(t.qualified for t in cfg.source.tables)
    assert sorted(p.name for p in out.iterdir()) == sorted([*listing["files"].values(), "changes.json"])
    weird = pa.ipc.open_file(str(out / listing["files"]['public."a/../b"'])).read_all()
    assert weird.column("id").to_pylist() == [7]


@pytest.mark.parametrize("argv, option", [
    (["snapshot", "s", "--chunk-pages", "0"], "--chunk-pages"),
    (["snapshot", "s", "--parallelism", "-1"], "--parallelism"),
    (["drain", "s", "--max-changes", "0"], "--max-changes"), (["drain", "s", "--max-bytes", "-5"], "--max-bytes"),
    (["read", "s", "t", "--limit", "-1"], "--limit"), (["workload", "s", "--transactions", "0"], "--transactions"),
    (["workload", "s", "--seconds", "-2"], "--seconds"), (["changes", "s", "--subscriber", "x", "--max-transactions",
                                                            "0"], "--max-transactions")])
def test_a_count_of_zero_or_less_is_refused_naming_the_option(argv, option, capsys):
    """`--chunk-pages 0` took the stream file's value, `--max-changes 0` or `-5` and `--limit -1` were
    taken (a drain of one-transaction segments, a read of no rows), `--parallelism -1` failed later
    without naming the option."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    assert f"argument {option}: " in capsys.readouterr().err


def test_home_on_the_command_line_wins_over_the_environment(tmp_path, monkeypatch, capsys):
    """``--home B`` with TIDEMARK_HOME=A in the environment ran the local PostgreSQL's commands in B
    but expanded ${TIDEMARK_HOME} in stream files (the demo's lake and landing) to A."""
    folder = tmp_path / "streams"
    folder.mkdir()
    (folder / "h.yaml").write_text("stream: h\nsource: {connection: c, tables: [public.a]}\ncontrol: {connection: c}\n"
                                   "landing: {url: '${TIDEMARK_HOME}/landing'}\n"
                                   "lake: {path: '${TIDEMARK_HOME}/lake'}\n")
    monkeypatch.setenv("TIDEMARK_HOME", str(tmp_path / "a"))
    assert cli.main(["--home", str(tmp_path / "b"), "--streams", str(folder), "read", "h", "public.a"]) == 2
    err = capsys.readouterr().err
    assert "public.a is not a table" not in err       # a table of the stream: the lake was looked at
    assert str(tmp_path / "b" / "lake") in err and str(tmp_path / "a") not in err, err



def test_a_table_no_batch_changed_for_longer_than_the_log_retention_stays_readable(make_stream, source_conn, spark):
    """`tidemark maintain`'s log clean-up deleted the log entries that record which frontier a table holds
    once they were older than the log retention: a table no batch had changed for that long (a quiet
    table of a busy stream, an idle weekend under a short lake.retention) then had no listed version
    at the frontier: `read --at-frontier` / `read_tables(frontier=)` said "no version of it at or below
    frontier", `history` "the table has no Tidemark commit yet", and the status "every version kept"."""
    import time

    from tidemark.lake import read_tables
    from tidemark.lake.history import key_history
    from tidemark.lake.retention import oldest_readable
    from tidemark.maintain import maintain
    from tidemark.pgtypes.catalog import table_schema_from_catalog

    from oracle import consolidate, rows, source_table

    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.busy (id int PRIMARY KEY, v text); CREATE TABLE public.quiet (id int "
                    "PRIMARY KEY, v text); INSERT INTO public.busy VALUES (1, 'a'); INSERT INTO public.quiet VALUES "
                    "(1, 'q'), (2, 'r')")
    cfg = make_stream(["public.busy", "public.quiet"], lake={"retention": "1 second"})
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    time.sleep(3)                       # the log retention: 1 second and as much again
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.busy SET v = 'b'")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    time.sleep(3)
    maintain(cfg)
    maintain(cfg)                       # and again: the frontier stays recorded
    with Control(control_dsn(cfg)) as ctl:
        frontier = ctl.stream(cfg.stream).frontier
    tables = read_tables(cfg, frontier=frontier)
    for name in ("public.busy", "public.quiet"):
        shape = table_schema_from_catalog(source_conn, *name.split("."))
        assert rows(tables[name]) == rows(source_table(source_conn, shape)), name
    versions = key_history(cfg, "public.quiet", {"id": "2"})
    assert [(v["v"], v["_is_current"]) for v in versions] == [("r", True)]
    assert oldest_readable(cfg) is not None
