"""One embedded Airflow for the tests of ``tests/dags``, shared by the live-scheduler test and the
status-page tests. It stops after the last test of this directory (`pytest_runtest_teardown`), so its
four processes do not run beside the rest of the suite.

Its four components (api-server, scheduler, dag-processor, triggerer; LocalExecutor) run on the
test cluster (Airflow's metadata database ``airflow``, the demo's ``demo`` and ``tidemark``
databases). Its streams dir holds a copy of the demo stream file; a test adds its own stream file
there (before asking for the Airflow, so that the first parse already has its DAGs) and removes it
when done. Stopping it must leave nothing running.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tidemark.local import embedded
from tidemark.local.localpg import free_port


@pytest.fixture(scope="session")
def airflow_streams_dir():
    """The shared Airflow's ``TIDEMARK_STREAMS_DIR``: the demo stream file, and what tests add."""
    from tidemark.local.demo import DEMO_STREAM_YAML

    home = Path(tempfile.mkdtemp(prefix="tidemark-airflow-"))
    os.chmod(home, 0o755)
    streams = home / "streams"
    streams.mkdir()
    shutil.copy(DEMO_STREAM_YAML, streams / DEMO_STREAM_YAML.name)
    yield streams
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_airflow(pg_cluster, airflow_streams_dir):
    """The embedded Airflow on the test cluster (not port 8080: the machine is shared), DAGs paused at
    creation. Yields ``home``, ``info`` (URLs and login), ``cluster`` and ``streams``."""
    home = airflow_streams_dir.parent / "home"
    home.mkdir()
    extra = {"TIDEMARK_STREAMS_DIR": str(airflow_streams_dir), "AIRFLOW__CORE__PARALLELISM": "8",
             "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2"}
    try:
        info = embedded.up(home, port=free_port(), unpause=False, timeout=300, cluster=pg_cluster, extra_env=extra)
        _RUNNING.append(home)
        yield SimpleNamespace(home=home, info=info, cluster=pg_cluster, streams=airflow_streams_dir)
    finally:
        if home in _RUNNING:
            _RUNNING.remove(home)
        embedded.down(home)
        assert embedded.leftovers(home) == [], "stopping the embedded Airflow must leave nothing running"


_RUNNING: list[Path] = []          # the shared Airflow's home while it runs
HERE = Path(__file__).resolve().parent


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of ``tests/dags`` in the run: stop the shared Airflow now, not at the
    session's end (a test may ask for it with ``request.getfixturevalue``, so any test of this
    directory still to come keeps it). After the test's own fixtures are torn down: they may still
    call the Airflow (the live test pauses its DAGs)."""
    result = yield
    if not _RUNNING:
        return result
    items = item.session.items
    if not any(Path(i.path).resolve().parent == HERE for i in items[items.index(item) + 1:]):
        embedded.down(_RUNNING.pop())
    return result
