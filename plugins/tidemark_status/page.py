"""Render the CDC status page: HTML with inline SVG charts, no script and nothing fetched from elsewhere
(the page works offline). Every value from the control database is escaped; this module only renders
the data `tidemark.status.overview` returns."""

from __future__ import annotations

import datetime as dt
import json
from html import escape
from typing import Any, Callable, Iterable

from tidemark.lsn import format_lsn
# every figure worded as `tidemark status` words it (`tidemark.words`, `tidemark.status`)
from tidemark.status import commit_lag_text, freshness_text, landing_text, maintenance_text
from tidemark.words import ratio, seconds, size, when

from tidemark_status.access import DAG_KINDS

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:16px;color:#1a202c;background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:17px;margin:24px 0 6px;border-top:1px solid #cbd5e0;padding-top:12px}
h3{font-size:14px;margin:14px 0 4px} .muted{color:#4a5568} .err{color:#c53030;font-weight:600}
table{border-collapse:collapse;margin:4px 0} td,th{border:1px solid #e2e8f0;padding:3px 8px;text-align:left}
th{background:#f7fafc;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
.kv th{width:230px} .lsn{font-family:ui-monospace,monospace} .charts{display:flex;flex-wrap:wrap;gap:12px}
.chart{border:1px solid #e2e8f0;padding:6px} .badge{display:inline-block;padding:0 6px;border-radius:8px;
background:#edf2f7;margin-left:6px;font-size:12px} .incident{background:#fff5f5}
.current{outline:2px solid #3182ce}
"""


def e(value: Any) -> str:
    """Escape any value for HTML text or a quoted attribute."""
    return escape("" if value is None else str(value), quote=True)


def fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def incident_reason(kind: str, detail: Any) -> str:
    """An incident's reason: its ``reason`` when it has one, else its detail as ``key=value``."""
    if isinstance(detail, dict):
        if detail.get("reason"):
            return str(detail["reason"])
        return ", ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in detail.items())
    return str(detail)


def svg_chart(samples: list[tuple[dt.datetime, float | None]], *, title: str, fmt: Callable[[float], str],
              css_id: str, width: int = 420, height: int = 150) -> str:
    """A line chart of (time, value) samples as inline SVG: a polyline and one circle per sample."""
    pts = [(t, v) for t, v in samples if v is not None]
    left, right, top, bottom = 64, 10, 22, 26
    head = (f'<svg id="{e(css_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{e(title)}">'
            f'<text x="{left}" y="14" font-size="12" font-weight="600">{e(title)}</text>')
    if not pts:
        return head + f'<text x="{left}" y="{height // 2}" font-size="12" fill="#718096">no samples yet</text></svg>'
    t0, t1 = pts[0][0], pts[-1][0]
    span = max((t1 - t0).total_seconds(), 1e-9)
    vmax = max(v for _, v in pts)
    vmin = min(0.0, min(v for _, v in pts))
    vspan = (vmax - vmin) or 1.0
    w, h = width - left - right, height - top - bottom

    def xy(t: dt.datetime, v: float) -> tuple[float, float]:
        x = left + (w * (t - t0).total_seconds() / span if len(pts) > 1 else w / 2)
        return round(x, 1), round(top + h - h * (v - vmin) / vspan, 1)

    coords = [xy(t, v) for t, v in pts]
    first, last = (x.astimezone(dt.timezone.utc).strftime("%H:%M:%S") for x in (t0, t1))
    axis = (f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="#a0aec0"/>'
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#a0aec0"/>'
            f'<text x="{left - 4}" y="{top + 8}" font-size="10" text-anchor="end">{e(fmt(vmax))}</text>'
            f'<text x="{left - 4}" y="{top + h}" font-size="10" text-anchor="end">{e(fmt(vmin))}</text>'
            f'<text x="{left}" y="{height - 8}" font-size="10">{e(first)}</text>'
            f'<text x="{left + w}" y="{height - 8}" font-size="10" text-anchor="end">'
            f'{e(last)} UTC</text>')
    line = ('<polyline fill="none" stroke="#3182ce" stroke-width="2" points="'
            + " ".join(f"{x},{y}" for x, y in coords) + '"/>')
    dots = "".join(f'<circle cx="{x}" cy="{y}" r="2.5" fill="#2b6cb0"><title>{e(when(t))}: {e(fmt(v))}</title>'
                   f'</circle>' for (x, y), (t, v) in zip(coords, pts))
    return head + axis + line + dots + "</svg>"


def _rows(rows: Iterable[str]) -> str:
    return "".join(rows)


def _freshness(check: dict | None) -> str:
    """One job's freshness (`tidemark.status.freshness_text`) as a table cell's HTML."""
    text = e(freshness_text(check))
    if check is None:
        return f'<span class="muted">{text}</span>'
    return f'<span class="err late">{text}</span>' if check["late"] else text


def _stream_section(s: dict, *, selected: bool) -> str:
    name = s["stream"]
    links = " ".join(f'<a target="_top" href="../../dags/{e(f"tidemark_{name}_{k}")}">{e(k)}</a>' for k in DAG_KINDS)
    out = [f'<section id="stream-{e(name)}" class="stream{" current" if selected else ""}" data-stream="{e(name)}">',
           f'<h2>{e(name)}<span class="badge">{e(s.get("state") or "not registered")}</span></h2>',
           f'<div class="muted">DAGs: {links}</div>']
    if not s.get("registered"):
        out.append(f'<p class="err">{e(s.get("error"))}</p></section>')
        return "".join(out)
    fresh = s.get("freshness") or {}
    # DAGs that have not run when their schedules say (a dead scheduler) open no incident: said first
    out += [f'<p class="err late">late: {e(reason)}</p>' for reason in fresh.get("late") or []]
    current, committed = s.get("current_segment"), s.get("committed_segment")
    kv = [
        ("frontier (consolidated upper)", f'<span class="lsn">{e(format_lsn(s["frontier"]))}</span>'),
        ("landed upper", f'<span class="lsn">{e(format_lsn(s["landed_upper"]))}</span>'),
        ("slot lag (bytes)", e(size(s.get("slot_lag_bytes")))),
        ("slot lag (time)", e(seconds(s.get("slot_lag_seconds")))),
        ("commit → lake lag (last hour)", e(commit_lag_text(s.get("commit_lag")))),
        ("last segment", e(when(s.get("last_segment_at")))),
        ("current / committed segment", f'{e("-" if current is None else current)} / '
                                        f'{e("-" if committed is None else committed)}'),
        ("slot / publication", f'{e(s.get("slot"))} / {e(s.get("publication"))}'),
        ("metrics recorded", e(when(s.get("metrics_at")))),
        *((f"{job} freshness", _freshness(fresh.get(job))) for job in ("drain", "consolidation") if fresh),
    ]
    out.append('<table class="kv">' + _rows(f"<tr><th>{e(k)}</th><td>{v}</td></tr>" for k, v in kv) + "</table>")

    tables = s.get("tables") or []
    if tables:
        out.append(f'<h3>Tables ({len(tables)})</h3>')
        out.append('<table class="tables"><tr><th>table</th><th>state</th><th>position</th><th>since</th>'
                   '<th>meaning</th></tr>'
                   + _rows(f'<tr class="table-state" data-state="{e(t["state"])}"><td>{e(t["table"])}</td>'
                           f'<td>{e(t["state"])}</td>'
                           f'<td class="lsn">{e(format_lsn(t["position"]) if t.get("position") is not None else "-")}'
                           f'</td><td class="lsn">{e(format_lsn(t["since_lsn"]) if t.get("since_lsn") is not None else "-")}'
                           f'</td><td class="muted">{e(t.get("meaning"))}</td></tr>' for t in tables) + "</table>")

    incidents = s.get("incidents") or []
    out.append(f'<h3>Open incidents ({len(incidents)})</h3>')
    if incidents:
        out.append('<table class="incidents"><tr><th>id</th><th>kind</th><th>table</th><th>opened</th>'
                   '<th>times seen</th><th>last seen</th><th>reason</th></tr>'
                   + _rows(f'<tr class="incident"><td class="num">{e(i["id"])}</td><td>{e(i["kind"])}</td>'
                           f'<td>{e(i.get("table") or "-")}</td>'
                           f'<td>{e(when(i.get("opened_at")))}</td>'
                           f'<td class="num count">{e(fmt_int(i.get("count")))}</td>'
                           f'<td class="last-seen">{e(when(i.get("last_seen_at") or i.get("opened_at")))}</td>'
                           f'<td class="reason">{e(incident_reason(i["kind"], i.get("detail")))}</td></tr>'
                           for i in incidents) + "</table>")
    else:
        out.append('<p class="muted">none</p>')

    subs = s.get("subscribers") or []
    if subs:
        # a lagging subscriber holds its landing segments back from the retention (`tidemark maintain`)
        out.append(f'<h3>Subscribers ({len(subs)})</h3>')
        out.append('<table class="subscribers"><tr><th>name</th><th>checkpoint</th><th>behind the frontier (bytes)'
                   '</th><th>landing bytes it holds</th></tr>'
                   + _rows(f'<tr class="subscriber{" lagging" if u["lagging"] else ""}"><td>{e(u["name"])}</td>'
                           f'<td class="lsn">{e(format_lsn(u["checkpoint"] or 0))}</td>'
                           f'<td class="num">{e(size(u["lag_bytes"]))}</td>'
                           f'<td class="num held">{e(size(u.get("held_bytes")))}</td></tr>' for u in subs)
                   + "</table>")

    out.append(_storage_section(s))
    out.append(_write_cost_section(s))

    history = s.get("history") or []
    out.append(f'<h3>Over time ({len(history)} samples)</h3><div class="charts">')
    out.append(svg_chart([(h["at"], h.get("slot_lag_bytes")) for h in history], title="slot lag (bytes)",
                         fmt=lambda v: f"{v:,.0f}", css_id=f"chart-lag-bytes-{name}"))
    out.append(svg_chart([(h["at"], h.get("slot_lag_seconds")) for h in history], title="slot lag (seconds)",
                         fmt=lambda v: f"{v:,.1f}", css_id=f"chart-lag-seconds-{name}"))
    out.append(svg_chart([(h["at"], h.get("changes_per_second")) for h in history], title="changes/s landed",
                         fmt=lambda v: f"{v:,.1f}", css_id=f"chart-changes-{name}"))
    out.append("</div>")

    segments = s.get("segments") or []
    out.append(f'<h3>Recent segments ({len(segments)})</h3>')
    if segments:
        out.append('<table class="segments"><tr><th>seq</th><th>lower</th><th>upper</th><th>records</th>'
                   '<th>transactions</th><th>bytes</th><th>status</th><th>origin</th><th>registered</th></tr>'
                   + _rows(f'<tr><td class="num">{e(g["seq"])}</td><td class="lsn">{e(format_lsn(g["lower_lsn"]))}</td>'
                           f'<td class="lsn">{e(format_lsn(g["upper_lsn"]))}</td>'
                           f'<td class="num">{e(fmt_int(g["record_count"]))}</td>'
                           f'<td class="num">{e(fmt_int(g["txn_count"]))}</td>'
                           f'<td class="num">{e(fmt_int(g["byte_size"]))}</td><td>{e(g["status"])}</td>'
                           f'<td>{e(g["origin"])}</td><td>{e(when(g.get("created_at")))}</td></tr>'
                           for g in segments) + "</table>")
    else:
        out.append('<p class="muted">none yet</p>')
    out.append("</section>")
    return "".join(out)


def sparkline(values: list[float | None], *, title: str, css_class: str = "sparkline", width: int = 160,
              height: int = 32) -> str:
    """A small inline SVG line of ``values`` (oldest first; None: a gap, not drawn), scaled from 0 to
    their maximum, the last value marked; ``title`` is its tooltip."""
    pts = [(i, v) for i, v in enumerate(values) if v is not None]
    head = (f'<svg class="{e(css_class)}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{e(title)}"><title>{e(title)}</title>')
    if not pts:
        return head + "</svg>"
    vmax = max(v for _, v in pts) or 1.0
    n = max(len(values) - 1, 1)

    def xy(i: int, v: float) -> tuple[float, float]:
        return round(2 + (width - 4) * i / n, 1), round(height - 2 - (height - 4) * v / vmax, 1)

    coords = [xy(i, v) for i, v in pts]
    x, y = coords[-1]
    return (head + '<polyline fill="none" stroke="#3182ce" stroke-width="1.5" points="'
            + " ".join(f"{a},{b}" for a, b in coords) + f'"/><circle cx="{x}" cy="{y}" r="2" fill="#2b6cb0"/></svg>')


def _storage_section(s: dict) -> str:
    """The stream's storage as last measured (`tidemark.lake.storage`), its oldest readable position
    and the last maintenance run."""
    st = s.get("storage")
    out = ['<h3>Storage</h3>']
    if not st:
        out.append('<p class="muted">not measured yet (the record_metrics task or tidemark status measures it)</p>')
    else:
        lake, land = st.get("lake") or {}, st.get("landing") or {}
        live, disk = lake.get("live_bytes") or 0, lake.get("disk_bytes") or 0
        kv = [("lake: live (current versions)", f'{e(size(live))} in {e(fmt_int(lake.get("live_files")))} files'),
              ("lake: on disk", f'{e(size(disk))} in {e(fmt_int(lake.get("disk_files")))} files '
                                f'({e(ratio(disk / live if live else None))} live)'),
              ("lake: Delta log (part of on disk)", f'{e(size(lake.get("log_bytes")))} in '
                                                    f'{e(fmt_int(lake.get("log_files")))} files'),
              ("landing", e(landing_text(land))),
              ("oldest readable position", f'<span class="lsn">{e(format_lsn(st.get("oldest_readable")))}</span> '
                                           f'<span class="muted">(lake.retention {e(st.get("retention"))})</span>'
               if st.get("oldest_readable") is not None else
               f'every version kept so far <span class="muted">(lake.retention {e(st.get("retention"))})</span>'),
              ("measured", e(when(st.get("at")) if isinstance(st.get("at"), dt.datetime) else st.get("at")))]
        out.append('<table class="kv storage">' + _rows(f"<tr><th>{e(k)}</th><td>{v}</td></tr>" for k, v in kv)
                   + "</table>")
        rows = []
        for table, kinds in sorted((st.get("tables") or {}).items()):
            for kind, f in sorted(kinds.items()):
                rows.append(f'<tr class="storage-table"><td>{e(table)}</td><td>{e(kind)}</td>'
                            f'<td class="num">{e(size(f.get("live_bytes")))}</td>'
                            f'<td class="num">{e(size(f.get("disk_bytes")))}</td>'
                            f'<td class="num">{e(size(f.get("log_bytes")))}</td>'
                            f'<td class="num">{e(fmt_int(f.get("live_files")))} / {e(fmt_int(f.get("disk_files")))}'
                            f'</td></tr>')
        if rows:
            out.append('<table class="storage-tables"><tr><th>table</th><th>kind</th><th>live</th><th>on disk</th>'
                       '<th>of it Delta log</th><th>files live / on disk</th></tr>' + _rows(rows) + "</table>")
    out.append(f'<p class="maintenance">last maintenance: {e(maintenance_text(s.get("last_maintenance")))}</p>')
    return "".join(out)


def _write_cost_section(s: dict) -> str:
    """Write amplification per table over its recorded batches (`tidemark.consolidate.writecost`):
    bytes the batch's commits wrote per byte its changes hold, as a sparkline, the latest and median."""
    from tidemark.consolidate.writecost import amplification, summary

    costs = s.get("write_costs") or {}
    out = [f'<h3>Write amplification ({len(costs)} tables)</h3>']
    if not costs:
        out.append('<p class="muted">no batch recorded yet</p>')
        return "".join(out)
    rows = []
    for table, batches in sorted(costs.items()):
        sm = summary(batches)
        amps = [None if b.get("snapshot_load") else amplification(b) for b in batches]
        last = batches[-1]
        rows.append(f'<tr class="write-cost" data-table="{e(table)}"><td>{e(table)}</td>'
                    f'<td>{sparkline(amps, title=f"write amplification of {table}, last {len(batches)} batches")}</td>'
                    f'<td class="num latest">{e(ratio(sm["latest"]))}</td>'
                    f'<td class="num median">{e(ratio(sm["median"]))}</td>'
                    f'<td class="num">{e(fmt_int(sm["batches"]))}</td>'
                    f'<td class="num">{e(size(last.get("added_bytes")))}</td>'
                    f'<td class="num">{e(size(last.get("change_bytes")))}</td></tr>')
    out.append('<table class="write-costs"><tr><th>table</th><th>bytes written ÷ bytes changed, per batch</th>'
               '<th>latest</th><th>median</th><th>batches</th><th>last batch wrote</th><th>its changes</th></tr>'
               + _rows(rows) + "</table>")
    return "".join(out)


def render_page(streams: list[dict], *, now: dt.datetime, dag_id: str | None = None,
                problems: list[str] | None = None, refresh_seconds: int = 60, dag_stream_hidden: bool = False) -> str:
    """The whole page of the streams given (those the user may read). ``dag_id`` (the DAG tab it is
    shown in) highlights that DAG's stream; ``dag_stream_hidden``: ``dag_id`` is a DAG of a stream
    left out for this user, which the page says without naming anything else of it."""
    selected = None
    if dag_id:
        selected = next((s["stream"] for s in streams
                         if any(dag_id == f"tidemark_{s['stream']}_{k}" for k in DAG_KINDS)), None)
    body = "".join(_stream_section(s, selected=s["stream"] == selected) for s in streams)
    if not streams:
        body = ('<p class="muted">No stream to show: no stream file found (TIDEMARK_STREAMS_DIR), or none '
                'whose DAGs you may all read.</p>')
    note = "".join(f'<p class="err">{e(p)}</p>' for p in problems or [])
    if dag_id and dag_stream_hidden:
        note += (f'<p class="muted">The stream of {e(dag_id)} is not shown: it is shown to users who may read '
                 'all of its DAGs.</p>')
    elif dag_id and selected is None:
        note += f'<p class="muted">{e(dag_id)} is not a Tidemark stream DAG; all streams you may read are shown.</p>'
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="refresh" content="{int(refresh_seconds)}">'
            "<title>Tidemark CDC status</title>"
            f"<style>{CSS}</style></head><body>"
            "<h1>Tidemark CDC status</h1>"
            f'<div class="muted">{len(streams)} stream(s) &middot; as of {e(when(now))} &middot; '
            "lag and segments as recorded by each stream's record_metrics task</div>"
            f"{note}{body}</body></html>")
