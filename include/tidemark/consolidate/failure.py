"""The failure context of a consolidation run (`Where`): which step, table, segment and positions a
failure happened at, read from the batch's stages' results, recorded as a ``consolidate_failed``
incident and raised as one line with its remedy (`ConsolidateFailed`). Spark failures are told
apart by `tidemark.failures`. The stages name the table they are at with `for_table`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging

from tidemark.config import StreamConfig
from tidemark.connections import resolve_dsn
from tidemark.control import open_control
from tidemark.errors import ConsolidateError, LakeFull, TableNeedsSnapshot, UnstorableValue, facts_behind
from tidemark.failures import failure_reason
from tidemark.lake import changelog_uri, committed_frontier, history_uri, open_delta, storage_options, table_uri
from tidemark.lsn import format_lsn

log = logging.getLogger(__name__)


@contextlib.contextmanager
def for_table(table: str):
    """A failure inside names ``table`` (`Where.failed`), unless an inner step named one already."""
    try:
        yield
    except BaseException as exc:
        if getattr(exc, "tidemark_table", None) is None:
            with contextlib.suppress(AttributeError, TypeError):
                exc.tidemark_table = table
        raise


class ConsolidateFailed(ConsolidateError):
    """A consolidation run failed and the failure was recorded as an incident (``incident`` id, or
    None if the control database could not be reached); the message is one line with the remedy."""

    def __init__(self, message: str, *, incident: int | None, detail: dict):
        super().__init__(message)
        self.incident = incident
        self.detail = detail
        self.remedy = detail.get("remedy")      # the message's end, printed on its own line by the CLI


def _redact(cfg: StreamConfig, text: str) -> str:
    """``text`` without the stream's connection passwords (a driver message may echo a DSN)."""
    from psycopg2.extensions import parse_dsn

    for conn_id in (cfg.source.connection, cfg.control_connection):
        try:
            password = parse_dsn(resolve_dsn(conn_id)).get("password")
        except Exception:  # noqa: BLE001 - an unresolvable connection has no password to hide
            continue
        if password:
            text = text.replace(password, "***")
    return text


class Where:
    """Where a consolidation run is, so a failure can say it: step, table, segments, positions."""

    def __init__(self, cfg: StreamConfig):
        self.cfg = cfg
        self.step = "starting"
        self.table: str | None = None
        self.ctl = None           # the run's control connection (`job.run`)
        # the batch's stages' results, each once it is there: `plan.BatchPlan` (from the decoding on),
        # `decoded.Decoded`, `decoded.Scope`, `committed.CommitResult`
        self.plan = self.decoded = self.scope = self.committed = None

    start = property(lambda self: self.plan.start if self.plan is not None else None)
    segments = property(lambda self: list(self.plan.cov.segments) if self.plan is not None else [])
    frontier = property(lambda self: self.scope.frontier if self.scope is not None else None)
    tables = property(lambda self: list(self.scope.tables) if self.scope is not None else [])
    done = property(lambda self: list(self.committed.done) if self.committed is not None else [])

    def _segment(self):
        """The segment holding the failing table's first change of the batch (else the batch's first)."""
        first = None
        if self.decoded is not None and self.table is not None:
            first = min((r["time"] for r in self.decoded.shapes if r["table"] == self.table
                         and r["time"] >= (self.start or 0)), default=None)
        seg = next((s for s in self.segments if first is not None and s.lower <= first < s.upper), None)
        return seg or (self.segments[0] if self.segments else None), first

    def _ahead(self) -> list[str]:
        """Tables whose lake commit already records the batch's frontier (from their Delta logs)."""
        if self.frontier is None:
            return []
        out = []
        for t in self.tables:
            try:
                done = committed_frontier(open_delta(table_uri(self.cfg, t), storage_options(self.cfg)),
                                          self.cfg.stream)
            except Exception:  # noqa: BLE001 - unreadable now: not known to be ahead
                continue
            if done is not None and done >= self.frontier:
                out.append(t)
        return out

    def failed(self, exc: BaseException) -> ConsolidateFailed:
        """Record the failure as an incident; return the one-line error to raise."""
        import psycopg2

        cfg = self.cfg
        if self.table is None:          # a stage names the table it was at (`for_table`)
            self.table = getattr(exc, "tidemark_table", None)
        full = facts_behind(exc, LakeFull)
        if self.table is None and full is not None:       # a merge task's file: the table it belongs to
            path = str(full.get("path", ""))
            self.table = next((t for t in self.tables for uri in (table_uri, changelog_uri, history_uri)
                               if path.startswith(uri(cfg, t) + "/")), None)
        reason, fix = failure_reason(exc, cfg)     # a Spark failure: what ran out or is missing, and the fix
        value = facts_behind(exc, UnstorableValue)     # raised here, or only its text from an executor
        if value is not None:
            return self._unstorable(value)
        if isinstance(exc, psycopg2.Error):
            if self.step.endswith("control database") or self.step == "planning":
                which = f"the control database connection '{cfg.control_connection}'"
            else:
                which = (f"a database connection (source '{cfg.source.connection}' or control "
                         f"'{cfg.control_connection}')")
            verb = "was lost" if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)) else "failed"
            reason = f"{which} {verb} while {self.step}: {_redact(cfg, reason)}"
        seg, first_time = self._segment()
        ahead = self._ahead()
        remedy = (f"{fix or 'fix the cause'}, then run `tidemark consolidate {cfg.stream}` again: it resumes where it stopped "
                  "(tables already committed are skipped)")
        if ahead:
            remedy += (f"; until then {', '.join(ahead)} are ahead of the stream frontier: "
                       "read consistent tables with tidemark.lake.read_tables(cfg)")
        detail = {"table": self.table, "segment": None if seg is None else {"seq": seg.seq, "uri": seg.uri},
                  "position": format_lsn(first_time) if first_time is not None else None}
        if isinstance(exc, TableNeedsSnapshot):   # the gap sensor's resend step re-snapshots it alone
            detail["resnapshot"] = [exc.table]
            remedy = (f"re-snapshot {exc.table} alone while the stream runs: the consolidate DAG's resend step does it "
                      f"by itself; by hand: `tidemark snapshot {cfg.stream} --mode table --tables {exc.table}`, then "
                      "drain and consolidate (a consolidation before the drain waits for it)")
        parts = [f"stream {cfg.stream}"]
        if self.table:
            parts.append(f"table {self.table}")
        if seg is not None:
            parts.append(f"segment {seg.seq}")
        if self.start is not None and self.frontier is not None:
            parts.append(f"batch [{format_lsn(self.start)}, {format_lsn(self.frontier)})")
        if first_time is not None:
            parts.append(f"first change at {format_lsn(first_time)}")
        # a table's re-snapshot: the remedy on a line of its own (its reason names the change, not the remedy)
        return self._incident(f"{', '.join(parts)}, while {self.step}", reason, remedy, detail, ahead,
                              sep="\n" if isinstance(exc, TableNeedsSnapshot) else "; ")

    def _incident(self, what: str, reason: str, remedy: str, detail: dict, ahead: list[str],
                  sep: str = "; ") -> ConsolidateFailed:
        """Record the failure (``detail`` with where the batch was) as an incident; the one-line error."""
        detail = {"stream": self.cfg.stream, **detail, "step": self.step,
                  "lower": format_lsn(self.start) if self.start is not None else None,
                  "frontier": format_lsn(self.frontier) if self.frontier is not None else None,
                  "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "reason": reason,
                  "remedy": remedy, "tables_at_new_frontier": ahead,
                  "tables_not_reached": [t for t in self.tables if t not in ahead and t not in self.done]}
        incident = self._record(detail)
        recorded = f" (incident {incident})" if incident is not None else " (not recorded: the control database is unreachable)"
        return ConsolidateFailed(f"consolidation failed{recorded}: {what}: {reason}{sep}remedy: {remedy}",
                                 incident=incident, detail=detail)

    def _record(self, detail: dict) -> int | None:
        """Open a ``consolidate_failed`` incident; its id, or None if the control database is unreachable."""
        try:
            with open_control(self.cfg) as ctl:
                return ctl.open_incident(self.cfg.stream, "consolidate_failed", detail)
        except Exception as rec_exc:  # noqa: BLE001 - the control database may be what failed
            log.warning("stream %s: the failure could not be recorded as an incident: %s", self.cfg.stream, rec_exc)
        return None

    def _unstorable(self, facts: dict) -> ConsolidateFailed:
        """A landed value the lake type cannot hold: the remedy is a resend of the table (after correcting
        the value in the source), since running again fails the same way."""
        cfg = self.cfg
        table = facts["table"]
        self.table = table
        name = facts.get("segment") or ""
        seg = next((s for s in self.segments if name and s.uri.rsplit("/", 1)[-1] == name), None)
        segment = f"segment {seg.seq}" if seg is not None else f"segment {facts.get('segment')}"
        resend = f"tidemark snapshot {cfg.stream} --mode table --tables {table}"
        remedy = (f"correct the value in the source (or change the column to a type whose lake type holds it, "
                  f"e.g. unconstrained numeric), then resend the table: `{resend}`; running the consolidation "
                  "again fails the same way, because the value is in a landed segment")
        reason = (f"the value {facts['value']!r} of column {facts['column']} ({facts.get('type')}) cannot be stored "
                  f"in the lake: {facts.get('why')}")
        detail = {"table": table, "column": facts["column"],
                  "segment": {"seq": seg.seq if seg is not None else None,
                              "uri": seg.uri if seg is not None else facts.get("segment")},
                  "position": facts["lsn"], "value": facts["value"]}
        what = f"stream {cfg.stream}, table {table}, column {facts['column']}, {segment}, LSN {facts['lsn']}"
        return self._incident(what, reason, remedy, detail, self._ahead())

    def resolve(self, frontier: int | None) -> None:
        """A run succeeded: the stream's open consolidation failures are resolved (on the run's
        control connection, else on one of its own)."""
        try:
            with contextlib.nullcontext(self.ctl) if self.ctl is not None else open_control(self.cfg) as ctl:
                for i in ctl.incidents(self.cfg.stream):
                    if i["kind"] == "consolidate_failed":
                        ctl.resolve_incident(i["id"], f"consolidated to {format_lsn(frontier)}")
        except Exception as exc:  # noqa: BLE001 - the run itself succeeded
            log.warning("stream %s: open consolidation incidents not resolved: %s", self.cfg.stream, exc)

    def close(self) -> None:
        """Close the run's control connection (if open)."""
        ctl, self.ctl = self.ctl, None
        if ctl is not None:
            ctl.close()


def check_unstorable(bad, tables, snaps, frontier: int) -> None:
    """Raise `UnstorableValue` (an array value: `TableNeedsSnapshot`) for the first landed value the lake
    type cannot hold (null in the decoded part) of one of ``tables`` below ``frontier`` that no pending
    snapshot of its table at a later LSN supersedes."""
    for time, table, info in bad:
        if table not in tables or time >= frontier:
            continue
        if any(table in s.tables and s.lsn > time for s in snaps):
            continue
        facts = json.loads(info)
        if facts.get("fallback") == "text":     # an array value its lists cannot hold: the column goes to text
            why = (f"table {table} column {facts['column']}: the value at LSN {facts['lsn']} does not fit the lake "
                   f"type {facts['lake_type']} ({facts['why']}); the column is held as PostgreSQL's text from the "
                   "table's re-snapshot on, the rest of the table as it is")
            log.warning("%s", why)
            raise TableNeedsSnapshot(f"{why}; the lake table is replaced by a re-snapshot of that table alone while "
                                     "the stream runs", table=table)
        raise UnstorableValue(facts.get("segment", "?"), facts)
