"""The morning report as one self-contained HTML file: inline CSS and SVG, no script, no
network, readable offline years later. :func:`render` turns a :class:`Report` into text;
every string that came from a task (ids, assignments, details, evidence, diffs) goes through
:func:`esc`, which also makes control and bidirectional-override characters visible.
"""

from __future__ import annotations

import os
from pathlib import Path

from overnight.config.folders import make_folders
from overnight.coordinator.report.markup import STATE_COLOURS, clock, duration, esc
from overnight.coordinator.report.model import (
    Card,
    Report,
)
from overnight.coordinator.report.svg import burn, gauge, timeline

MAX_DIFF_CHARS = 200_000


def _header(report: Report) -> str:
    out = ['<header><h1>overnight report</h1><p class="sub">']
    out.append(
        f"namespace <b>{esc(report.namespace or '-')}</b> · {clock(report.start)} → "
        f"{clock(report.end)} · wall time <b>{duration(report.wall_sec)}</b> · "
        f"generated {clock(report.generated)}"
        + (f' · <span id="sandbox">{esc(report.sandbox)}</span>' if report.sandbox else "")
        + "</p>"
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
            f"<td>{env.remaining}</td><td>{gauge(used, env.budget)}</td>"
            f"<td>{esc(tokens)}</td></tr>"
        )
    out.append("</table></section></header>")
    return "".join(out)


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
        f"<h3>envelope {esc(env.name)}</h3>{burn(env, report)}"
        for env in report.envelopes
        if env.exists
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>overnight report · {esc(report.namespace)} · {clock(report.generated)}</title>"
        f"<style>{CSS}</style></head><body>{_header(report)}{timeline(report)}"
        f'<section id="burndown"><h2>Envelope burn-down</h2>'
        f'<p class="sub">calls spent, rebuilt from the receipts (the table above holds the '
        f"envelope's own counters)</p>{burns or '<p>no envelope</p>'}</section>"
        f'<section id="tasks"><h2>Tasks</h2><div class="cards">{cards}</div></section>'
        "</body></html>\n"
    )


def write(report: Report, path: Path) -> Path:
    """Write the page to ``path`` atomically (a reader never sees half a file): folders it
    makes are 0755 and the page 0644 whatever the umask, and a file or link already at the
    temporary name is never written through (one planted there is an error, not a target)."""
    make_folders(path.parent, 0o755)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(tmp, flags, 0o644), "w", encoding="utf-8") as out:
        try:
            os.fchmod(out.fileno(), 0o644)
            out.write(render(report))
        except BaseException:
            os.unlink(tmp)
            raise
    os.replace(tmp, path)
    return path
