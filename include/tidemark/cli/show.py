"""The commands that show a stream: its status (and freshness alarm), incidents, parity with the
source, a lake table, a key's history; its subscribers and the changes they read."""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import sys

from tidemark.cli.output import csv_value, json_default, print_json, print_table, python_rows, when
from tidemark.errors import TidemarkError
from tidemark.lsn import format_lsn
from tidemark.words import seconds, size

# `tidemark status`'s exit code when the freshness alarm is up (a DAG has not run when its schedule says
# it should have: `tidemark.status.freshness`); 0: not late. Not 1 or 2 (an error), nor 3 (`db status`).
EXIT_LATE = 4


def cmd_status(args) -> int:
    # deferred: the command line loads only what it runs
    from tidemark.status import commit_lag_text, freshness_text, storage_lines, stream_status

    status = stream_status(args.cfg)
    late = EXIT_LATE if status["freshness"]["late"] else 0
    if args.json:
        print_json(status, sort_keys=True)
        return late
    lines = [("LATE", reason) for reason in status["freshness"]["late"]]   # first: no incident says it
    worded = {"storage", "storage_error", "write_cost", "subscribers", "last_maintenance"}   # (storage_lines)
    for key in sorted(status):
        value = status[key]
        if key in worded:
            continue
        if key == "incidents":
            for i in value:     # one line each: the same cause repeated is one incident with its count
                lines.append(("incident", f"#{i['id']} {i['kind']}{' ' + i['table'] if i.get('table') else ''}, "
                                          f"seen {i['count']} time(s), opened {when(i['opened_at'])}, last seen "
                                          f"{when(i['last_seen_at'])}: {_incident_text(i['detail'])}"))
            continue
        if key == "freshness":     # the alarm of DAGs that have not run when their schedules say
            lines += [(f"{job} freshness", freshness_text(value.get(job))) for job in ("drain", "consolidation")]
            continue
        # the figures the status page shows too, worded as it words them (`tidemark.words`)
        if key.endswith(("_lsn", "upper", "frontier", "position")) and isinstance(value, int):
            value = f"{format_lsn(value)} ({value})"
        elif isinstance(value, dt.datetime):
            value = when(value)
        elif key == "commit_lag":
            value = commit_lag_text(value)
        elif key == "slot_lag_seconds":
            value = seconds(value)
        elif key == "slot_lag_bytes" and value is not None:
            value = size(value)
        lines.append((key, value))
    lines += storage_lines(status)
    width = max(len(label) for label, _ in lines)
    for label, text in lines:
        print(f"{label:>{width}}: {text}")
    return late


def _incident_text(detail) -> str:
    if isinstance(detail, dict) and detail.get("reason"):
        return " ".join(str(detail["reason"]).split())
    return json.dumps(detail, default=json_default)


def cmd_incidents(args) -> int:
    from tidemark.control import open_control   # deferred: the command line loads only the command it runs

    with open_control(args.cfg) as ctl:
        rows = ctl.incidents(args.cfg.stream, open_only=not args.all)
    for r in rows:
        print_json(r, indent=None)
    if not rows:
        print("no open incidents" if not args.all else "no incidents")
    return 0


def cmd_parity(args) -> int:
    # deferred: the command line loads only the command it runs
    from tidemark.control import open_control
    from tidemark.parity import moved_since, parity_report

    cfg = args.cfg
    with open_control(cfg) as ctl:
        frontier = ctl.stream(cfg.stream).frontier
    report = parity_report(cfg)
    print_parity(report)
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


def print_parity(report: dict) -> None:
    rows = [{"table": t, "source_rows": r["source_rows"], "lake_rows": r["lake_rows"],
             "checksums": "equal" if r["source_checksum"] == r["lake_checksum"] else "DIFFERENT",
             "parity": ("ok" if not r.get("not_captured") else "ok on the captured columns; not captured: "
                        + ", ".join(f"{c} (generated)" for c in r["not_captured"])) if r["equal"] else "MISMATCH"}
            for t, r in sorted(report.items())]
    print_table(rows, ["table", "source_rows", "lake_rows", "checksums", "parity"])


def lake_table(cfg, text: str) -> str:
    """The table ``TABLE`` names (``schema.table``, unquoted parts folded to lower case as PostgreSQL
    does), when it is one of the stream's or its lake holds it (a table removed from the stream file
    stays readable); else an error naming the stream's tables and how a name is written."""
    # deferred: the command line loads only the command it runs (deltalake)
    from tidemark.config import TableRef
    from tidemark.lake import open_delta, storage_options, table_uri

    ref = TableRef.parse(text, key="TABLE")
    if ref in cfg.source.tables or open_delta(table_uri(cfg, ref), storage_options(cfg)) is not None:
        return ref.qualified
    named = ref.qualified if text == ref.qualified else f"{ref.qualified} (as {text!r} reads)"
    raise TidemarkError(f"{named} is not a table of stream {cfg.stream} "
                        f"({', '.join(t.qualified for t in cfg.source.tables)}) and its lake holds no table of "
                        "that name; write it schema.table, each part quoted where it has upper-case letters, "
                        "spaces or dots: '\"Sales\".\"Order Items\"'")


def cmd_read(args) -> int:
    # deferred: loads deltalake and pyarrow; only for this command
    from tidemark import lake
    from tidemark.control import open_control
    from tidemark.lake.history import read_table_at

    cfg = args.cfg
    args.table = lake_table(cfg, args.table)
    if args.as_of is not None:  # as the source held it at a commit position or time
        table = read_table_at(cfg, args.table, args.as_of)
    elif args.at_frontier:      # as of the stream frontier: every table of a batch at the same frontier
        with open_control(cfg) as ctl:
            frontier = ctl.stream(cfg.stream).frontier
        if frontier is None:
            raise TidemarkError(f"stream {cfg.stream} has no frontier yet (nothing consolidated)")
        table = lake.read_table(cfg, args.table, frontier=frontier)
    else:
        table = lake.read_table(cfg, args.table)
    if args.limit is not None:
        table = table.slice(0, args.limit)
    rows = python_rows(table)       # (±infinity and BC dates as text: Python's dates cannot hold them)
    if args.format == "jsonl":
        for row in rows:
            print_json(row, indent=None, ensure_ascii=False)
    else:
        writer = csv.writer(sys.stdout)
        writer.writerow(table.column_names)
        for row in rows:
            writer.writerow([csv_value(row[c]) for c in table.column_names])
    return 0


def cmd_history(args) -> int:
    from tidemark.lake.history import key_history   # deferred: loads deltalake; only for this command

    key = {}
    for item in args.key:
        column, sep, value = item.partition("=")
        if not sep or not column:
            raise TidemarkError(f"--key {item!r}: write COLUMN=VALUE (e.g. --key id=42)")
        key[column] = value
    args.table = lake_table(args.cfg, args.table)
    versions = key_history(args.cfg, args.table, key)
    if args.format == "jsonl":
        for v in versions:
            print_json(v, indent=None, ensure_ascii=False)
        return 0
    if not versions:
        print(f"no version of {', '.join(f'{k}={v}' for k, v in key.items())} in {args.table}")
        return 0
    meta = ["_valid_from_lsn", "_valid_to_lsn", "_valid_from", "_valid_to", "_is_current", "_deleted"]
    columns = [c for c in versions[0] if c not in meta]
    rows = [{**{c: csv_value(v[c]) for c in columns}, "valid_from": format_lsn(v["_valid_from_lsn"]),
             "valid_to": format_lsn(v["_valid_to_lsn"]) if v["_valid_to_lsn"] is not None else "(current)",
             "from_time": when(v["_valid_from"]) if v["_valid_from"] else "", "to_time": when(v["_valid_to"]) if
             v["_valid_to"] else "", "ended_by": "delete" if v["_deleted"] else ("" if v["_is_current"] else "update")}
            for v in versions]
    print_table(rows, ["valid_from", "valid_to", "from_time", "to_time", "ended_by", *columns])
    return 0


def cmd_subscriber(args) -> int:
    from tidemark import subscribers   # deferred: loads deltalake; only for this command

    cfg = args.cfg
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
        print_json(subscribers.add_subscriber(cfg, args.name, from_frontier=args.from_frontier), indent=None)
    else:
        subscribers.drop_subscriber(cfg, args.name)
    return 0


def cmd_changes(args) -> int:
    """Every change since the subscriber's checkpoint; acknowledged (``--ack``) only once written."""
    from tidemark import subscribers   # deferred: loads deltalake; only for this command

    cfg = args.cfg
    if args.format == "arrow" and args.out is None:
        raise subscribers.SubscriberError("--format arrow needs --out DIR (one Arrow IPC file per table)")
    changes = subscribers.read_changes(cfg, args.subscriber, max_transactions=args.max_transactions)
    if args.format == "jsonl":
        for tx in changes.transactions():
            print_json({"lsn": format_lsn(tx["time"]), **tx}, indent=None)
        sys.stdout.flush()
    else:
        import pyarrow as pa

        from tidemark.lake.delta import dir_name   # deferred: the command line loads only the command it runs

        args.out.mkdir(parents=True, exist_ok=True)
        # a file name per table as the lake names its directory: a quoted name may hold '/' or '..'
        files = {table: dir_name(table) + ".arrow" for table in changes.tables}
        for table, rows in changes.tables.items():
            path = args.out / files[table]
            with pa.OSFile(str(path) + ".tmp", "wb") as sink, pa.ipc.new_file(sink, rows.schema) as w:
                w.write_table(rows)
            os.replace(str(path) + ".tmp", path)
        (args.out / "changes.json").write_text(json.dumps({"lower": changes.lower, "upper": changes.upper,
                                                           "tables": sorted(changes.tables), "files": files}))
    acked = subscribers.ack(cfg, args.subscriber, changes.upper) if args.ack else None
    print(json.dumps({"stream": cfg.stream, "subscriber": args.subscriber, "lower": changes.lower,
                      "upper": changes.upper, "changes": changes.num_changes, "acknowledged": acked}), file=sys.stderr)
    return 0
