"""The embedded default's supervisor: restarts an Airflow component (or the Spark Connect server) that
exits, with backoff (`backoff`).

`tidemark.local.embedded.up` starts it (``python -m tidemark.local.supervisor HOME``) with the
components' environment. Every `POLL_SECONDS` it checks each component recorded in ``pids.json``; one
that exited (a zombie counts) has what is left of its process group stopped (a dead scheduler's
workers, a dead api-server's worker holding the port), then is started again with the same command
and environment and recorded; one that exits within `STABLE_SECONDS` of its start waits longer each
time, so a component that cannot start does not spin. SIGHUP restarts
whatever is dead now, backoff reset; SIGTERM stops the supervisor alone. It exits when ``pids.json`` is
gone or records another supervisor; one runs per home (a lock on ``supervisor.lock``). Each exit and
restart is a line in ``logs/supervisor.log``.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
from pathlib import Path

from tidemark.local import embedded
from tidemark.local.processes import alive, stop_groups

POLL_SECONDS = 1.0
STABLE_SECONDS = 60.0        # a component up this long has its backoff reset when it exits
MAX_BACKOFF_SECONDS = 60.0


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} supervisor[{os.getpid()}]: {message}", flush=True)


def backoff(failures: int) -> float:
    """Seconds before restarting a component that exited ``failures`` times in a row, each within
    `STABLE_SECONDS` of its start (0: at once)."""
    return 0.0 if failures <= 1 else min(MAX_BACKOFF_SECONDS, 2.0 ** (failures - 1))


class Supervisor:
    def __init__(self, home: Path):
        self.home = Path(home).resolve()
        self.stopping = False
        self.woken = False
        self.children: dict[int, object] = {}     # pid -> Popen of the components this supervisor started
        self.failures: dict[str, int] = {}        # quick exits in a row
        self.started_at: dict[str, float] = {}    # monotonic time of this supervisor's last start of each
        self.retry_at: dict[str, float] = {}      # a dead component's next start

    def run(self) -> int:
        lock = open(embedded.airflow_home(self.home) / "supervisor.lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another supervisor runs for this home: exiting")
            return 0
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGHUP, self._wake)
        if not embedded.record_process(self.home, embedded.SUPERVISOR, os.getpid()):
            log("nothing is recorded in pids.json (stopped): exiting")
            return 0
        log(f"supervising {', '.join(embedded.components(embedded.read_info(self.home)))} of "
            f"{embedded.airflow_home(self.home)}")
        while not self.stopping:
            info = embedded.read_info(self.home)
            if info.get("pids", {}).get(embedded.SUPERVISOR) != os.getpid():
                log("pids.json is gone or records another supervisor: exiting")
                return 0
            if self.woken:
                self.woken = False
                self.failures.clear()
                self.retry_at = {name: 0.0 for name in self.retry_at}
            for name in embedded.components(info):
                if not self.stopping:
                    self.check(name, info)
            self._sleep(POLL_SECONDS)
        log("stopped (SIGTERM)")
        return 0

    def check(self, name: str, info: dict) -> None:
        pid = info["pids"].get(name)
        if pid is not None and alive(pid, info.get("starts", {}).get(name)):
            return
        now = time.monotonic()
        if name not in self.retry_at:       # just found dead
            quick = now - self.started_at.get(name, float("-inf")) < STABLE_SECONDS
            self.failures[name] = self.failures.get(name, 0) + 1 if quick else 1
            delay = backoff(self.failures[name])
            self.retry_at[name] = now + delay
            log(f"{name} (pid {pid}) {self._exit(pid)}; restarting it "
                + ("now" if not delay else f"in {delay:.0f} s ({self.failures[name]} exits in a row)"))
            if pid is not None:
                stop_groups(pid)     # its children: executor workers, tasks, a worker on the port
        if now < self.retry_at[name] or self.stopping:
            return
        proc = embedded.start_component(self.home, name, dict(os.environ))
        self.children[proc.pid] = proc
        self.started_at[name] = time.monotonic()
        del self.retry_at[name]
        if not embedded.record_process(self.home, name, proc.pid, only_if=pid):
            log(f"{name} was recorded by someone else meanwhile: stopping the one just started")
            stop_groups(proc.pid)
            return
        log(f"{name} started: pid {proc.pid}")

    def _exit(self, pid: int | None) -> str:
        proc = self.children.pop(pid, None)
        code = proc.poll() if proc is not None else None
        if code is None:
            return "is gone"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not (self.stopping or self.woken) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _stop(self, signum, frame) -> None:
        self.stopping = True

    def _wake(self, signum, frame) -> None:
        self.woken = True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tidemark.local.supervisor HOME", file=sys.stderr)
        return 2
    return Supervisor(Path(args[0])).run()


if __name__ == "__main__":
    sys.exit(main())
