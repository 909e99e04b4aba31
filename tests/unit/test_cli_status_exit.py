"""`tidemark status STREAM` exits non-zero (`EXIT_LATE`, 4) when the freshness alarm is up, so that a
cron job or a monitoring check can act on it without parsing the output; 0 when the stream is not late.
The same with ``--json``. (The alarm itself, from the control database: integration/test_freshness.py.)"""

from __future__ import annotations

import json

import pytest

from tidemark import cli, status


def _status(late: list[str]) -> dict:
    check = {"late": bool(late), "reason": late[0] if late else None, "age_seconds": 700.0,
             "allowance_seconds": 600.0}
    return {"stream": "s", "state": "streaming", "frontier": 16, "incidents": [],
            "freshness": {"late": late, "drain": check, "consolidation": None}}


@pytest.mark.parametrize("late", [[], ["drain: no segment landed for 700 s (allowed 600 s)"]])
@pytest.mark.parametrize("as_json", [False, True])
def test_status_exits_4_when_the_stream_is_late(monkeypatch, capsys, late, as_json):
    monkeypatch.setattr(cli, "find_stream", lambda name, where: type("Cfg", (), {"stream": name})())
    monkeypatch.setattr(status, "stream_status", lambda cfg: _status(late))
    monkeypatch.setattr(status, "storage_lines", lambda st: [])
    code = cli.main(["status", "s", *(["--json"] if as_json else [])])
    out = capsys.readouterr().out
    assert code == (cli.EXIT_LATE if late else 0) and cli.EXIT_LATE == 4
    if as_json:
        assert json.loads(out)["freshness"]["late"] == late
    else:
        assert ("LATE: drain: no segment landed" in out.splitlines()[0]) == bool(late)
        assert "drain freshness: " + ("LATE" if late else "ok: last 11.7 min ago") in out
