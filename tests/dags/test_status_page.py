"""The CDC status page in the Airflow UI, in a real headless browser (Debian's chromium).

The session's embedded Airflow (api-server with the Tidemark plugin; tests/dags/conftest.py) runs on
the test cluster; the demo stream is snapshotted, fed by the workload, drained into real segments
with metrics sampled after each drain, and one segment is corrupted so that gap detection opens a
real incident. The page must refuse a request without Airflow's login, list the plugin's views, and
show in the browser (logged in with the UI's ``_token`` cookie) what the control database holds:
positions as ``0/16B3748``, the incident's reason, the segments, and SVG charts with one point per
sample. A screenshot is saved in the test's tmp dir (its path is printed).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests


pytestmark = [pytest.mark.airflow, pytest.mark.slow]
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
        from tidemark.control.status import stream_status
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
