"""Incidents: one open incident per cause (kind, table and what the failure says, without what changes
from one occurrence to the next), counted when it happens again, resolved by the step that repairs it."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from tidemark.control.connection import Connection
from tidemark.errors import normalize_reason, reason_line


# What changes from one occurrence of the same failure to the next: never part of an incident's cause.
VOLATILE_DETAIL_KEYS = frozenset({"at", "when", "now", "opened_at", "last_seen", "last_seen_at", "since",
                                  "started_at", "finished_at", "elapsed", "elapsed_seconds", "duration",
                                  "attempt", "try_number", "seen", "pid"})
# Kinds whose detail carries the run's context (the tables already done, the remedy naming them): their
# cause is these keys only.
CAUSE_KEYS = {"consolidate_failed": ("table", "step", "segment", "position", "reason")}
# kinds whose every number is incidental to the cause (a drain's failure names the segment it wrote, the
# bytes it needed, an LSN: the same failure at the next scheduled drain has other numbers)
NUMBERS_BLANKED = {"drain_failed"}
_NUMBER = re.compile(r"[0-9A-Fa-f]*[0-9][0-9A-Fa-f]*")
_WALL_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2}| ?UTC)?")


def incident_cause(kind: str, detail: dict) -> Any:
    """The part of an incident's detail that names its cause: for the kinds of `CAUSE_KEYS` those keys,
    else every key but the `VOLATILE_DETAIL_KEYS`; inside strings, wall-clock times are blanked and
    what else changes between occurrences (attempt numbers, pids, Spark stage and task ids,
    temporary names, a stack trace below the first meaningful line) is normalized
    (`tidemark.errors.normalize_reason`); for the kinds of `NUMBERS_BLANKED`, every number."""
    keys = CAUSE_KEYS.get(kind)
    kept = _without_times({k: v for k, v in detail.items() if (k in keys if keys else k not in VOLATILE_DETAIL_KEYS)})
    if kind in NUMBERS_BLANKED:
        kept = {k: _NUMBER.sub("#", v) if isinstance(v, str) else v for k, v in kept.items()}
    return kept


def _without_times(value: Any) -> Any:
    if isinstance(value, str):
        return normalize_reason(_WALL_TIME.sub("<time>", value))
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if k not in VOLATILE_DETAIL_KEYS}
    if isinstance(value, (list, tuple)):
        return [_without_times(v) for v in value]
    return value


def cause_key(kind: str, table: str | None, cause: Any) -> str:
    """A stable digest of (kind, table, cause)."""
    text = json.dumps([kind, table, cause], sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class IncidentsMixin(Connection):
    """The incidents of `Control`."""

    def open_incident(self, stream: str, kind: str, detail: dict) -> int:
        """Record an incident, one per cause (stream, kind, the detail's ``table``, `cause_key` of
        `incident_cause`): if an open incident of the same cause exists, count one more occurrence
        (``occurrences``, ``last_seen_at``, the latest ``detail``); return its id."""
        if isinstance(detail.get("reason"), str) and ("\n" in detail["reason"] or "\r" in detail["reason"]):
            # an incident's reason is one line: a Java stack trace or a Py4J dump is reduced to its first
            # meaningful line (the task's log keeps the whole text)
            detail = {**detail, "reason": reason_line(detail["reason"]) or detail["reason"].strip()}
        text = {k: v for k, v in detail.items() if isinstance(v, str)}
        table = text.get("table")
        key = cause_key(kind, table, incident_cause(kind, detail))
        return self._one("""INSERT INTO tidemark.incidents (stream, kind, detail, table_name, cause_key, step, reason)
                           VALUES (%s, %s, %s, %s, %s, %s, %s)
                           ON CONFLICT (stream, kind, cause_key) WHERE resolved_at IS NULL AND cause_key IS NOT NULL
                           DO UPDATE SET occurrences = tidemark.incidents.occurrences + 1,
                                         last_seen_at = clock_timestamp(), detail = EXCLUDED.detail,
                                         step = EXCLUDED.step, reason = EXCLUDED.reason
                           RETURNING id""",
                         (stream, kind, json.dumps(detail, default=str), table, key, text.get("step"),
                          text.get("reason")))[0]

    def incidents(self, stream: str, *, open_only: bool = True) -> list[dict]:
        """The stream's incidents (open ones only by default), oldest first, each with its ``count``
        of occurrences, when it was ``last_seen_at``, and the ``step`` and one-line ``reason`` of its
        cause (None for kinds whose detail has none)."""
        return self._dicts("""SELECT id, kind, detail, opened_at, resolved_at, resolution, table_name AS "table",
                                     occurrences AS "count", last_seen_at, step, reason FROM tidemark.incidents
                               WHERE stream = %s AND (NOT %s OR resolved_at IS NULL) ORDER BY id""",
                           (stream, open_only))

    def classify_incident(self, incident_id: int, failure_class: str) -> None:
        """Record what the job that met the incident's failure said of it (``deterministic`` or
        ``transient``), for a task that cannot read the job's own result (`failure_class_since`)."""
        if failure_class not in ("deterministic", "transient"):
            raise ValueError(f"failure class {failure_class!r} is not 'deterministic' or 'transient'")
        self._run("UPDATE tidemark.incidents SET failure_class = %s WHERE id = %s", (failure_class, incident_id))

    def failure_class_since(self, stream: str, kind: str, since) -> dict | None:
        """The newest open incident of ``kind`` seen on the stream at or after ``since`` (a time from
        `now`) whose job classified it: ``{"id", "class", "reason"}``, or None."""
        row = self._one("""SELECT id, failure_class, reason FROM tidemark.incidents
                            WHERE stream = %s AND kind = %s AND resolved_at IS NULL AND last_seen_at >= %s
                              AND failure_class IS NOT NULL ORDER BY last_seen_at DESC LIMIT 1""",
                        (stream, kind, since))
        return {"id": row[0], "class": row[1], "reason": row[2]} if row else None

    def resolve_incident(self, incident_id: int, resolution: str) -> None:
        self._run("""UPDATE tidemark.incidents SET resolved_at = now(), resolution = %s
                      WHERE id = %s AND resolved_at IS NULL""", (resolution, incident_id))
