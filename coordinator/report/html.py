"""The morning report as one self-contained HTML file: inline CSS and SVG, no script, no
network, readable offline years later. :func:`render` turns a :class:`Report` into text;
every string that came from a task (ids, assignments, details, evidence, diffs) goes through
:func:`esc`, which also makes control and bidirectional-override characters visible.
"""

from __future__ import annotations

import html
import os
import re
import time
from pathlib import Path

from overnight.coordinator.report.model import (
    ENDINGS,
    Bar,
    Card,
    EnvelopeView,
    Mark,
    Report,
)

# C0/C1 controls (but tab and newline), and the characters that reorder text on display.
_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
PLOT_W, LABEL_W, LANE_H, MIN_BAR_PX = 960.0, 190.0, 26.0, 3.0
MAX_DIFF_CHARS = 200_000
COLOURS = {
    "clean": "#2e9d4f",
    "failed": "#e0a020",
    "gap": "#c0392b",
    "deadline": "#8e44ad",
    "refused": "#7f8c8d",
    "stop": "#1f3a5f",
    "killed": "#e74c3c",
    "lost": "#6d4c41",
    "running": "#3498db",
}
LEGEND = {
    "clean": "clean exit",
    "failed": "exited non-zero",
    "gap": "heartbeat-gap kill",
    "deadline": "deadline",
    "refused": "call refused",
    "stop": "requested stop",
    "killed": "other kill",
    "lost": "lost (reaped)",
    "running": "running",
}
STATE_COLOURS = {
    "finished_verified": "#2e9d4f",
    "halted_at_call_ceiling": "#e0a020",
    "halted_stuck": "#e0a020",
    "paused_for_reconciliation": "#c2185b",
    "expired": "#c0392b",
    "aborted": "#c0392b",
    "agent_failed": "#c0392b",
    "running": "#3498db",
    "queued": "#7f8c8d",
}


def esc(value: object) -> str:
    """``value`` as HTML text (also safe in a quoted attribute), hidden characters shown
    as ``<U+XXXX>``."""
    text = _HIDDEN.sub(lambda m: f"<U+{ord(m.group()):04X}>", str(value))
    return html.escape(text, quote=True)


def clock(ts: float | None) -> str:
    if ts is None:
        return "-"
    ms = round((ts % 1) * 1000) % 1000
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + f".{ms:03d} UTC"


def short(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts))


def duration(sec: float) -> str:
    if sec < 60:
        return f"{sec:.1f} s"
    minutes, s = divmod(int(sec), 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class _Scale:
    def __init__(self, start: float, end: float) -> None:
        self.start = start
        self.span = max(end - start, 1e-3)

    def x(self, ts: float) -> float:
        return LABEL_W + (ts - self.start) / self.span * PLOT_W

    def width(self, a: float, b: float) -> float:
        return max(MIN_BAR_PX, (b - a) / self.span * PLOT_W)


def _axis(scale: _Scale, y: float, height: float) -> str:
    out = []
    for i in range(6):
        ts = scale.start + scale.span * i / 5
        x = scale.x(ts)
        out.append(
            f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + height:.1f}" class="grid"/>'
        )
        anchor = "start" if i == 0 else "end" if i == 5 else "middle"
        out.append(
            f'<text x="{x:.1f}" y="{y + height + 12:.1f}" text-anchor="{anchor}" '
            f'class="tick">{short(ts)}</text>'
        )
    return "".join(out)


def _bar(bar: Bar, scale: _Scale, y: float, cls: str) -> str:
    x, w = scale.x(bar.start), scale.width(bar.start, bar.end)
    agent = bar.kind == "agent"
    top, h = (y + 3, LANE_H - 10) if agent else (y + LANE_H - 12, 7)
    turn = f"turn {bar.turn} " if bar.turn is not None else ""
    what = "agent step" if agent else f"verifier {bar.name}"
    tip = (
        f"{bar.task_id}: {turn}{what}\n{clock(bar.start)} → {clock(bar.end)} "
        f"({bar.end - bar.start:.3f} s)\nended: {LEGEND.get(bar.ending, bar.ending)}"
        f" ({bar.status or '?'} / {bar.note or '-'})"
        + (f"\n{bar.said}" if bar.said else "")
        + f"\nworker {bar.worker}, lease {bar.lease_id}"
    )
    fill = COLOURS.get(bar.ending, "#999")
    out = (
        f'<rect class="{cls}" data-task="{esc(bar.task_id)}" data-kind="{bar.kind}" '
        f'data-ending="{esc(bar.ending)}" x="{x:.2f}" y="{top:.1f}" width="{w:.2f}" '
        f'height="{h}" fill="{fill}"><title>{esc(tip)}</title></rect>'
    )
    if not agent:  # the verifier run's mark at its end
        cx = x + w
        out += (
            f'<path class="vmark" d="M{cx:.1f},{top - 3:.1f} l3,3 l-3,3 l-3,-3 z" '
            f'fill="{fill}"><title>{esc(tip)}</title></path>'
        )
    return out


MARK_SHAPES = {"pause": "#c2185b", "retry": "#e67e22", "refused": "#7f8c8d", "stop": "#1f3a5f"}


def _mark(mark: Mark, scale: _Scale, y: float) -> str:
    x = scale.x(mark.at)
    tip = esc(f"{mark.task_id}: {mark.kind} at {clock(mark.at)}\n{mark.text}")
    if mark.kind == "verdict":
        ok = mark.text.split(": ", 1)[-1].startswith("every")
        fill = COLOURS["clean"] if ok else COLOURS["gap"]
        return (
            f'<circle class="mark verdict" cx="{x:.1f}" cy="{y + 4:.1f}" r="2.5" '
            f'fill="{fill}"><title>{tip}</title></circle>'
        )
    fill = MARK_SHAPES.get(mark.kind, "#333")
    return (
        f'<g class="mark {esc(mark.kind)}"><line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" '
        f'y2="{y + LANE_H:.1f}" stroke="{fill}" stroke-width="2" stroke-dasharray="3,2"/>'
        f'<rect x="{x - 3:.1f}" y="{y:.1f}" width="6" height="6" fill="{fill}"/>'
        f"<title>{tip}</title></g>"
    )


def _lanes(report: Report, lanes: list[str], key: str, scale: _Scale, cls: str, title: str) -> str:
    height = 52 + len(lanes) * LANE_H + 20
    out = [
        f'<svg class="timeline" role="img" aria-label="{esc(title)}" '
        f'width="{LABEL_W + PLOT_W + 20:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {LABEL_W + PLOT_W + 20:.0f} {height:.0f}">'
    ]
    out.append(_concurrency(report, scale))
    base = 52.0
    out.append(_axis(scale, base, len(lanes) * LANE_H))
    for i, lane in enumerate(lanes):
        y = base + i * LANE_H
        if i % 2:
            out.append(
                f'<rect x="0" y="{y:.1f}" width="{LABEL_W + PLOT_W:.0f}" '
                f'height="{LANE_H}" class="stripe"/>'
            )
        label = lane if len(lane) <= 26 else lane[:25] + "…"
        out.append(
            f'<text x="4" y="{y + 17:.1f}" class="lane"><title>{esc(lane)}</title>'
            f"{esc(label)}</text>"
        )
        for bar in report.bars:
            if getattr(bar, key) == lane:
                out.append(_bar(bar, scale, y, cls))
        if key == "task_id":
            out.extend(_mark(m, scale, y) for m in report.marks if m.task_id == lane)
    out.append("</svg>")
    return "".join(out)


def _concurrency(report: Report, scale: _Scale) -> str:
    points = report.concurrency
    peak = max((n for _, n in points), default=0)
    out = ['<text x="4" y="26" class="lane">steps at once</text>']
    if not points or peak == 0:
        return "".join(out)
    top, h = 6.0, 34.0
    path = [f"M{scale.x(points[0][0]):.1f},{top + h:.1f}"]
    level = 0
    for at, n in points:
        x = scale.x(at)
        path.append(f"L{x:.1f},{top + h - level / peak * h:.1f}")
        level = n
        path.append(f"L{x:.1f},{top + h - level / peak * h:.1f}")
    path.append(f"L{scale.x(report.end):.1f},{top + h - level / peak * h:.1f}")
    path.append(f"L{scale.x(report.end):.1f},{top + h:.1f} Z")
    out.append(
        f'<path class="concurrency" d="{" ".join(path)}"><title>at most {peak} steps '
        "at once</title></path>"
    )
    out.append(
        f'<text x="{LABEL_W - 6:.0f}" y="{top + 9:.0f}" text-anchor="end" '
        f'class="tick">{peak}</text>'
    )
    return "".join(out)


def _burn(env: EnvelopeView, report: Report) -> str:
    scale = _Scale(report.start, report.end)
    w, h, top = LABEL_W + PLOT_W + 20, 150.0, 10.0
    budget = max(env.budget, 1)
    out = [
        f'<svg class="burn" role="img" aria-label="envelope {esc(env.name)} burn-down" '
        f'width="{w:.0f}" height="{h + 30:.0f}" viewBox="0 0 {w:.0f} {h + 30:.0f}">'
    ]
    out.append(_axis(scale, top, h))
    out.append(
        f'<text x="4" y="{top + 10:.0f}" class="lane">{env.budget} calls</text>'
        f'<text x="4" y="{top + h:.0f}" class="lane">0</text>'
    )
    if env.burn:
        pts = [
            (scale.x(max(at, report.start)), top + h - (budget - spent) / budget * h)
            for at, spent in env.burn
        ]
        pts.append((scale.x(report.end), pts[-1][1]))
        path = "M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in _steps(pts))
        out.append(f'<path class="burnline" d="{path}"/>')
        for (at, spent), (x, y) in zip(env.burn, pts, strict=False):
            out.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.8" class="burnpt"><title>'
                f"{clock(at)}: {spent} spent, {env.budget - spent} left</title></circle>"
            )
    out.append("</svg>")
    return "".join(out)


def _steps(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for x, y in pts:
        if out:
            out.append((x, out[-1][1]))
        out.append((x, y))
    return out


def _gauge(used: int, total: int) -> str:
    pct = 0.0 if total <= 0 else min(100.0, used / total * 100)
    return (
        f'<span class="gauge" title="{used} of {total}"><span style="width:{pct:.1f}%">'
        "</span></span>"
    )


def _header(report: Report) -> str:
    out = ['<header><h1>overnight report</h1><p class="sub">']
    out.append(
        f"namespace <b>{esc(report.namespace or '-')}</b> · {clock(report.start)} → "
        f"{clock(report.end)} · wall time <b>{duration(report.wall_sec)}</b> · "
        f"generated {clock(report.generated)}</p>"
    )
    if report.notices:
        out.append('<section id="notices"><h2>Ran without</h2><ul>')
        out.extend(f"<li>{esc(line)}</li>" for line in report.notices)
        out.append("</ul></section>")
    if report.attention:
        out.append('<section id="attention"><h2>Needs you</h2><ul>')
        for a in report.attention:
            out.append(
                f'<li data-task="{esc(a.task_id)}" data-what="{esc(a.what)}">'
                f'<b>{esc(a.task_id)}</b> <span class="what">{esc(a.what)}</span> '
                f"{esc(a.text)}</li>"
            )
        out.append("</ul></section>")
    else:
        out.append('<section id="attention" class="calm"><h2>Nothing needs you</h2></section>')
    out.append('<section id="summary"><div class="counts">')
    total = sum(report.counts.values())
    out.append(f'<span class="chip">{total} task{"" if total == 1 else "s"}</span>')
    for state, n in sorted(report.counts.items()):
        colour = STATE_COLOURS.get(state, "#555")
        out.append(
            f'<span class="chip state" data-state="{esc(state)}" '
            f'style="border-color:{colour}">{n} {esc(state)}</span>'
        )
    out.append(
        '</div><table class="envelopes"><tr><th>envelope</th><th>budget</th>'
        "<th>used (model + tool)</th><th>remaining</th><th></th><th>tokens</th></tr>"
    )
    for env in report.envelopes:
        used = env.consumed_model + env.consumed_tool
        tokens = "not metered"
        if env.max_tokens is not None or env.consumed_tokens:
            cap = f" of {env.max_tokens}" if env.max_tokens is not None else ""
            tokens = f"{env.consumed_tokens}{cap}"
        missing = "" if env.exists else " (never created)"
        out.append(
            f"<tr><td>{esc(env.name)}{missing}</td><td>{env.budget}</td>"
            f"<td>{used} ({env.consumed_model} + {env.consumed_tool})</td>"
            f"<td>{env.remaining}</td><td>{_gauge(used, env.budget)}</td>"
            f"<td>{esc(tokens)}</td></tr>"
        )
    out.append("</table></section></header>")
    return "".join(out)


def _timeline(report: Report) -> str:
    scale = _Scale(report.start, report.end)
    tasks = [c.task_id for c in report.cards]
    legend = "".join(
        f'<span class="key"><i style="background:{COLOURS[e]}"></i>{LEGEND[e]}</span>'
        for e in ENDINGS
    )
    return (
        '<section id="timeline"><h2>Timeline</h2>'
        '<input type="radio" name="lanes" id="by-task" checked>'
        '<label for="by-task">one lane per task</label>'
        '<input type="radio" name="lanes" id="by-worker">'
        '<label for="by-worker">one lane per worker</label>'
        f'<p class="legend">{legend} <span class="key">tall bar: agent step · short bar and '
        "◆: verifier run · dashed line: pause, retry, refusal or stop · dot: verdict</span></p>"
        f'<div class="lanes-task">{_lanes(report, tasks, "task_id", scale, "step", "by task")}'
        f'</div><div class="lanes-worker">'
        f"{_lanes(report, list(report.workers), 'worker', scale, 'wstep', 'by worker')}</div>"
        "</section>"
    )


def _card(card: Card, index: int) -> str:
    colour = STATE_COLOURS.get(card.state, "#555")
    assignment = card.assignment.strip().splitlines()[0] if card.assignment.strip() else ""
    out = [
        f'<article class="card" id="task-{index}" data-task="{esc(card.task_id)}" '
        f'data-state="{esc(card.state)}" style="border-left-color:{colour}">'
        f'<h3><span class="task-id">{esc(card.task_id)}</span> '
        f'<span class="badge" style="background:{colour}">{esc(card.state)}</span></h3>'
    ]
    if card.detail:
        out.append(f'<p class="why">{esc(card.detail)}</p>')
    if assignment:
        out.append(f'<p class="assignment">{esc(assignment)}</p>')
    took = ""
    if card.started is not None:
        if card.ended is not None:
            took = duration(card.ended - card.started)
        else:
            took = f"started {clock(card.started)}, not ended"
    out.append(
        f"<dl><dt>turns</dt><dd>{card.turns}</dd><dt>calls</dt><dd>{card.calls_used}/"
        f"{card.max_calls} (envelope {esc(card.envelope)})</dd><dt>steps</dt>"
        f"<dd>{card.steps}</dd><dt>attempt</dt><dd>{card.attempt}</dd>"
        f"<dt>time</dt><dd>{esc(took or '-')}</dd></dl>"
    )
    if card.verdict_turn is not None:
        ok = not card.failed
        rules = ", ".join(card.passed) or "none"
        out.append(
            f'<p class="verdict {"ok" if ok else "bad"}">last verdict (turn '
            f"{card.verdict_turn}): {'every rule passed' if ok else 'failing'}"
            f"{'' if ok else ': <b>' + esc(', '.join(card.failed)) + '</b>'}"
            f" · passed: {esc(rules)}</p>"
        )
        if card.failing_rule:
            out.append(
                f'<details class="evidence" open><summary>evidence of '
                f"{esc(card.failing_rule)}</summary><pre>{esc(card.evidence or '(no output)')}"
                "</pre></details>"
            )
    if card.endings:
        out.append(
            '<ul class="endings">' + "".join(f"<li>{esc(e)}</li>" for e in card.endings) + "</ul>"
        )
    if card.protected_changed:
        out.append(
            f'<p class="flag">changed protected paths: {esc(", ".join(card.protected_changed))}</p>'
        )
    if card.branch:
        out.append(
            f'<p class="branch">branch <code>{esc(card.branch)}</code>'
            f"{' at <code>' + esc(card.head[:12]) + '</code>' if card.head else ''}"
            f" · {esc(card.diffstat or 'no changes')}</p>"
        )
    if card.diff:
        diff = card.diff
        cut = ""
        if len(diff) > MAX_DIFF_CHARS:
            diff, cut = (
                diff[:MAX_DIFF_CHARS],
                f"\n[{len(card.diff) - MAX_DIFF_CHARS} more characters]",
            )
        out.append(
            f'<details class="diff"><summary>diff</summary><pre>{esc(diff + cut)}</pre></details>'
        )
    if card.ledger is not None:
        lg = card.ledger
        out.append(
            '<table class="ledger"><tr><th>requests</th><th>model units</th>'
            "<th>tool calls</th><th>tokens</th><th>input</th><th>output</th>"
            "<th>refunded</th><th>errors</th></tr>"
            f"<tr><td>{lg.requests}</td><td>{lg.model_units}</td><td>{lg.tool_calls}</td>"
            f"<td>{lg.tokens}</td><td>{lg.input_tokens}</td><td>{lg.output_tokens}</td>"
            f"<td>{lg.refunded}</td><td>{lg.failed}</td></tr></table>"
        )
    out.append("</article>")
    return "".join(out)


CSS = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#1d232a;
background:#fafbfc}
h1{margin:0;font-size:22px}h2{font-size:16px;margin:18px 0 8px}.sub{color:#555;margin:4px 0}
#attention{background:#fdecef;border:1px solid #e8a1b1;border-radius:6px;padding:4px 14px}
#notices{background:#fff4d6;border:1px solid #e0b84a;border-radius:6px;padding:4px 14px}
#attention.calm{background:#eaf6ee;border-color:#a7d7b6}#attention ul{margin:4px 0 8px}
.what{font-size:12px;background:#c2185b;color:#fff;border-radius:3px;padding:0 5px}
.chip{display:inline-block;border:2px solid #999;border-radius:12px;padding:1px 10px;
margin:6px 6px 6px 0;background:#fff}
table{border-collapse:collapse;margin:6px 0}td,th{border-bottom:1px solid #e3e6ea;
padding:3px 10px;text-align:left}
.gauge{display:inline-block;width:160px;height:10px;background:#e3e6ea;border-radius:5px;
overflow:hidden}.gauge span{display:block;height:100%;background:#1f77b4}
svg{display:block;background:#fff;border:1px solid #e3e6ea;border-radius:4px;margin:6px 0}
.grid{stroke:#eceff2}.tick{font-size:10px;fill:#777}.lane{font-size:12px;fill:#333}
.stripe{fill:#f6f8fa}.concurrency{fill:#9ecae1;stroke:#3182bd}
.burnline{fill:none;stroke:#1f77b4;stroke-width:2}.burnpt{fill:#1f77b4}
.legend{font-size:12px}.key{margin-right:12px;white-space:nowrap}
.key i{display:inline-block;width:12px;height:10px;margin-right:4px;vertical-align:middle}
#timeline input{margin-left:0}#timeline label{margin-right:16px}
.lanes-worker{display:none}#by-worker:checked~.lanes-worker{display:block}
#by-worker:checked~.lanes-task{display:none}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}
.card{background:#fff;border:1px solid #e3e6ea;border-left:6px solid #999;border-radius:6px;
padding:8px 14px;overflow:hidden}
.card h3{margin:4px 0;font-size:15px;word-break:break-all}
.badge{color:#fff;border-radius:3px;padding:1px 6px;font-size:12px;font-weight:normal}
.why{margin:4px 0;color:#333}.assignment{color:#666;font-style:italic;margin:4px 0}
dl{display:grid;grid-template-columns:auto 1fr;gap:0 12px;margin:6px 0}dt{color:#777}dd{margin:0}
.verdict.ok{color:#2e7d32}.verdict.bad{color:#b71c1c}.flag{color:#fff;background:#c2185b;
padding:2px 6px;border-radius:3px}
pre{background:#f6f8fa;padding:6px;max-height:320px;overflow:auto;white-space:pre-wrap;
word-break:break-all;font-size:12px}
.endings{font-size:12px;color:#8e2b2b;margin:4px 0}
.ledger{font-size:12px;display:block;overflow-x:auto}.ledger td,.ledger th{padding:2px 6px}
"""


def render(report: Report) -> str:
    """The whole page."""
    cards = "".join(_card(c, i) for i, c in enumerate(report.cards))
    burns = "".join(
        f"<h3>envelope {esc(env.name)}</h3>{_burn(env, report)}"
        for env in report.envelopes
        if env.exists
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>overnight report · {esc(report.namespace)} · {clock(report.generated)}</title>"
        f"<style>{CSS}</style></head><body>{_header(report)}{_timeline(report)}"
        f'<section id="burndown"><h2>Envelope burn-down</h2>'
        f'<p class="sub">calls spent, rebuilt from the receipts (the table above holds the '
        f"envelope's own counters)</p>{burns or '<p>no envelope</p>'}</section>"
        f'<section id="tasks"><h2>Tasks</h2><div class="cards">{cards}</div></section>'
        "</body></html>\n"
    )


def write(report: Report, path: Path) -> Path:
    """Write the page to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(render(report), encoding="utf-8")
    os.replace(tmp, path)
    return path
