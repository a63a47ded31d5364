"""What `overnight status` and `overnight report` show: status JSON and the morning view."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from overnight.coordinator.report.text import printable
from overnight.coordinator.tasks.states import State
from overnight.coordinator.tasks.store import TaskRecord
from overnight.coordinator.workspace.plan import redact

if TYPE_CHECKING:
    from overnight.coordinator.report.model import Report


def elapsed(rec: TaskRecord, now: float | None = None) -> float:
    """Seconds from first start (else submission) to the end (else now)."""
    start = rec.started_unix or rec.submitted_unix
    end = rec.ended_unix or (now or time.time())
    return max(0.0, end - start)


def status_dict(rec: TaskRecord, claim_alive: bool, now: float | None = None) -> dict[str, Any]:
    """The JSON of ``overnight status TASK`` (the contract's keys first)."""
    cp = rec.checkpoint
    verdict = cp.last_verdict.model_dump() if cp.last_verdict else None
    if verdict is not None:
        verdict["ok"] = not verdict["failed"]
    return {
        "id": rec.id,
        "state": rec.state,
        "calls_used": rec.calls_used,
        "turns": rec.turns,
        "last_verdict": verdict,
        "detail": rec.detail,
        "max_calls": rec.spec.max_calls,
        "envelope": rec.spec.envelope,
        "unmet": list(cp.memory.unmet) if cp.memory else [],
        "evidence": cp.memory.evidence if cp.memory else "",
        "in_flight": cp.in_flight.model_dump() if cp.in_flight else None,
        "orphaned": rec.state == State.RUNNING and not claim_alive,
        "lost_leases": cp.lost_leases,
        "attempt": rec.attempt,
        "job_id": rec.job_id(),
        "queue": rec.queue,
        "runner": rec.runner.model_dump() if rec.runner else None,
        "workdir": rec.spec.workdir,
        "agent": rec.spec.agent,
        "submitted_unix": rec.submitted_unix,
        "started_unix": rec.started_unix,
        "ended_unix": rec.ended_unix,
        "updated_unix": rec.updated_unix,
        "elapsed_sec": round(elapsed(rec, now), 3),
        # How its leases ended when not by the step's own exit, and the last steps' tails.
        "endings": list(cp.endings),
        "steps": [step.model_dump() for step in cp.steps],
        **workspace_dict(rec),
    }


def workspace_dict(rec: TaskRecord) -> dict[str, Any]:
    """Where the task worked: ``base``, ``branch``, ``head`` and ``diffstat`` for a worktree
    task, and the protected paths its last turn changed."""
    base = rec.spec.base
    cp = rec.checkpoint
    return {
        "workspace": base.mode if base is not None else None,
        "repo": redact(rec.spec.repo) if rec.spec.repo else None,
        "base": base.sha if base is not None else None,
        "branch": cp.branch,
        "head": cp.head,
        "diffstat": cp.diffstat,
        "protected_changed": list(cp.protected_changed),
    }


def branch_text(rec: TaskRecord) -> str:
    """The report's BRANCH cell: branch and diffstat, or that the task worked in place."""
    base = rec.spec.base
    cp = rec.checkpoint
    if base is None:
        return "-"
    if base.mode != "worktree":
        text = "in place (snapshot)" + (" in a git repository" if base.in_repo else "")
    else:
        text = f"{cp.branch or '-'}: {cp.diffstat or 'no changes'}"
    if cp.protected_changed:
        text += f"; PROTECTED CHANGED: {', '.join(cp.protected_changed)}"
    return text


def human_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def verdict_text(rec: TaskRecord) -> str:
    verdict = rec.checkpoint.last_verdict
    if verdict is None:
        return "-"
    total = len(verdict.passed) + len(verdict.failed)
    if not verdict.failed:
        return f"turn {verdict.turn}: {total}/{total} passed"
    return f"turn {verdict.turn}: failing {', '.join(verdict.failed)}"


COLUMNS = ("TASK", "STATE", "CALLS", "TURNS", "TIME", "LAST VERDICT", "BRANCH", "DETAIL")
STYLES = {
    State.FINISHED_VERIFIED: "green",
    State.HALTED_AT_CALL_CEILING: "yellow",
    State.HALTED_STUCK: "yellow",
    State.EXPIRED: "red",
    State.ABORTED: "red",
    State.AGENT_FAILED: "red",
    State.PAUSED: "magenta",
    State.RUNNING: "cyan",
}


def rows(records: list[TaskRecord], now: float | None = None) -> list[tuple[str, ...]]:
    """One row of cells per task, every cell escaped (:func:`text.printable`): ids, details
    and verdicts come from task files and agents."""
    return [
        tuple(
            printable(cell)
            for cell in (
                rec.id,
                rec.state,
                f"{rec.calls_used}/{rec.spec.max_calls}",
                str(rec.turns),
                human_duration(elapsed(rec, now)),
                verdict_text(rec),
                branch_text(rec),
                rec.detail,
            )
        )
        for rec in records
    ]


def ending_lines(rec: TaskRecord) -> list[str]:
    """The task's lease endings that were not clean exits ("turn 1 agent killed: heartbeat
    gap 2.0 s"), escaped, oldest first."""
    return [printable(e) for e in rec.checkpoint.endings]


def summary(records: list[TaskRecord]) -> str:
    counts: dict[str, int] = {}
    for rec in records:
        counts[rec.state] = counts.get(rec.state, 0) + 1
    parts = [f"{n} {state}" for state, n in sorted(counts.items())]
    tasks = "1 task" if len(records) == 1 else f"{len(records)} tasks"
    return f"{tasks}: " + (", ".join(parts) if parts else "none")


def envelope_lines(client: Any, namespace: str, records: list[TaskRecord]) -> list[str]:
    """One line per envelope the tasks draw from: what is left and what was spent."""
    from overnight.worker.envelope.envelope import CallEnvelope

    lines = []
    for name in sorted({rec.spec.envelope for rec in records}):
        state = CallEnvelope(client, name, namespace).snapshot()
        lines.append(
            f"envelope {name}: remaining {state.remaining} "
            f"(consumed model {state.consumed_model}, tool {state.consumed_tool})"
            + (
                f", tokens {state.consumed_tokens}"
                + (f" of {state.max_tokens}" if state.max_tokens is not None else "")
                if state.consumed_tokens or state.max_tokens is not None
                else ""
            )
        )
    return lines


def ledger(client: Any, namespace: str) -> dict[str, dict[str, int]]:
    """Per task, the gateway's ledger (``model_call`` receipts) totalled: requests, tokens
    (input, output, cache), tool calls, and how many rows were estimated or cut short."""
    from overnight.config.keys import Keys
    from overnight.worker.redisio.receipts import read

    totals: dict[str, dict[str, int]] = {}
    for rc in read(client, Keys(namespace)):
        if rc.kind != "model_call":
            continue
        row = totals.setdefault(rc.task_id or "-", dict.fromkeys(LEDGER_FIELDS, 0))
        data = rc.data
        row["requests"] += 1 if data.get("model_units") else 0
        for field in (
            "input_tokens",
            "output_tokens",
            "cache_read_tokens",
            "cache_write_tokens",
            "tool_calls",
        ):
            value = data.get(field)
            row[field] += value if isinstance(value, int) else 0
        row["estimated"] += 1 if data.get("estimated") else 0
        row["disconnected"] += 1 if data.get("disconnected") else 0
    return totals


LEDGER_FIELDS = (
    "requests",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "tool_calls",
    "estimated",
    "disconnected",
)


def ledger_lines(client: Any, namespace: str) -> list[str]:
    """One line per task that sent model requests through the gateway."""
    lines = []
    for task, row in sorted(ledger(client, namespace).items()):
        cache = row["cache_read_tokens"] + row["cache_write_tokens"]
        line = (
            f"ledger {task}: {row['requests']} model requests, tokens in "
            f"{row['input_tokens']} out {row['output_tokens']} cache {cache}, "
            f"{row['tool_calls']} tool calls"
        )
        if row["estimated"] or row["disconnected"]:
            line += f" ({row['estimated']} estimated, {row['disconnected']} cut short)"
        lines.append(line)
    return lines


def render_plain(records: list[TaskRecord], out: TextIO, footer: list[str]) -> None:
    """Aligned plain text, one line per task (for pipes and logs)."""
    table = [COLUMNS, *rows(records)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]
    endings = [[], *(ending_lines(rec) for rec in records)]
    for row, ended in zip(table, endings, strict=True):
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        out.write("  ".join([*cells, row[-1]]).rstrip() + "\n")
        for line in ended:
            out.write(f"  {'':{widths[0]}}{line}\n")
    for line in [summary(records), *footer]:
        out.write(printable(line) + "\n")


def render_rich(records: list[TaskRecord], footer: list[str]) -> None:
    """A rich table for a terminal."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="overnight report", title_justify="left")
    for name in COLUMNS:
        table.add_column(name, overflow="fold", no_wrap=name in ("TASK", "STATE"))
    for rec, row in zip(records, rows(records), strict=True):
        style = STYLES.get(rec.state, "")
        # Text cells: markup in a task's text ("[red]") is shown, not obeyed.
        detail = Text(row[-1])
        for line in ending_lines(rec):
            detail.append("\n" + line, style="red")
        table.add_row(Text(row[0]), Text(row[1], style=style), *map(Text, row[2:-1]), detail)
    console = Console()
    console.print(table)
    for line in [summary(records), *footer]:
        console.print(Text(printable(line)), highlight=False)


def gather(client: Any, namespace: str, now: float | None = None) -> Report:
    """The :class:`~overnight.coordinator.report.model.Report` of every task the namespace
    holds, read from Redis (records, receipts, envelopes) and git (each task branch's diff)."""
    from overnight.config.keys import Keys
    from overnight.coordinator.report.build import build
    from overnight.coordinator.tasks.store import TaskStore, server_time
    from overnight.worker.envelope.envelope import CallEnvelope
    from overnight.worker.redisio import receipts
    from overnight.worker.sandbox import modes

    keys = Keys(namespace)
    records = TaskStore(client, keys).all()
    hosts = modes.read(client, keys)
    names = {rec.spec.envelope for rec in records} | {"default"}
    envelopes = {}
    for name in sorted(names):
        state = CallEnvelope(client, name, namespace).snapshot()
        envelopes[name] = {**state.model_dump(), "exists": state.exists}
    return build(
        records,
        receipts.read(client, keys),
        envelopes,
        server_time(client) if now is None else now,
        namespace=namespace,
        diffs=task_diffs(records),
        notices=[*redis_notices(client), *modes.notices(hosts)],
        sandbox=modes.line(hosts),
    )


def sandbox_lines(client: Any, namespace: str) -> list[str]:
    """The plain report's lines on how each host contained steps: ``sandbox: bwrap`` (or
    ``off``, with the hosts), and a warning for hosts that ran without one."""
    from overnight.config.keys import Keys
    from overnight.worker.sandbox import modes

    hosts = modes.read(client, Keys(namespace))
    return [modes.line(hosts), *modes.notices(hosts)]


def redis_notices(client: Any) -> list[str]:
    """The report's line for a Redis that anyone gets into (accepted by the setting, or the
    night would not have run), or none."""
    from redis.exceptions import RedisError

    from overnight.config.connection import ALLOW_VAR, anyone_gets_in

    try:
        open_door = anyone_gets_in(client)
    except (RedisError, OSError):
        return []  # what the report shows was read from it just now: say only what is known
    if not open_door:
        return []
    return [
        f"Redis without a password ({ALLOW_VAR}=1 accepted it): any process on the host, "
        "a step too, could have rewritten budgets, leases and tasks"
    ]


def task_diffs(records: list[TaskRecord]) -> dict[str, str]:
    """Each worktree task's branch diff against its base commit, where git can still say."""
    out: dict[str, str] = {}
    for rec in records:
        base = getattr(rec.spec, "base", None)
        head = getattr(rec.checkpoint, "head", None)
        if base is None or not getattr(base, "sha", None) or not head:
            continue
        try:
            from overnight.coordinator.workspace import remote
            from overnight.coordinator.workspace.worktree import diff, state_dir

            root = base.root
            if rec.spec.repo is not None:  # from this host's cache, fetched if it lacks head
                state = state_dir()
                here = remote.local_base(base, rec.spec, state)
                root = here.root
                if not remote.has_all(Path(root), [base.sha, head]):
                    remote.sync(remote.Remote.of(rec.spec, state), here, rec.id)
            out[rec.id] = diff(root, base.sha, head)
        except Exception:  # a repository moved or pruned: the card goes without
            continue
    return out


def write_html(client: Any, namespace: str, path: Any) -> Report:
    """Gather the report and write it to ``path`` as one HTML file; returns the report."""

    from overnight.coordinator.report.html import write

    report = gather(client, namespace)
    write(report, Path(path))
    return report
