"""Operating a stream as a new user does (real PostgreSQL): what the command line and the status say
after the steps the manual names, and what it says about bad input."""

from __future__ import annotations

import os

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
