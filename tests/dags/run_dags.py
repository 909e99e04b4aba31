"""Run DAGs of this checkout one after another with ``dag.test()`` and print each run's task states
as JSON (run in a child process by the flow tests, so Airflow's settings stay out of pytest).

Usage: run_dags.py '[{"dag_id": "...", "conf": {...}}, ...]'
With ``{"kill_drain_before_register": true}`` as a step, the drain is run directly through the library
and this process is killed (``os._exit``) after the segment file is written, before it is registered.
"""

from __future__ import annotations

import json
import os
import sys


def kill_drain_before_register(stream_file: str) -> None:
    """Drain with the process killed between writing the segment and registering it."""
    from tidemark.config import load_config
    from tidemark.control import Control
    from tidemark.capture.drain import drain_stream

    def die(self, seg):
        print(json.dumps({"killed_before_registering": seg.seq}), flush=True)
        os._exit(137)
    Control.register_segment = die
    drain_stream(load_config(stream_file))
    raise SystemExit("the drain found nothing to write; nothing was killed")


def _state(state) -> str | None:
    return None if state is None else str(getattr(state, "value", state))


def main() -> None:
    steps = json.loads(sys.argv[1])
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    if bag.import_errors:
        raise SystemExit(f"import errors: {bag.import_errors}")
    runs = []
    for step in steps:
        if "kill_drain_before_register" in step:
            kill_drain_before_register(step["stream_file"])
        dag = bag.dags[step["dag_id"]]
        dr = dag.test(run_conf=step.get("conf"), mark_success_pattern=step.get("mark_success"))
        tis = {ti.task_id: _state(ti.state) for ti in dr.get_task_instances()}
        runs.append({"dag_id": step["dag_id"], "state": _state(dr.state), "tasks": tis})
        print(json.dumps({"progress": runs[-1]}), flush=True)
    print(json.dumps({"runs": runs}), flush=True)


if __name__ == "__main__":
    main()
