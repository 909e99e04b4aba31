"""The ``tidemark`` command line: the same library the DAGs call, for operators and tests.

Streams are found by name in the streams directory (``--streams``, ``TIDEMARK_STREAMS_DIR``, or the
checkout's ``include/streams``). The embedded default keeps its state in ``TIDEMARK_HOME``
(default: ``.tidemark`` in the checkout); ``tidemark db start`` writes the connection variables of
the local cluster to ``$TIDEMARK_HOME/env`` (mode 0600: they carry the password from
``$TIDEMARK_HOME/pg/pgpass``), which every command loads (real environment wins).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Callable

# The commands' modules import at their top only the standard library, `tidemark.errors`, `tidemark.lsn`,
# `tidemark.words` and each other; each command imports what it runs inside its own function, so `tidemark --help` and a
# command start without loading the consolidation, the drain, Delta or psycopg2 (the layers: .importlinter).
from tidemark.cli import local, pipeline, show
from tidemark.cli.local import default_home, default_streams_dir, load_env_file
from tidemark.cli.output import DEBUG_ENV, print_error
from tidemark.cli.show import EXIT_LATE
from tidemark.errors import TidemarkError


def find_stream(name: str, streams_dir: Path):
    """The stream named ``name`` in ``streams_dir`` (or the stream file ``name`` itself). A broken file
    of another stream there does not stop this one (as in Airflow: `scan_stream_dir`); when ``name`` is
    in no valid file, the error names the broken files and their keys (it may be in one of them)."""
    from tidemark.config import load_config, scan_stream_dir   # deferred: yaml and pgtypes, not for `--help`

    if name.endswith((".yaml", ".yml")) and Path(name).exists():
        return load_config(name)
    if not streams_dir.is_dir():
        raise TidemarkError(f"streams directory {streams_dir} does not exist (use --streams DIR)")
    configs, errors = scan_stream_dir(streams_dir)
    for cfg in configs:
        if cfg.stream == name:
            twice = [e for e in errors.values() if e.key == "stream" and f"{name!r} is also defined in" in str(e)]
            if twice:       # two files say they are this stream: which one is meant is not for us to guess
                raise twice[0]
            return cfg
    broken = "".join(f"; broken stream file {e}" for e in errors.values())
    raise TidemarkError(f"no stream named {name!r} in {streams_dir}{broken} (use --streams DIR or pass the YAML file)")


# -- parser: one row per command (name, the module of its function ``cmd_<name>``, help, arguments) ------
# An argument is (flags, keywords) of `add_argument`; a list of them is a mutually exclusive group. A
# command with a STREAM argument gets the stream's configuration as ``args.cfg`` (`_with_stream`).

def _arg(*flags: str, **kw) -> tuple:
    return flags, kw


def _flag(flag: str, help: str | None = None) -> tuple:
    return _arg(flag, action="store_true", help=help)


def _at_least(least: int):
    """An argparse type: an integer >= ``least`` (a count or size: 0 or less was taken silently, or as
    "the default", or failed later without naming the option)."""
    def number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}")
        return value

    number.__name__ = f"integer >= {least}"
    return number


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


COUNT = _at_least(1)


STREAM, JSON = _arg("stream"), _flag("--json")
COMMANDS = (
    ("db", local, "the embedded default's local PostgreSQL (wal_level=logical)",
     [_arg("action", choices=["start", "stop", "status", "env"])]),
    ("stream", pipeline, "validate and register streams",
     [_arg("action", choices=["apply", "list"]), _arg("file", nargs="?", help="stream YAML (for apply)")]),
    ("snapshot", pipeline, "take a consistent snapshot (creates the slot), or snapshot tables added to a running "
                           "stream (--mode add)",
     [STREAM, _arg("--tables", help="comma-separated subset; empty string: slot only"),
      _arg("--mode", choices=["initial", "resend", "add", "table"], default="initial",
           help="initial: the first snapshot, creates the slot (tables added to a running stream and waiting for "
                "their snapshot are taken as with add); resend: every table at a new consistent point (with "
                "--tables and the slot intact: as table); add: tables added to a running stream, copied at a new "
                "consistent point of their own while the stream goes on; table: tables the stream captures, "
                "copied again that way, the lake corrected there (the changelog records the difference)"),
      _arg("--chunk-pages", type=COUNT), _arg("--parallelism", type=COUNT)]),
    ("drain", pipeline, "drain the slot into segments, whole transactions only",
     [STREAM, _arg("--max-changes", type=COUNT, help="a segment's size in changes (not the run's)"),
      _arg("--max-bytes", type=COUNT, help="a segment's size in WAL bytes read (not the run's)"),
      _flag("--json", "print the run's result (its segments under 'segments')")]),
    ("segments", pipeline, "list the segment manifest",
     [STREAM, _flag("--all", "include forgotten and quarantined segments"), JSON]),
    ("status", show, f"positions, metrics and slot lag of a stream (exit {EXIT_LATE} when it is late: a DAG has "
                     "not run when its schedule says)", [STREAM, JSON]),
    ("consolidate", pipeline, "consolidate landed segments into the lake", [STREAM]),
    ("maintain", pipeline, "compact, checkpoint and vacuum the stream's lake tables (keeping what lake.retention "
                           "can read) and delete landing files below the floor", [STREAM]),
    ("spark-cds", pipeline, "build the class-data-sharing archive that makes a new Spark JVM start faster (once "
                            "per JDK and Spark installation; TIDEMARK_SPARK_CDS=off to not use it)",
     [_flag("--force", "build it again even if it exists")]),
    ("read", show, "print a lake table",
     [STREAM, _arg("table"), _arg("--format", choices=["csv", "jsonl"], default="csv"),
      _arg("--limit", type=_at_least(0)),
      _flag("--at-frontier", "read the table as of the stream frontier (ignores commits of a batch that failed "
                             "part-way; an external feed's table otherwise reads at its own frontier)"),
      _arg("--as-of", metavar="LSN|TIME", help="the table as the source held it right after the commit at this "
           "LSN (16/B374D848), or at this time (2026-11-24T10:00:00Z: the last commit at or before it)")]),
    ("history", show, "the versions of one key of a table (SCD type 2, from the changelog)",
     [STREAM, _arg("table"), _arg("--key", action="append", required=True, metavar="COLUMN=VALUE",
                                  help="a key column and its value; repeat for a composite key"),
      _arg("--format", choices=["table", "jsonl"], default="table")]),
    ("gaps", pipeline, "detect gaps (and repair or resend)", [STREAM, [_flag("--repair"), _flag("--resend")]]),
    ("sweep", pipeline, "register or quarantine segments written but never registered", [STREAM]),
    ("incidents", show, "list a stream's incidents", [STREAM, _flag("--all")]),
    ("parity", show, "compare each lake table with its source table (rows and checksum)", [STREAM]),
    ("workload", local, "run the demo workload generator against a stream's source",
     [STREAM, _arg("--transactions", type=COUNT, default=200),
      _arg("--seconds", type=_seconds, help="run for this long instead of a count"), _arg("--seed", type=int)]),
    ("subscriber", show, "add, list or drop a subscriber (a reader of changes with a checkpoint)",
     [_arg("action", choices=["add", "list", "drop"]), STREAM, _arg("name", nargs="?"),
      _flag("--from-frontier", "start at the current frontier, not at 0")]),
    ("changes", show, "the changes since a subscriber's checkpoint, whole transactions, up to the frontier",
     [STREAM, _arg("--subscriber", required=True), _arg("--format", choices=["jsonl", "arrow"], default="jsonl"),
      _arg("--out", type=Path, help="directory for --format arrow"), _arg("--max-transactions", type=COUNT),
      _flag("--ack", "move the checkpoint to the upper once written")]),
    ("feed", pipeline, "an external feed: ingest the producers' Materialize CDC files, or forget a time",
     [_arg("action", choices=["ingest", "forget"]), STREAM, _arg("table", nargs="?"),
      _arg("time", nargs="?", type=_at_least(0)), _arg("--reason", default="given up by the operator")]),
    ("airflow", local, "run the airflow command line against the embedded default (e.g. tidemark airflow dags "
                       "list)", [_arg("args", nargs=argparse.REMAINDER)]),
    ("demo", local, "run the embedded default: PostgreSQL, demo stream, snapshot, drain, consolidate, Airflow",
     [_flag("--headless", "run the flow once and print a parity report"),
      _flag("--stop", "stop everything the demo started"), _arg("--transactions", type=COUNT, default=300)]),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidemark", description=__doc__.split("\n\n")[0].replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", type=Path, default=None, help="state of the embedded default (TIDEMARK_HOME)")
    p.add_argument("--streams", type=Path, default=None, help="directory of stream YAML files (TIDEMARK_STREAMS_DIR)")
    p.add_argument("--debug", action="store_true", help="print an error's traceback and Spark's own output "
                                                        "(its log otherwise goes to $TIDEMARK_HOME/logs; TIDEMARK_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module, text, arguments in COMMANDS:
        sp = sub.add_parser(name, help=text, description=text)
        fn = getattr(module, "cmd_" + name.replace("-", "_"))
        sp.set_defaults(fn=functools.partial(_with_stream, fn) if STREAM in arguments else fn)
        for spec in arguments:
            group = sp.add_mutually_exclusive_group() if isinstance(spec, list) else sp
            for flags, kw in spec if isinstance(spec, list) else [spec]:
                group.add_argument(*flags, **kw)
    return p


def _with_stream(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run command ``fn`` with ``args.cfg``: the configuration of the stream ``args.stream`` names."""
    args.cfg = find_stream(args.stream, args.streams)
    return fn(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    if args.home is not None:     # --home wins over the environment, for ${TIDEMARK_HOME} in stream files too
        os.environ["TIDEMARK_HOME"] = str(args.home.resolve())
    args.home = (args.home or default_home()).resolve()
    os.environ.setdefault("TIDEMARK_HOME", str(args.home))
    load_env_file(args.home / "env")
    args.streams = args.streams or default_streams_dir()
    try:
        return args.fn(args) or 0
    except KeyboardInterrupt:
        print("tidemark: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:     # `tidemark gaps demo | head`: the reader has what it wanted; no error to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())       # the interpreter's last flush at exit must not fail again
        os.close(devnull)
        return 128 + 13                             # as a process ended by SIGPIPE, the shell's convention
    except Exception as exc:  # noqa: BLE001 - said as the error's message, never as a traceback
        print_error(exc)
        return 2 if isinstance(exc, TidemarkError) else 1
