"""The Tidemark hook: one stream's library operations, with connections resolved through Airflow.

Fat hook, thin operators: the operators store their arguments and build this hook in
``execute()``; the hook loads the stream file, lets the library find connections through
Airflow (connections in the metadata database, secrets backends, ``AIRFLOW_CONN_*``), and calls
the library. Library modules are imported inside the methods, never at DAG parse time.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

if TYPE_CHECKING:
    from tidemark.config import StreamConfig

ACTIONS = ("consolidate", "repair", "resend", "wait")


def airflow_dsn(conn_id: str) -> str | None:
    """Return a libpq DSN for an Airflow connection of type postgres, or None if Airflow has none."""
    from airflow.sdk.exceptions import AirflowNotFoundException

    from tidemark.connections import connection_dsn

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None
    return connection_dsn(conn)


def airflow_extras(conn_id: str) -> dict | None:
    """Return the extras of an Airflow connection (e.g. ``spark_default``'s Spark settings), or None."""
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return dict(BaseHook.get_connection(conn_id).extra_dejson or {})
    except AirflowNotFoundException:
        return None


LSN_KEYS = {"lower", "upper", "lsn", "frontier", "frontier_before", "frontier_after", "landed_upper",
            "consistent_lsn", "committed_position", "slot_confirmed", "first_missing"}


def lsn_text(value: Any, key: str = "") -> Any:
    """``value`` (plain data) with every LSN written as PostgreSQL writes it (``0/16B3748``), for logs:
    integers under LSN keys (`LSN_KEYS`, ``*_lsn``)."""
    from tidemark.lsn import format_lsn

    if isinstance(value, dict):
        return {k: lsn_text(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [lsn_text(v, key) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and (key in LSN_KEYS or key.endswith("_lsn")):
        return format_lsn(value)
    return value


def plain(value: Any) -> Any:
    """Turn a library result (dataclasses, tuples, datetimes) into JSON-safe data for XCom."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class TidemarkHook(BaseHook):
    """Run Tidemark operations for the stream described by one stream file."""

    conn_name_attr = "tidemark_conn_id"
    default_conn_name = "tidemark_control"
    conn_type = "postgres"
    hook_name = "Tidemark"

    def __init__(self, *, stream_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream_file = stream_file
        self._config: StreamConfig | None = None

    # -- configuration and connections -----------------------------------------------------------
    @property
    def config(self) -> "StreamConfig":
        """Load and validate the stream file once, with Airflow as the connection resolver."""
        if self._config is None:
            from tidemark.config import load_config
            from tidemark.connections import set_extras_resolver, set_resolver

            set_resolver(airflow_dsn)
            set_extras_resolver(airflow_extras)
            self._config = load_config(self.stream_file)
        return self._config

    def get_conn(self) -> Any:
        """Open the stream's control database (`tidemark.control.Control`)."""
        from tidemark.control import open_control

        return open_control(self.config)

    # -- stream lifecycle -----------------------------------------------------------------------
    def apply(self) -> dict:
        """Validate the stream against its source, align the publication, register it."""
        if self.config.source.is_feed:     # an external feed: no source to align, the stream is registered
            from tidemark.feeds import register_feed_stream

            register_feed_stream(self.config)
            return {"stream": self.config.stream, "kind": "feed",
                    "tables": [t.qualified for t in self.config.source.tables]}
        from tidemark.capture.source import apply_stream

        return plain(apply_stream(self.config))

    def snapshot(self, *, tables: list[str] | None = None, mode: str = "initial",
                 chunk_pages: int | None = None, parallelism: int | None = None) -> dict:
        """Take a snapshot (``initial``) or re-snapshot (``resend``) of some or all tables."""
        from tidemark.capture.snapshot import snapshot_stream

        result = snapshot_stream(self.config, tables=self._tables(tables), mode=mode, chunk_pages=chunk_pages,
                                 parallelism=parallelism, progress=self._progress("snapshot"))
        return plain(result)

    def drain(self) -> list[dict]:
        """Drain the slot into new segments (whole transactions) and register them."""
        from tidemark.capture.drain import drain_stream

        if self.config.source.is_feed:     # an external feed: register the producers' files, land complete times
            return [self._ingest_feed()]
        result = drain_stream(self.config, progress=self._progress("drain"))
        return [plain(r) for r in result.segments]

    def _ingest_feed(self) -> dict:
        """`tidemark.feeds.ingest` as a drain result: ``uri``/``records``/``upper`` of the segment it landed
        (``uri`` None when no time was complete), the ingest's own report under ``ingest``."""
        from tidemark.control import open_control
        from tidemark.feeds import ingest

        result = ingest(self.config)
        out = {"uri": None, "records": 0, "lower": result.lower, "upper": result.upper, "ingest": plain(result)}
        if result.segment is not None:
            with open_control(self.config) as ctl:
                seg = next(s for s in ctl.segments(self.config.stream, status=None) if s.seq == result.segment)
            out.update(uri=seg.uri, records=seg.record_count, seq=seg.seq)
        return out

    def sweep(self) -> dict:
        """Register or discard segments that were written but never registered."""
        from tidemark import gaps

        return plain(gaps.sweep(self.config))

    # -- gaps ---------------------------------------------------------------------------------------
    def decide(self) -> tuple[str, dict]:
        """Return the next step (one of `ACTIONS`) and the gap report as plain data. The landed files are
        checked at level ``checksum`` (there, and their bytes the ones registered): decoding every new
        segment in Python took seconds on the way of every change, and the consolidation decodes them
        anyway (`tidemark gaps` checks at level ``full``)."""
        from tidemark import gaps

        report = gaps.detect(self.config, verify="checksum")
        action = getattr(report, "action", None)
        if action not in ACTIONS:
            raise ValueError(f"stream {self.config.stream}: gap report action {action!r} is not one of {ACTIONS}")
        return action, plain(report)

    def repair(self) -> dict:
        """Re-drain exactly the missing ranges the slot still covers and register the segments."""
        from tidemark import gaps

        return plain(gaps.repair(self.config, gaps.detect(self.config)))

    def resend(self, *, tables: list[str] | None = None, force: bool = False) -> dict:
        """Forget lost segments, re-snapshot the tables at a new consistent point, move the frontier
        (``skipped`` with the reason when there is no gap, unless ``force``)."""
        from tidemark import gaps

        return plain(gaps.resend(self.config, tables=self._tables(tables), force=force))

    def connection_env(self) -> dict[str, str]:
        """The stream's connections (source, control) as ``TIDEMARK_CONN_<ID>`` DSNs, resolved through
        Airflow (metadata database, secrets backend, ``AIRFLOW_CONN_*``): the environment that lets a
        spark-submit job, which has no Airflow of its own, open them. Each DSN is registered with
        Airflow's secrets masker first, so it never appears in a log."""
        from airflow.sdk.log import mask_secret
        from tidemark.connections import resolve_dsn

        cfg = self.config
        env = {}
        for conn_id in dict.fromkeys(c for c in (cfg.source.connection, cfg.control_connection) if c):  # a feed: no source
            dsn = resolve_dsn(conn_id)
            mask_secret(dsn)
            env["TIDEMARK_CONN_" + conn_id.upper().replace("-", "_")] = dsn
        return env

    # -- consolidation, changelog, status ------------------------------------------------------
    def consolidate(self) -> dict:
        """Consolidate landed segments into the lake in this process (local Spark)."""
        from tidemark.consolidate import consolidate_stream

        return plain(consolidate_stream(self.config))

    def advance_if_idle(self) -> dict | None:
        """Move an idle stream's frontier, checkpoint and slot without Spark (control database only);
        None when landed records need a Spark consolidation. The manifest answers the common case first:
        a segment above the frontier that holds records needs Spark, said without importing the
        consolidation (a second and more on the way of every change)."""
        from tidemark.control import open_control

        with open_control(self.config) as ctl:
            frontier = ctl.stream(self.config.stream).frontier
            if frontier is not None and ctl.records_above(self.config.stream, frontier):
                return None
        from tidemark.consolidate.job import advance_if_idle

        result = advance_if_idle(self.config)
        return None if result is None else plain(result)

    def changelog(self, *, start: dt.datetime, end: dt.datetime) -> dict:
        """Write the changelog partition for commits in ``[start, end)`` from retained segments."""
        from tidemark.consolidate.interval import write_changelog

        return plain(write_changelog(self.config, start=start, end=end))

    def maintain(self) -> dict:
        """Compact, checkpoint and vacuum the stream's lake tables; delete landing files below the floor."""
        from tidemark.maintain import maintain

        return plain(maintain(self.config).as_dict())

    def status(self) -> dict:
        """Return the stream's status: frontier, segments, consumer metrics, slot lag, incidents."""
        from tidemark.status import stream_status

        return plain(stream_status(self.config))

    def record_metrics(self) -> dict:
        """Record the consumer metrics (Ignite's: current and committed segment, committed position, time
        of the last segment; plus slot lag in bytes) in the control database and return the status. The
        storage figures are measured at most every `TASK_STORAGE_MAX_AGE_SECONDS` (a walk of the lake)."""
        from tidemark.status import record_metrics

        return plain(record_metrics(self.config))

    # -- helpers -----------------------------------------------------------------------------------
    def _tables(self, tables: list[str] | str | None) -> list[str] | None:
        """Normalise a table list from Params (None or empty string: all tables of the stream)."""
        if tables is None or tables == "":
            return None
        if isinstance(tables, str):
            tables = [t.strip() for t in tables.split(",") if t.strip()]
        from tidemark.config import TableRef

        known = {t.qualified for t in self.config.source.tables}
        tables = [TableRef.parse(t, key="params.tables").qualified for t in tables]
        unknown = [t for t in tables if t not in known]
        if unknown:
            raise ValueError(f"stream {self.config.stream}: tables {unknown} are not in the stream "
                             f"(configured: {sorted(known)})")
        return list(tables)

    def _progress(self, what: str, every: float = 5.0):
        """Return a progress callback ``(info: dict)`` that logs what the library reports, every few seconds."""
        last = [0.0]

        def report(info: dict) -> None:
            now = time.monotonic()
            if now - last[0] >= every:
                last[0] = now
                self.log.info("%s %s: %s", self.config.stream, what,
                              " ".join(f"{k}={v}" for k, v in dict(info).items()))
        return report
