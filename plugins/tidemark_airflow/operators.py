"""Thin operators over `TidemarkHook`: ``__init__`` stores arguments, ``execute`` builds the hook."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.providers.standard.utils.skipmixin import SkipMixin
from airflow.sdk import BaseBranchOperator, BaseOperator, Context

from tidemark_airflow.hooks import TidemarkHook


class TidemarkStreamOperator(BaseOperator):
    """Base of the stream operators: holds the stream file and builds the hook lazily."""

    template_fields: Sequence[str] = ("stream_file",)
    ui_color = "#d8ecf3"

    def __init__(self, *, stream_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream_file = stream_file

    def get_hook(self) -> TidemarkHook:
        """Build the hook for this stream."""
        return TidemarkHook(stream_file=self.stream_file)


class TidemarkApplyOperator(TidemarkStreamOperator):
    """Validate the stream against its source, align its publication and register it."""

    def execute(self, context: Context) -> dict:
        return self.get_hook().apply()


class TidemarkSnapshotOperator(TidemarkStreamOperator):
    """Snapshot some or all tables of the stream (``initial``) or re-snapshot them (``resend``)."""

    template_fields: Sequence[str] = ("stream_file", "tables", "mode", "chunk_pages", "parallelism")

    def __init__(self, *, stream_file: str, tables: list[str] | str | None = None, mode: str = "initial",
                 chunk_pages: int | str | None = None, parallelism: int | str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(stream_file=stream_file, **kwargs)
        self.tables = tables
        self.mode = mode
        self.chunk_pages = chunk_pages
        self.parallelism = parallelism

    def execute(self, context: Context) -> dict:
        if self.mode not in ("initial", "resend"):
            raise ValueError(f"snapshot mode {self.mode!r} is not 'initial' or 'resend'")
        hook = self.get_hook()
        if self.mode == "resend":
            return hook.resend(tables=self.tables)
        return hook.snapshot(tables=self.tables, mode=self.mode, chunk_pages=_int_or_none(self.chunk_pages),
                             parallelism=_int_or_none(self.parallelism))


class TidemarkDrainOperator(TidemarkStreamOperator):
    """Drain the replication slot into new landing segments (declare the landing Asset as outlet)."""

    ui_color = "#c9e4ca"

    def execute(self, context: Context) -> list[dict]:
        return self.get_hook().drain()


class TidemarkSweepOperator(TidemarkStreamOperator):
    """Register or discard segments that were written but never registered (a drain killed between)."""

    def execute(self, context: Context) -> dict:
        return self.get_hook().sweep()


class TidemarkGapBranchOperator(BaseBranchOperator):
    """Follow the gap report: consolidate, repair (slot covers the hole) or resend (it does not)."""

    template_fields: Sequence[str] = ("stream_file",)
    ui_color = "#f6e3b4"

    def __init__(self, *, stream_file: str, consolidate_task_id: str = "consolidate",
                 repair_task_id: str = "repair", resend_task_id: str = "resend", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream_file = stream_file
        self.consolidate_task_id = consolidate_task_id
        self.repair_task_id = repair_task_id
        self.resend_task_id = resend_task_id

    def choose_branch(self, context: Context) -> str | None:
        action, report = TidemarkHook(stream_file=self.stream_file).decide()
        self.log.info("next step %s; gap report: %s", action, report)
        targets = {"consolidate": self.consolidate_task_id, "repair": self.repair_task_id,
                   "resend": self.resend_task_id, "wait": None}  # wait: nothing pending, skip the rest
        return targets[action]


class TidemarkRepairOperator(TidemarkStreamOperator):
    """Re-drain exactly the missing LSN ranges the slot still covers and write the missing segments."""

    ui_color = "#f3d2c1"

    def execute(self, context: Context) -> dict:
        return self.get_hook().repair()


class TidemarkResendOperator(TidemarkStreamOperator):
    """Forget lost segments, re-snapshot the affected tables at a new consistent point, move the frontier."""

    template_fields: Sequence[str] = ("stream_file", "tables")
    ui_color = "#f3c1c1"

    def __init__(self, *, stream_file: str, tables: list[str] | str | None = None, **kwargs: Any) -> None:
        super().__init__(stream_file=stream_file, **kwargs)
        self.tables = tables

    def execute(self, context: Context) -> dict:
        return self.get_hook().resend(tables=self.tables)


class TidemarkConsolidateOperator(TidemarkStreamOperator):
    """Consolidate in the worker's process (local Spark); the DAGs use SparkSubmitOperator instead."""

    def execute(self, context: Context) -> dict:
        return self.get_hook().consolidate()


class TidemarkSkipSparkIfIdleOperator(BaseOperator, SkipMixin):
    """Before spark-submit: when only progress landed since the frontier, advance the frontier,
    checkpoint and slot in the control database and skip the Spark task (logged as the reason)."""

    template_fields: Sequence[str] = ("stream_file",)
    ui_color = "#e8e8e8"

    def __init__(self, *, stream_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream_file = stream_file

    def execute(self, context: Context) -> dict | None:
        result = TidemarkHook(stream_file=self.stream_file).advance_if_idle()
        if result is None:
            self.log.info("records landed since the frontier: Spark consolidates them")
            return None
        self.log.info("only progress landed: frontier %s -> %s in the control database, no Spark job; "
                      "skipping %s", result["frontier_before"], result["frontier_after"],
                      sorted(self.downstream_task_ids))
        self.skip(ti=context["ti"], tasks=[t for t in context["task"].get_direct_relatives(upstream=False)
                                            if not t.is_teardown])
        return result


class TidemarkChangelogOperator(TidemarkStreamOperator):
    """Write the changelog partition of the run's data interval from retained segments."""

    def execute(self, context: Context) -> dict:
        start, end = context["data_interval_start"], context["data_interval_end"]
        if start is None or end is None:
            raise ValueError("the changelog needs a data interval; trigger it with a logical date")
        return self.get_hook().changelog(start=start, end=end)


class TidemarkMetricsOperator(TidemarkStreamOperator):
    """Record the consumer metrics and slot lag in the control database."""

    def execute(self, context: Context) -> dict:
        return self.get_hook().record_metrics()


def _int_or_none(value: int | str | None) -> int | None:
    """Read an optional integer that may arrive as a rendered template string."""
    if value is None or value == "" or value == "None":
        return None
    return int(value)
