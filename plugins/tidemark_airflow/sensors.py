"""The gap sensor: look at what landed and branch to consolidate, repair or resend (or skip the run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseSensorOperator, Context, PokeReturnValue
from airflow.sdk.bases.branch import BranchMixIn
from airflow.sdk.exceptions import AirflowFailException

from tidemark_airflow.hooks import TidemarkHook, lsn_text
from tidemark_airflow.operators import library_errors, skip


class TidemarkGapSensor(BaseSensorOperator, BranchMixIn):
    """Poke the gap detector; done when the next step is consolidate, repair or resend (not wait), and
    then branch to that task: the others directly downstream are skipped. One task decides and
    branches (a sensor and a branch operator were two task starts, seconds, on the path of every change).

    Runs in ``reschedule`` mode: between pokes the worker slot is free. ``wait`` means nothing is
    pending (no gap, nothing landed above the frontier: another run consolidated it already): the
    sensor is skipped at once with that reason (an explicit skip), and so is the rest of the run;
    the next landing Asset event starts the next run. Incomplete segments are reported by the
    library as gaps, so the sensor never waits on them. A task id it may branch to that is not
    downstream of it (an external feed's DAG has no repair or resend) is not chosen: the library
    decides only ``consolidate`` or ``wait`` for a feed.

    Only "nothing to do" skips. Every error fails the task: a deterministic one at once (red, no
    retries), a transient one after its retries. ``soft_fail`` and ``never_fail`` are refused: with
    either, Airflow's sensor turns a failure (a broken stream) into a skip, which alerts nobody.
    """

    template_fields: Sequence[str] = ("stream_file",)
    ui_color = "#f6e3b4"

    def __init__(self, *, stream_file: str, mode: str = "reschedule", poke_interval: float = 30,
                 timeout: float = 300, consolidate_task_id: str = "consolidate", repair_task_id: str = "repair",
                 resend_task_id: str = "resend", **kwargs: Any) -> None:
        for flag in ("soft_fail", "never_fail", "silent_fail"):
            if kwargs.get(flag):
                raise ValueError(f"TidemarkGapSensor {kwargs.get('task_id')!r}: {flag}=True would turn a broken "
                                 "stream into a skip; the sensor skips only when there is nothing to consolidate")
        super().__init__(mode=mode, poke_interval=poke_interval, timeout=timeout, soft_fail=False,
                         never_fail=False, **{k: v for k, v in kwargs.items() if k not in ("soft_fail", "never_fail")})
        self.stream_file = stream_file
        self.targets = {"consolidate": consolidate_task_id, "repair": repair_task_id, "resend": resend_task_id}

    def poke(self, context: Context) -> PokeReturnValue:
        with library_errors(self.log):
            action, report = TidemarkHook(stream_file=self.stream_file).decide()
        self.log.info("next step %s; gap report %s", action, lsn_text(report))
        if action == "wait":
            frontier = lsn_text({'frontier': report.get('frontier')})['frontier']
            if report.get("decision") == "producer":     # an external feed waiting on its producer
                skip(self.log, f"nothing to consolidate above the frontier {frontier}: the feed waits for its "
                               f"producer: {'; '.join(report.get('reasons') or [])}")
            skip(self.log, f"nothing to consolidate: no gap and nothing landed above the frontier {frontier}")
        return PokeReturnValue(is_done=True, xcom_value={"action": action, "report": report})

    def execute(self, context: Context) -> Any:
        decided = super().execute(context)
        target = self.targets[decided["action"]]
        if target not in self.downstream_task_ids:
            raise AirflowFailException(f"TidemarkGapSensor {self.task_id!r}: the next step is {decided['action']} but task "
                             f"{target!r} is not downstream of it (downstream: {sorted(self.downstream_task_ids)})")
        self.do_branch(context, target)
        return decided
