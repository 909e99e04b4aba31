"""The CDC status page in the Airflow UI, in a real headless browser (Debian's chromium).

The session's embedded Airflow (api-server with the Tidemark plugin; tests/dags/conftest.py) runs on
the test cluster; the demo stream is snapshotted, fed by the workload, drained into real segments
with metrics sampled after each drain, and one segment is corrupted so that gap detection opens a
real incident. The page must refuse a request without Airflow's login, list the plugin's views, and
show in the browser (logged in with the UI's ``_token`` cookie) what the control database holds:
positions as ``0/16B3748``, the incident's reason, the segments, and SVG charts with one point per
sample. A screenshot is saved in the test's tmp dir (its path is printed).

Who sees what: a second api-server on the same metadata database runs the per-DAG test auth manager
(stream_scoped_auth.py: SimpleAuthManager plus DAG grants) over two streams, demo and ledger; a user
granted one stream's DAGs sees that stream and nothing of the other, a user granted one DAG of a
stream sees neither, the admin sees both, and a ``dag_id`` the user may not read is a 403.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests


from airflow_env import ROOT, airflow_env, run_json

pytestmark = [pytest.mark.airflow, pytest.mark.slow]
HERE = Path(__file__).resolve().parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = '<img id="pwned" src="x">'


@pytest.fixture(scope="module")
def airflow_up(embedded_airflow):
    """The session's embedded Airflow (tests/dags/conftest.py): its streams dir holds the demo stream."""
    return embedded_airflow.home, embedded_airflow.info


@pytest.fixture(scope="module")
def demo_stream(embedded_airflow):
    """The demo stream with real segments, metrics samples and a real incident; returns its control state."""
    home, cluster = embedded_airflow.home, embedded_airflow.cluster
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW_CONN_TIDEMARK_SOURCE", cluster.uri("demo"))
        mp.setenv("AIRFLOW_CONN_TIDEMARK_CONTROL", cluster.uri("tidemark"))
        mp.setenv("TIDEMARK_HOME", str(home))
        from tidemark import gaps
        from tidemark.capture.drain import drain_stream
        from tidemark.capture.snapshot import snapshot_stream
        from tidemark.capture.source import apply_stream
        from tidemark.config import load_config
        from tidemark.control import open_control
        from tidemark.status import stream_status
        from tidemark.local.demo import DEMO_STREAM_YAML, load_demo_schema, run_workload

        load_demo_schema(cluster.dsn("demo"), customers=30)
        cfg = load_config(DEMO_STREAM_YAML)
        apply_stream(cfg)
        snapshot_stream(cfg, chunk_pages=64, parallelism=1)
        stream_status(cfg)
        drained = []
        for seed in (1, 2, 3):
            time.sleep(0.3)
            run_workload(cluster.dsn("demo"), transactions=30 * seed, seed=seed)
            drained.append(drain_stream(cfg))
            if seed == 2:  # the frontier as a consolidation of the first segment records it (no Spark here)
                with open_control(cfg) as ctl:
                    ctl.advance_frontier(cfg.stream, drained[0].upper, committed_segment=drained[0].seq)
            stream_status(cfg)
        bad = Path(urlsplit(drained[-1].uri).path)
        bad.write_bytes(b"not an avro file")        # gap detection quarantines it and opens an incident
        gaps.detect(cfg)
        with open_control(cfg) as ctl:
            ctl.open_incident(cfg.stream, "gap", {"reason": HOSTILE})
            return {"state": ctl.stream(cfg.stream), "incidents": ctl.incidents(cfg.stream),
                    "history": ctl.metrics_history(cfg.stream), "segments": ctl.recent_segments(cfg.stream),
                    "drained": drained}


def _token(info: dict) -> str:
    resp = requests.post(info["ui_url"] + "/auth/token", json={"username": info["username"],
                                                               "password": info["password"]}, timeout=30)
    assert resp.status_code in (200, 201), resp.text
    return resp.json()["access_token"]


def test_the_page_requires_airflow_login_and_is_registered_in_the_ui(airflow_up, demo_stream):
    _, info = airflow_up
    page = info["ui_url"] + "/tidemark/status/"
    assert requests.get(page, timeout=30).status_code == 401
    assert requests.get(page, cookies={"_token": "forged"}, timeout=30).status_code in (401, 403)
    assert requests.get(page, headers={"Authorization": "Bearer forged"}, timeout=30).status_code in (401, 403)
    token = _token(info)
    resp = requests.get(page, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    assert resp.status_code == 200 and 'data-stream="demo"' in resp.text
    plugins = requests.get(info["api_url"] + "/plugins", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    (mine,) = [p for p in plugins.json()["plugins"] if p["name"] == "tidemark"]
    assert [a["url_prefix"] for a in mine["fastapi_apps"]] == ["/tidemark"]
    views = {v["destination"]: v["href"] for v in mine["external_views"]}
    assert views == {"nav": "tidemark/status/", "dag": "tidemark/status/?dag_id={DAG_ID}"}


class Chromium:
    """Headless chromium driven over the DevTools protocol (websockets, no other dependency)."""

    def __init__(self, profile: Path):
        from websockets.sync.client import connect

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", "--window-size=1280,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError("chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        targets = requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        self.ws = connect(ws_url, max_size=None, open_timeout=30)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self.next_id:
                assert "error" not in msg, f"{method}: {msg['error']}"
                return msg["result"]
            self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method:
                    return self.events.pop(i)
            self.events.append(json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic()))))

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed and could not be installed "
                                                "(scripts/setup.sh runs: apt-get install -y chromium)")
def test_the_page_in_a_browser_shows_the_control_database(airflow_up, demo_stream, tmp_path):
    _, info = airflow_up
    from tidemark.lsn import format_lsn

    browser = Chromium(tmp_path / "profile")
    try:
        browser.call("Network.enable")
        browser.call("Page.enable")
        host = urlsplit(info["ui_url"]).hostname
        assert browser.call("Network.setCookie", name="_token", value=_token(info), domain=host, path="/",
                            httpOnly=True)["success"]
        browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=1000, deviceScaleFactor=1, mobile=False)
        browser.call("Page.navigate", url=info["ui_url"] + "/tidemark/status/?dag_id=tidemark_demo_drain")
        browser.wait_event("Page.loadEventFired")
        facts = json.loads(browser.call("Runtime.evaluate", returnByValue=True, expression="""JSON.stringify({
            text: document.body.innerText,
            section: !!document.querySelector('section[data-stream="demo"].current'),
            pwned: !!document.getElementById('pwned'),
            reasons: [...document.querySelectorAll('section[data-stream="demo"] td.reason')].map(t => t.textContent),
            charts: Object.fromEntries([...document.querySelectorAll('svg.chart')].map(s => [s.id,
                {circles: s.querySelectorAll('circle').length,
                 points: (s.querySelector('polyline')?.getAttribute('points') || '').trim().split(/\\s+/).filter(Boolean).length}])),
            segments: [...document.querySelectorAll('section[data-stream="demo"] table.segments tr td:first-child')].map(t => t.textContent),
        })""")["result"]["value"])
        shot = tmp_path / "cdc-status.png"
        shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png",
                                                       captureBeyondViewport=True)["data"]))
        print(f"\nstatus page screenshot: {shot}")

        # the same page inside Airflow's UI: the nav entry's route embeds it
        browser.call("Page.navigate", url=info["ui_url"] + "/plugin/tidemark_status")
        browser.wait_event("Page.loadEventFired")
        frame, deadline = "", time.monotonic() + 60
        while not frame and time.monotonic() < deadline:
            time.sleep(0.5)
            frame = browser.call("Runtime.evaluate", returnByValue=True, expression=(
                "[...document.querySelectorAll('iframe')].map(f => f.src).join(' ')"))["result"]["value"]
        time.sleep(2)
        ui_shot = tmp_path / "cdc-status-in-airflow-ui.png"
        ui_shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
        print(f"status page in the Airflow UI: {ui_shot}")
    finally:
        browser.close()

    state, history = demo_stream["state"], demo_stream["history"]
    text = facts["text"]
    assert facts["section"], "the drain DAG's stream is highlighted"
    assert state.frontier == demo_stream["drained"][0].upper
    assert f"frontier (consolidated upper)\t{format_lsn(state.frontier)}" in text and format_lsn(state.frontier).startswith("0/")
    assert f"current / committed segment\t{demo_stream['drained'][-1].seq} / {demo_stream['drained'][0].seq}" in text
    assert f"landed upper\t{format_lsn(state.landed_upper)}" in text and format_lsn(state.landed_upper).startswith("0/")
    # the incidents of the control database with their reasons, as text (the hostile one escaped)
    assert facts["reasons"] == [i["detail"]["reason"] for i in demo_stream["incidents"]]
    assert HOSTILE in facts["reasons"] and not facts["pwned"]
    assert any("not an avro file" in r or "checksum" in r or "segment" in r for r in facts["reasons"][:-1])
    # one point per sample; changes/s needs a previous sample
    assert len(history) == 4
    charts = facts["charts"]
    assert charts["chart-lag-bytes-demo"] == {"circles": 4, "points": 4}
    rates = [h["changes_per_second"] for h in history if h["changes_per_second"] is not None]
    assert len(rates) == 3 and all(r > 0 for r in rates)
    assert charts["chart-changes-demo"] == {"circles": 3, "points": 3}
    assert facts["segments"] == [str(s["seq"]) for s in demo_stream["segments"]]
    assert "quarantined" in text                                  # the corrupted segment
    assert shot.stat().st_size > 10_000
    assert frame == info["ui_url"] + "/tidemark/status/"


# -- who sees what -----------------------------------------------------------------------------------

LEDGER_YAML = """stream: ledger
source:
  connection: tidemark_source
  publication: tidemark_ledger
  slot: tidemark_ledger
  tables: [public.customers]
control:
  connection: tidemark_control
landing:
  url: ${TIDEMARK_HOME}/landing-ledger
lake:
  path: ${TIDEMARK_HOME}/lake-ledger
"""
BROKEN_YAML = "stream: secretstream\nsource: {connection: tidemark_source, tables: [public.customers]}\n"
LEDGER_REASON = "ledger-only incident: segment 41 of the ledger stream is missing"
DEMO_DAGS = [f"tidemark_demo_{k}" for k in ("snapshot", "drain", "consolidate", "changelog", "maintain")]
LEDGER_DAGS = [f"tidemark_ledger_{k}" for k in ("snapshot", "drain", "consolidate", "changelog", "maintain")]
GRANTS = {"demo_reader": DEMO_DAGS, "ledger_reader": LEDGER_DAGS, "one_dag": ["tidemark_ledger_consolidate"]}


@pytest.fixture(scope="module")
def scoped_api(embedded_airflow, demo_stream, tmp_path_factory):
    """A second api-server (the plugin's page behind the per-DAG test auth manager) on the shared
    Airflow's metadata and control databases, with two streams: demo (segments, incidents) and
    ledger (registered, with its own incident). Yields its URL and each user's password."""
    from tidemark.capture.source import apply_stream
    from tidemark.config import load_config
    from tidemark.control import open_control
    from tidemark.local import embedded
    from tidemark.local.demo import DEMO_STREAM_YAML
    from tidemark.local.localpg import free_port

    cluster = embedded_airflow.cluster
    home = tmp_path_factory.mktemp("scoped-airflow")
    streams = home / "streams"
    streams.mkdir()
    shutil.copy(DEMO_STREAM_YAML, streams / DEMO_STREAM_YAML.name)
    (streams / "ledger.yaml").write_text(LEDGER_YAML)
    (streams / "secret.yaml").write_text(BROKEN_YAML)        # a broken file: no landing, no lake
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW_CONN_TIDEMARK_SOURCE", cluster.uri("demo"))
        mp.setenv("AIRFLOW_CONN_TIDEMARK_CONTROL", cluster.uri("tidemark"))
        mp.setenv("TIDEMARK_HOME", str(embedded_airflow.home))
        ledger = load_config(streams / "ledger.yaml")
        apply_stream(ledger)
        with open_control(ledger) as ctl:
            ctl.open_incident("ledger", "gap", {"reason": LEDGER_REASON})

    port = free_port()
    env = embedded.airflow_env(home, cluster, port=port, unpause=False)
    ahome = embedded.airflow_home(home)
    passwords = {u: f"pw-{u}-{os.urandom(6).hex()}" for u in ("admin", *GRANTS)}
    (ahome / "passwords.json").write_text(json.dumps(passwords))          # mode 0600 (made by airflow_env)
    env.update({
        "AIRFLOW__CORE__AUTH_MANAGER": "stream_scoped_auth.StreamScopedAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{u}:{'admin' if u == 'admin' else 'viewer'}"
                                                             for u in passwords),
        "TIDEMARK_TEST_DAG_GRANTS": json.dumps(GRANTS),
        "TIDEMARK_STREAMS_DIR": str(streams),
        "TIDEMARK_HOME": str(embedded_airflow.home),
        "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
    })
    log = ahome / "api-server.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen([embedded.airflow_bin(), "api-server"], env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(ahome))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if requests.get(url + "/api/v2/version", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert proc.poll() is None, f"the scoped api-server exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the scoped api-server did not start: {log.read_text()[-3000:]}"
            time.sleep(1)
        yield {"url": url, "passwords": passwords}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def _page(api: dict, user: str, dag_id: str | None = None) -> requests.Response:
    token = _token({"ui_url": api["url"], "username": user, "password": api["passwords"][user]})
    return requests.get(api["url"] + "/tidemark/status/", params={"dag_id": dag_id} if dag_id else None,
                        headers={"Authorization": f"Bearer {token}"}, timeout=60)


def test_the_admin_sees_every_stream(scoped_api):
    resp = _page(scoped_api, "admin")
    assert resp.status_code == 200, resp.text
    assert 'data-stream="demo"' in resp.text and 'data-stream="ledger"' in resp.text
    assert LEDGER_REASON in resp.text and "tidemark_ledger" in resp.text and "2 stream(s)" in resp.text
    assert "secret.yaml" in resp.text          # the broken file's error, for who sees every stream


@pytest.mark.parametrize("user, shown, hidden", [("demo_reader", "demo", "ledger"),
                                                 ("ledger_reader", "ledger", "demo")])
def test_a_user_who_may_read_one_streams_dags_sees_nothing_of_the_other(scoped_api, user, shown, hidden):
    resp = _page(scoped_api, user)
    assert resp.status_code == 200, resp.text
    page = resp.text
    assert f'data-stream="{shown}"' in page and "1 stream(s)" in page
    assert f"chart-lag-bytes-{shown}" in page and "<h3>Open incidents (" in page
    # nothing of the other stream: its name, slot, publication, DAG links, incidents, segments, tables
    assert hidden not in page.lower(), page[max(0, page.lower().find(hidden) - 300):][:600]
    assert "secret" not in page and "1 stream file(s) could not be read" in page
    if hidden == "ledger":
        assert LEDGER_REASON not in page
    else:
        assert "quarantined" not in page and "pwned" not in page
    # the DAG tab of its own stream highlights it; a DAG of the other stream is refused
    own = _page(scoped_api, user, f"tidemark_{shown}_drain")
    assert own.status_code == 200 and f'<section id="stream-{shown}" class="stream current"' in own.text
    assert _page(scoped_api, user, f"tidemark_{hidden}_drain").status_code == 403


def test_one_dag_of_a_stream_does_not_show_the_stream(scoped_api):
    page = _page(scoped_api, "one_dag")
    assert page.status_code == 200 and "0 stream(s)" in page.text and "data-stream" not in page.text
    assert "ledger" not in page.text and "demo" not in page.text
    tab = _page(scoped_api, "one_dag", "tidemark_ledger_consolidate")
    assert tab.status_code == 200 and "data-stream" not in tab.text and LEDGER_REASON not in tab.text
    assert ("The stream of tidemark_ledger_consolidate is not shown: it is shown to users who may read all of "
            "its DAGs.") in tab.text
    assert _page(scoped_api, "one_dag", "tidemark_demo_consolidate").status_code == 403


def test_the_page_asks_for_the_dags_the_dag_file_builds(tmp_path, monkeypatch):
    """`stream_dag_ids` (the DAGs a user must be able to read) is what dags/tidemark_streams.py builds."""
    import sys

    sys.path.insert(0, str(ROOT / "plugins"))
    from tidemark.config import scan_stream_dir
    from tidemark_status.access import stream_dag_ids

    streams = tmp_path / "streams"
    streams.mkdir()
    shutil.copy(ROOT / "include" / "streams" / "demo.yaml", streams / "demo.yaml")
    (streams / "prices.yaml").write_text(       # an external feed: no snapshot DAG
        "stream: prices\nsource: {kind: feed, tables: [public.prices]}\n"
        "control: {connection: prices_control}\nlanding: {url: /data/landing}\nlake: {path: /data/lake}\n")
    parsed = run_json(HERE / "parse_dags.py", airflow_env(tmp_path, streams_dir=streams,
                                                          extra={"TIDEMARK_HOME": str(tmp_path / "th")}), timeout=180)
    monkeypatch.setenv("TIDEMARK_HOME", str(tmp_path / "th"))
    configs, errors = scan_stream_dir(streams)
    assert not errors and len(configs) == 2
    assert sorted(d for c in configs for d in stream_dag_ids(c)) == sorted(
        d for d in parsed["dags"] if d.startswith("tidemark_"))
