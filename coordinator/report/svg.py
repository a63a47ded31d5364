"""The report's pictures, as inline SVG: the timeline of steps (one lane per task or per
worker), the concurrency strip, an envelope's burn-down and its gauge."""

from __future__ import annotations

from overnight.coordinator.report.markup import COLOURS, LEGEND, clock, esc, short
from overnight.coordinator.report.model import ENDINGS, Bar, EnvelopeView, Mark, Report

PLOT_W, LABEL_W, LANE_H, MIN_BAR_PX = 960.0, 190.0, 26.0, 3.0


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


def burn(env: EnvelopeView, report: Report) -> str:
    """An envelope's calls over the night, used against its budget, as a step line."""
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


def gauge(used: int, total: int) -> str:
    """A bar filled to ``used`` of ``total``."""
    pct = 0.0 if total <= 0 else min(100.0, used / total * 100)
    return (
        f'<span class="gauge" title="{used} of {total}"><span style="width:{pct:.1f}%">'
        "</span></span>"
    )


def timeline(report: Report) -> str:
    """The timeline section: every step as a bar, one lane per task or per worker."""
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
