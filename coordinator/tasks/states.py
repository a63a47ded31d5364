"""A task's states (contract section 6), the legal changes between them, and the sets in use.

This is the only place a state set is written down. Every task script gets its own rows of
:data:`TRANSITIONS` compiled in (see :func:`lua_prelude`), so a script refuses to write a
state the table does not allow, whatever its caller passes.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class State(StrEnum):
    """Where a task is. The values are the contract's words."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED_VERIFIED = "finished_verified"
    HALTED_AT_CALL_CEILING = "halted_at_call_ceiling"
    PAUSED = "paused_for_reconciliation"
    HALTED_STUCK = "halted_stuck"
    EXPIRED = "expired"
    ABORTED = "aborted"
    AGENT_FAILED = "agent_failed"


QUEUED, RUNNING, PAUSED = State.QUEUED, State.RUNNING, State.PAUSED

# Ended: nothing changes the task again but a person (`overnight rerun`, or a new submit of
# its id, which starts afresh).
TERMINAL: frozenset[State] = frozenset(
    {
        State.FINISHED_VERIFIED,
        State.HALTED_AT_CALL_CEILING,
        State.HALTED_STUCK,
        State.EXPIRED,
        State.ABORTED,
        State.AGENT_FAILED,
    }
)
# Its id is taken: a queued or running task, or one a person must reconcile.
LIVE: frozenset[State] = frozenset({QUEUED, RUNNING, PAUSED})
# Nothing more happens without a person: what `--wait`, `up` and the coordinator wait for.
SETTLED: frozenset[State] = TERMINAL | {PAUSED}

# The task scripts that write a task's state (or its checkpoint), one operation each.
Op = Literal["create", "claim", "begin", "save", "orphan", "resume", "abort", "rerun"]

# Every legal state change: operation -> target -> the states it may come from.
# ``begin`` and ``save`` to RUNNING are checkpoints (the state stays); a record that does
# not exist yet may always be created.
TRANSITIONS: dict[Op, dict[State, frozenset[State]]] = {
    "create": {QUEUED: TERMINAL},
    "claim": {RUNNING: frozenset({QUEUED})},
    "begin": {RUNNING: frozenset({RUNNING})},
    "save": {
        RUNNING: frozenset({RUNNING}),
        PAUSED: frozenset({RUNNING}),
        # The night ended (coordinator.tasks.stop): back to the queue from the checkpoint.
        QUEUED: frozenset({RUNNING}),
        **{end: frozenset({RUNNING}) for end in TERMINAL - {State.ABORTED}},
    },
    "orphan": {
        QUEUED: frozenset({RUNNING}),
        PAUSED: frozenset({RUNNING}),
        State.EXPIRED: frozenset({RUNNING}),
    },
    "resume": {QUEUED: frozenset({PAUSED})},
    "abort": {State.ABORTED: LIVE},
    # `overnight rerun`: an ended task runs again, on its branch or from its base.
    "rerun": {QUEUED: TERMINAL},
}


def parse(value: str | None) -> State | None:
    """The state ``value`` names, or None if it names none."""
    if value is None:
        return None
    try:
        return State(value)
    except ValueError:
        return None


def legal(op: Op, source: str | None, target: str) -> bool:
    """Whether ``op`` may move a task from ``source`` (None: no record yet) to ``target``."""
    to = parse(target)
    sources = TRANSITIONS[op].get(to) if to is not None else None
    if sources is None:
        return False
    return (source is None and op == "create") or parse(source) in sources


def lua_prelude(op: Op | None) -> str:
    """Lua lines defining ``LEGAL`` (this operation's rows: target -> {source = true}) and
    ``TERMINAL`` (a set), for a task script to check its write against."""
    rows = TRANSITIONS[op] if op is not None else {}

    def lua_set(states: frozenset[State]) -> str:
        return "{" + ", ".join(f"{s.value} = true" for s in sorted(states)) + "}"

    legal_rows = ", ".join(f"{t.value} = {lua_set(s)}" for t, s in sorted(rows.items()))
    return f"local LEGAL = {{{legal_rows}}}\nlocal TERMINAL = {lua_set(TERMINAL)}\n"
