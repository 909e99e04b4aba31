"""Stage 2 of a batch (`Decoded`, `decode`; `Scope`, `scope`): the plan's segments decoded in ONE
Spark job, and what the batch may cover then (the completeness check). `interval` replays a past
range through `decode`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping

from tidemark.config import StreamConfig
from tidemark.consolidate import plan as _plan, transform as T
from tidemark.consolidate.decode import decode_partition, held_as_text
from tidemark.consolidate.identities import content_hashes, identities, with_content_hashes
from tidemark.consolidate.plan import BatchPlan, PendingSnapshot
from tidemark.consolidate.work_area import DECODED_DDL, Work, read_parts
from tidemark.errors import ConsolidateError
from tidemark.lake import open_delta, storage_options, table_info, table_uri
from tidemark.landing.store import stream_keys
from tidemark.lsn import format_lsn
from tidemark.sparkconf import default_parallelism

OPEN_THREADS = 4    # Delta tables opened at once (``deltalake`` reads each log without the GIL)


@dataclass(frozen=True)
class Decoded:
    """Stage 2's result: what the decoding found in the plan's segments (their parts stay in ``work``)."""

    cfg: StreamConfig
    spark: Any
    start: int
    target_rows: int
    options: Mapping                # the lake's storage options
    work: Work                      # the run's work area: the decoded parts
    buckets: Mapping[str, int] = field(default_factory=dict)      # table -> its lake buckets (the parts' cut)
    lake_tables: Mapping[str, Any] = field(default_factory=dict)  # table -> its Delta table as opened before
    shapes: tuple = ()              # the ``data`` rows: a table's part of a segment, its shape, bucket, time
    events: tuple = ()              # the ``evt`` rows (truncates ...), by (time, position)
    ids: Any = None                 # the completeness check's rows (`plan.completeness_rows`)
    counted: Any = None             # times counted without their rows (`identities.identities`)
    bad: tuple = ()                 # (time, table, facts) of values the lake type cannot hold
    links: Mapping[str, frozenset] = field(default_factory=dict)   # table -> bucket pairs an update links

    def close(self) -> None:
        """The run's decoded parts are deleted (committed or not, they are never read again)."""
        if self.shapes:
            self.work.discard()

    def truncates(self, table: str, lower: int, upper: int) -> list[tuple[int, int, int]]:
        """``table``'s truncates at times in ``[lower, upper)``: (time, position, commit time)."""
        return [(e["time"], e["position"], json.loads(e["info"]).get("commit_ts", 0)) for e in self.events
                if e["table"] == table and lower <= e["time"] < upper and json.loads(e["info"])["kind"] == "truncate"]

    def tables(self, loadable: list[PendingSnapshot]) -> list[str]:
        """The tables with a change, an event or a snapshot to load in this batch."""
        return sorted({r["table"] for r in (*self.shapes, *self.events)}.union(*(s.tables for s in loadable)))


@dataclass(frozen=True)
class Scope:
    """What one batch covers, decided from its plan and its decoded segments (`scope`)."""

    frontier: int                             # the stream's new frontier
    tables: tuple[str, ...] = ()              # the tables brought to it (the waiting ones left out)
    loadable: tuple[PendingSnapshot, ...] = ()    # the pending snapshots at or below it
    frontiers: Mapping[str, int] | None = None    # an external feed's tables: each one's own frontier
    unmet: tuple = ()                         # `plan.Unmet`: the times whose counts are not met, earliest first
    incident: int | None = None               # the ``counts_unmet`` incident opened for the first of them
    waiting: Mapping[str, str] = field(default_factory=dict)   # table -> why it does not move yet
    stays: bool = False                       # nothing moves (`plan.BatchPlan.stays`): no table is brought


def scope(ctl, cfg: StreamConfig, plan: BatchPlan, dec: Decoded) -> Scope:
    """The batch's new frontier, held below the first time whose count is not met
    (`plan.completeness_rows`; `plan.report_unmet`), the snapshots it loads and the tables it brings
    there (not those that wait: `plan.waiting`)."""
    # an external feed's completeness is the ingest's: its segments land complete times only
    unmet = (_plan.completeness_rows(dec.ids, plan.start, plan.cov.end, counted=dec.counted)
             if plan.cov.segments and plan.frontiers is None else [])
    frontier = plan.frontier(unmet)
    incident = _plan.report_unmet(ctl, cfg.stream, unmet, cfg.consolidate.count_timeout_seconds)
    loadable = tuple(s for s in plan.snapshots if s.lsn <= frontier)
    if plan.stays(ctl, cfg, frontier, loadable):
        return Scope(frontier, (), loadable, plan.frontiers, tuple(unmet), incident, stays=True)
    waiting = {} if plan.frontiers is not None else _plan.waiting(ctl, cfg, plan.snapshots, frontier)
    not_captured(ctl, cfg, dec, dec.tables(loadable))
    return Scope(frontier, tuple(t for t in dec.tables(loadable) if t not in waiting), loadable, plan.frontiers,
                 tuple(unmet), incident, waiting)


def not_captured(ctl, cfg: StreamConfig, dec: Decoded, tables) -> None:
    """Raise `ConsolidateError` when the segments hold changes of a table that is not the stream's (not
    in its stream file, nor added or removed by `tidemark stream apply`): a table renamed in the source
    keeps its place in the publication and its changes come under its new name. Its changes would
    make a lake table of their own, and the table under its old name would stop silently."""
    known = {t.qualified for t in cfg.source.tables} | set(ctl.table_states(cfg.stream))
    stray = [t for t in tables if t not in known]
    if not stray:
        return
    table = stray[0]
    rows = [r for r in (*dec.shapes, *dec.events) if r["table"] == table]
    oid = next((json.loads(r["info"]).get("oid") for r in rows if r["kind"] == "data"), None)
    was = None
    if oid is not None:
        was = next((name for name, dt in dec.lake_tables.items() if dt is not None
                    and (table_info(dt).get("table_schema") or {}).get("oid") == oid), None)
    times = [r["time"] for r in rows if r["time"] is not None]
    first = format_lsn(min(times)) if times else "?"
    more = f" (and {', '.join(stray[1:])})" if stray[1:] else ""
    if was is not None:
        raise ConsolidateError(
            f"stream {cfg.stream}: the segments hold changes of table {table}{more} from {first}, which is not a "
            f"table of the stream: it is {was} (relation OID {oid}) renamed in the source, whose changes come under "
            f"its new name; name {table} in the stream file in place of {was}, run `tidemark stream apply` with it "
            f"and `tidemark snapshot {cfg.stream} --mode add --tables {table}` (the lake keeps {was} as it was)")
    raise ConsolidateError(
        f"stream {cfg.stream}: the segments hold changes of table {table}{more} from {first}, which is not a table "
        f"of the stream ({', '.join(t.qualified for t in cfg.source.tables)}); if the stream file changed (the "
        "table added or removed), run `tidemark stream apply` with it; if a table of the stream was renamed to it, "
        f"name it there in place of the old name, apply it and snapshot it (`tidemark snapshot {cfg.stream} --mode "
        f"add --tables {table}`)")


def decode(cfg: StreamConfig, spark, plan: BatchPlan, target_rows: int) -> Decoded:
    """Decode the segments of ``plan.cov`` in one Spark job: their parts into the run's work area
    (`decode.Work`), cut by each table's lake buckets (`lake_buckets`), the small rows to the driver."""
    import uuid

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    # deferred: tests replace segments.PIECE_RECORDS (test_decode_pieces, test_completeness_tally)
    from tidemark.landing.segments import PIECE_RECORDS

    options = storage_options(cfg)
    land = cfg.landing
    area = stream_keys(cfg.stream)["decoded"]
    work = Work((land.url, land.endpoint_url, land.region), f"{area}{uuid.uuid4().hex[:12]}-")
    uris = [s.uri for s in plan.cov.segments]
    if not uris:
        return Decoded(cfg, spark, plan.start, target_rows, options, work)
    # the stream's tables as opened, for `prepare` to reuse; their buckets cut the parts
    lake_tables = open_all({ref.qualified: table_uri(cfg, ref.qualified) for ref in cfg.source.tables}, options)
    buckets = {table: lake_buckets(cfg, dt) for table, dt in lake_tables.items()}
    work.discard(area)          # what a stopped run left (the stream's lease: no other run is on)
    endpoint = land.endpoint_url
    # segment i is row i of a range split over the cores: no local relation to ship, no shuffle
    src = spark.range(0, len(uris), 1, min(len(uris), max(1, default_parallelism(spark))))
    piece = min(PIECE_RECORDS, cfg.consolidate.max_batch_records)     # a huge segment: decoded piece by piece
    texts = held_as_text(lake_tables, plan.snapshots, plan.cov.end)     # array columns the lake holds as text
    small = src.mapInArrow(lambda it: decode_partition(it, endpoint, uris, buckets, work, piece, texts),
                           T.schema(spark, DECODED_DDL)).toArrow()
    kinds = small.column("kind")
    meta = small.filter(pc.is_in(kinds, value_set=pa.array(["data", "evt"]))).drop_columns(["payload"]).to_pylist()
    shapes = [r for r in meta if r["kind"] == "data"]

    def hashes(wanted: list[int], segs: list[str]):
        """The content hashes of the updates whose identity occurs twice (`decode.content_hashes`)."""
        rows = [(r["seg"], r["table"], r["offset"], r["size"]) for r in shapes if r["seg"] in set(segs)]
        df = spark.createDataFrame(rows, "seg string, table string, offset long, size long")
        ddl = "kind string, seg string, table string, time long, position int, rhash long, count long"
        return df.mapInArrow(lambda it: content_hashes(it, wanted, work), T.schema(spark, ddl)).toArrow()

    # the check's rows: per time, not per record (a huge transaction's identities stay in the work area)
    store = work.open()
    found = identities(small, lambda parts: read_parts(store, work, parts))
    bad = small.filter(pc.equal(kinds, "bad"))
    events = {(r["time"], r["position"]): r for r in meta if r["kind"] == "evt"}
    lnk = small.filter(pc.equal(kinds, "lnk"))
    links: dict[str, set] = {}
    for table, payload in zip(lnk.column("table").to_pylist(), lnk.column("payload").to_pylist()):
        links.setdefault(table, set()).update(map(tuple, np.frombuffer(payload, "<i4").reshape(-1, 2).tolist()))
    return Decoded(cfg, spark, plan.start, target_rows, options, work, buckets, lake_tables,
                   shapes=tuple(shapes), events=tuple(events[k] for k in sorted(events)),
                   ids=with_content_hashes(found.rows, hashes), counted=found.counted,   # (reads shapes' parts)
                   bad=tuple(sorted(zip(bad.column("time").to_pylist(), bad.column("table").to_pylist(),
                                        bad.column("info").to_pylist()))),
                   links={t: frozenset(pairs) for t, pairs in links.items()})


def lake_buckets(cfg: StreamConfig, dt) -> int:
    """The number of buckets of lake table ``dt`` (None, or none recorded: ``consolidate.buckets``)."""
    return int((table_info(dt) if dt is not None else {}).get("buckets") or cfg.consolidate.buckets)


def open_all(uris: dict[str, str], options) -> dict:
    """{name: its Delta table or None} for ``{name: uri}``, opened a few at a time."""
    if len(uris) < 2:
        return {name: open_delta(uri, options) for name, uri in uris.items()}
    with ThreadPoolExecutor(OPEN_THREADS, thread_name_prefix="tidemark-open") as pool:
        return dict(zip(uris, pool.map(lambda uri: open_delta(uri, options), uris.values())))
