"""The embedded default's supervisor, without Airflow: a component that keeps exiting is restarted at
once, then after 2, 4, 8 ... up to 60 s; one that stayed up a while is restarted at once again; a
zombie counts as dead and a reused pid as another process."""

from __future__ import annotations

import subprocess
import time

import pytest

from tidemark.local import embedded, processes, supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def recorded(tmp_path):
    """Four recorded 'components' (sleep processes) in ``home``; yields (home, processes)."""
    home = tmp_path / "home"
    embedded.airflow_home(home).mkdir(parents=True)
    procs = {n: subprocess.Popen(["sleep", "300"], start_new_session=True) for n in embedded.COMPONENTS}
    embedded._write_info(home, {"pids": {n: p.pid for n, p in procs.items()},
                                "starts": {n: processes.process_start(p.pid) for n, p in procs.items()}})
    yield home, procs
    for p in procs.values():
        p.kill()
        p.wait()


def test_a_component_that_keeps_exiting_is_restarted_with_backoff(recorded, monkeypatch):
    home, procs = recorded
    clock = Clock()
    monkeypatch.setattr(supervisor.time, "monotonic", clock.monotonic)
    starts: list[float] = []
    children = []

    def start(home_, name, env):      # a scheduler that exits at once, every time
        assert name == "scheduler"
        starts.append(clock.now)
        children.append(subprocess.Popen(["true"], start_new_session=True))
        return children[-1]

    monkeypatch.setattr(embedded, "start_component", start)
    procs["scheduler"].kill()
    procs["scheduler"].wait()
    sup = supervisor.Supervisor(home)
    while clock.now < 1000 + 200:
        if children:
            children[-1].wait()       # exited (a zombie until the supervisor polls it)
        for name in embedded.COMPONENTS:
            sup.check(name, embedded.read_info(home))
        clock.now += 0.5
    # each exit is seen one 0.5 s step after the start, then the backoff
    gaps = [b - a - 0.5 for a, b in zip(starts, starts[1:])]
    assert starts[0] == 1000 and gaps[:6] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0] and set(gaps[6:]) <= {60.0}
    assert embedded.read_info(home)["pids"]["scheduler"] == children[-1].pid
    # the others were never touched
    assert all(embedded.read_info(home)["pids"][n] == procs[n].pid for n in embedded.COMPONENTS if n != "scheduler")

    # one that stayed up longer than STABLE_SECONDS is restarted at once when it exits
    stable = subprocess.Popen(["sleep", "300"], start_new_session=True)
    monkeypatch.setattr(embedded, "start_component", lambda home_, name, env: stable)
    clock.now += 60      # the last retry is due
    sup.check("scheduler", embedded.read_info(home))
    assert embedded.read_info(home)["pids"]["scheduler"] == stable.pid
    clock.now += supervisor.STABLE_SECONDS + 1
    stable.kill()
    stable.wait()
    again = subprocess.Popen(["sleep", "300"], start_new_session=True)
    monkeypatch.setattr(embedded, "start_component", lambda home_, name, env: again)
    sup.check("scheduler", embedded.read_info(home))
    assert embedded.read_info(home)["pids"]["scheduler"] == again.pid
    again.kill()
    again.wait()


def test_liveness_sees_zombies_and_reused_pids():
    proc = subprocess.Popen(["sleep", "300"])
    start = processes.process_start(proc.pid)
    assert processes.alive(proc.pid, start)
    assert not processes.alive(proc.pid, start + 1)          # the same number, another process
    proc.kill()
    time.sleep(0.2)                                          # not reaped yet: a zombie
    assert not processes.alive(proc.pid)
    proc.wait()
    assert not processes.alive(proc.pid)


def test_the_spark_connect_server_is_a_component_when_up_gave_it_a_port():
    """The embedded Spark Connect server is supervised like Airflow's components, on its recorded port,
    with the driver memory a local spark-submit gets and Spark's console output at WARN."""
    assert embedded.components({}) == embedded.COMPONENTS
    assert embedded.components({"spark_connect_port": 15002}) == (*embedded.COMPONENTS, embedded.SPARK_CONNECT)
    cmd = embedded.spark_connect_command(15002)
    assert "org.apache.spark.sql.connect.service.SparkConnectServer" in cmd
    assert "spark.connect.grpc.binding.port=15002" in cmd and "spark.connect.grpc.binding.address=127.0.0.1" in cmd
    assert any(c.startswith("spark.driver.memory=") for c in cmd)
    assert any(c.startswith("spark.driver.extraJavaOptions=") and "tidemark.spark.level=WARN" in c for c in cmd)
