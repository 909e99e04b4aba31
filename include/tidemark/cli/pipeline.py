"""The commands that run the pipeline's steps: register a stream, snapshot, drain (or ingest an external
feed), consolidate, maintain, gaps and the sweep. Each loads what it runs inside its function."""

from __future__ import annotations

import sys

from tidemark.cli.local import default_home
from tidemark.cli.output import Progress, print_json, print_table, spark_output_to
from tidemark.errors import ConfigError, TidemarkError, describe
from tidemark.lsn import format_lsn


def cmd_stream(args) -> int:
    # deferred: the command line loads only the command it runs
    from tidemark.config import load_config, scan_stream_dir
    from tidemark.capture.source import apply_stream
    from tidemark.control import open_control

    if args.action == "list":
        if not args.streams.is_dir():
            raise TidemarkError(f"streams directory {args.streams} does not exist (use --streams DIR)")
        rows = []
        configs, errors = scan_stream_dir(args.streams)    # a broken file does not hide the others
        for cfg in configs:
            row = {"stream": cfg.stream, "file": cfg.origin, "tables": len(cfg.source.tables)}
            try:
                with open_control(cfg) as ctl:
                    st = next((s for s in ctl.streams() if s.name == cfg.stream), None)
                if st is None:
                    row.update(state="unregistered (tidemark stream apply FILE)")
                else:
                    row.update(state=st.state, landed_upper=format_lsn(st.landed_upper),
                               frontier=format_lsn(st.frontier))
            except Exception as exc:  # noqa: BLE001 - control database down: still list the configs
                row.update(state=f"unknown: {describe(exc)[0]}")
            rows.append(row)
        print_table(rows, ["stream", "state", "landed_upper", "frontier", "tables", "file"])
        for problem in errors.values():     # said, and the exit code says it: a stream file that does not load
            print(f"tidemark: error: broken stream file {problem}", file=sys.stderr)
        return 2 if errors else 0
    if not args.file:
        raise ConfigError("stream apply", "needs the stream file to apply: tidemark stream apply PATH.yaml")
    cfg = load_config(args.file)
    if cfg.source.is_feed:
        from tidemark.feeds import feed_prefix, register_feed_stream   # deferred: only for a feed's apply

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
    from tidemark.capture.snapshot import resnapshot_refiltered   # deferred: only when the stream has a snapshot

    res = resnapshot_refiltered(cfg)      # a column list or row filter changed: that table is copied again
    if res is not None:
        print(f"re-snapshotted {', '.join(sorted(res.tables))} online (column list or row filter changed): "
              f"snapshot {res.snapshot_id} at {format_lsn(res.lsn)}; the consolidation that reaches it "
              "replaces the table's rows")
    return 0


def cmd_snapshot(args) -> int:
    # deferred: the command line loads only the command it runs
    from tidemark.capture import snapshot
    from tidemark.capture.ranges import describe_copy

    cfg = args.cfg
    tables = table_list(args.tables) if args.tables is not None else None
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


def table_list(text: str) -> list[str]:
    """``--tables a,b``: the names between commas outside double quotes (``public."x,y"`` is one
    table, as in the stream file), blanks around them dropped; an empty string: none."""
    names, cur, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted     # a doubled quote inside a quoted part toggles twice: still inside
        if ch == "," and not quoted:
            names.append(cur)
            cur = ""
        else:
            cur += ch
    names.append(cur)
    return [n.strip() for n in names if n.strip()]


def cmd_drain(args) -> int:
    from tidemark.capture import drain   # deferred: the command line loads only the command it runs

    cfg = args.cfg
    progress = Progress(f"drain {cfg.stream}")
    lsns = ("lsn", "decoded", "target")       # positions as LSNs; "waiting" = seconds without data

    def show(info: dict) -> None:
        progress({k: format_lsn(v) if k in lsns else v for k, v in info.items() if k != "stream"})

    result = drain.drain_stream(cfg, max_changes=args.max_changes, max_bytes=args.max_bytes,
                                progress=None if args.json else show)
    progress.done()
    if args.json:
        print_json(result)     # a dataclass: `json_default` writes its fields
        return 0
    for r in result.segments:
        kind = "progress only" if r.empty else f"{r.records:,} records in {r.txns:,} transactions"
        print(f"segment {r.seq} [{format_lsn(r.lower)}, {format_lsn(r.upper)}): {kind}, {r.byte_size:,} bytes -> {r.uri or 'nothing written (empty interval)'}")
    if len(result.segments) > 1:
        print(f"{len(result.segments)} segments [{format_lsn(result.lower)}, {format_lsn(result.upper)}): "
              f"{result.records:,} records in {result.txns:,} transactions, {result.byte_size:,} bytes")
    return 0


def cmd_segments(args) -> int:
    from tidemark.control import open_control   # deferred: the command line loads only the command it runs

    with open_control(args.cfg) as ctl:
        segs = ctl.segments(args.cfg.stream, status=None if args.all else "landed")
    if args.json:
        print_json([s.__dict__ for s in segs])
        return 0
    rows = [{"seq": s.seq, "lower": format_lsn(s.lower), "upper": format_lsn(s.upper), "records": s.record_count,
             "txns": s.txn_count, "bytes": s.byte_size, "status": s.status, "origin": s.origin,
             "uri": s.uri} for s in segs]
    print_table(rows, ["seq", "lower", "upper", "records", "txns", "bytes", "status", "origin", "uri"])
    return 0


def cmd_consolidate(args) -> int:
    from tidemark.consolidate import consolidate_stream   # deferred: loads Spark's side; only for this command

    with spark_output_to(default_home() / "logs" / f"spark-{args.cfg.stream}.log"):
        result = consolidate_stream(args.cfg)
    print_json(result)
    return 0


def cmd_maintain(args) -> int:
    from tidemark.maintain import maintain   # deferred: loads deltalake; only for this command

    print_json(maintain(args.cfg).as_dict())
    return 0


def cmd_spark_cds(args) -> int:
    from tidemark import cds   # deferred: the command line loads only the command it runs

    print(f"building the Spark class-data-sharing archive ({cds.archive_path()}); about a minute...",
          file=sys.stderr, flush=True)
    print_json(cds.build(force=args.force))
    return 0


def cmd_gaps(args) -> int:
    from tidemark import gaps   # deferred: the command line loads only the command it runs

    report = gaps.detect(args.cfg)
    print_json(report)
    if args.repair:
        print_json(gaps.repair(args.cfg, report))
    elif args.resend:
        print_json(gaps.resend(args.cfg))
    return 0


def cmd_sweep(args) -> int:
    from tidemark import gaps   # deferred: the command line loads only the command it runs

    print_json(gaps.sweep(args.cfg))
    return 0


def cmd_feed(args) -> int:
    from tidemark import feeds   # deferred: the command line loads only the command it runs

    if args.action == "ingest":
        print_json(feeds.ingest(args.cfg))
        return 0
    if args.table is None or args.time is None:
        raise feeds.FeedError("tidemark feed forget needs STREAM TABLE TIME")
    print_json(feeds.forget(args.cfg, args.table, args.time, args.reason), indent=None)
    return 0
