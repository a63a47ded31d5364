"""The task scripts: each registered once per store with its rows of the transitions table
compiled in (:func:`coordinator.tasks.states.lua_prelude`), run again while the server
refuses to run it (OOM, LOADING...: nothing was written), and its refusal raised as a
:class:`TaskRefused` naming why. :class:`TaskScripts` is what the task store is built on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

from overnight.config import defaults
from overnight.config.errors import OvernightError
from overnight.config.keys import Keys
from overnight.coordinator.tasks.states import Op, lua_prelude
from overnight.worker.redisio.clients import not_run, retry_transient, transient
from overnight.worker.redisio.scripts import COORDINATOR, register

if TYPE_CHECKING:
    import redis
    from redis.commands.core import Script

# Why a task script refused a write. ``state``: the record is in a state the write may not
# come from; ``illegal``: the table has no such write at all (a bug in the caller).
Reason = Literal[
    "unknown",
    "stale-attempt",
    "state",
    "illegal",
    "claimed",
    "lost",
    "alive",
    "ceiling",
    "taken",
    "not-runner",
]


class Begun(NamedTuple):
    """A begun step: the task's calls used so far, and the Redis server time of the write."""

    calls_used: int
    now: float


class TaskRefused(OvernightError):
    """A task script refused a write; ``reason`` says why and ``state`` names the state that
    made it refuse (the record's for ``state``, the target's for ``illegal``)."""

    def __init__(self, task_id: str, reason: Reason, state: str = "") -> None:
        self.task_id, self.reason, self.state = task_id, reason, state
        super().__init__(f"task {task_id!r}: refused: {self.why}")

    @property
    def why(self) -> str:
        """The script's word for the refusal, e.g. ``stale-attempt`` or ``state:aborted``."""
        return f"{self.reason}:{self.state}" if self.state else self.reason


class TaskIdTaken(TaskRefused):
    """A submitted id names a task that is still live."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id, "taken")

    def __str__(self) -> str:
        return f"id {self.task_id!r} names a task that is still live"


def server_time(client: redis.Redis) -> float:
    """Redis server time in unix seconds (one TIME round trip)."""
    secs, micros = client.time()
    return int(secs) + int(micros) / 1_000_000


def checked(task_id: str, result: list[Any]) -> list[Any]:
    """A script's reply ``{1, ...}``, or :class:`TaskRefused` for its ``{0, reason}``."""
    if int(result[0]) == 1:
        return result
    word, _, state = str(result[1]).partition(":")
    if word not in get_args(Reason):
        raise ValueError(f"task {task_id!r}: script gave an unknown refusal {result[1]!r}")
    raise TaskRefused(task_id, word, state)  # type: ignore[arg-type]


def _register(client: redis.Redis, name: str) -> Script:
    """A task script, after the Lua lines of its rows of the transitions table."""
    op = name if name in get_args(Op) else None
    prelude = lua_prelude(op)  # type: ignore[arg-type]
    return register(client, f"task_{name}", package=COORDINATOR, prelude=prelude)


_SCRIPTS = (
    "create",
    "claim",
    "renew",
    "save",
    "begin",
    "uncharge",
    "orphan",
    "resume",
    "abort",
    "rerun",
    "drop_claim",
    "forget",
)
# A queued task's RQ job is first checked by recovery this long after it was queued, then
# again every as long (its job may simply not have been taken yet).
QUEUED_GRACE = 30.0
# How long a write the server refused to run (OOM, LOADING...) is tried again before the
# refusal is raised to the caller.
WRITE_PATIENCE = 60.0
log = logging.getLogger("overnight.taskstore")


class TaskScripts:
    """A namespace's task scripts on one client, and the server clock they write in."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        retention: int | None = None,
        queued_grace: float = QUEUED_GRACE,
        patience: float = WRITE_PATIENCE,
    ) -> None:
        self.client = client
        self.keys = keys
        self._retention = retention
        self.queued_grace = queued_grace
        self.patience = patience
        self._scripts: dict[str, Script] = {name: _register(client, name) for name in _SCRIPTS}

    @property
    def retention(self) -> int:
        """Seconds an ended task's record is kept (``OVERNIGHT_RETENTION`` unless given)."""
        if self._retention is None:
            from overnight.config.context import settings

            try:
                self._retention = settings().retention
            except Exception:  # a bad setting is reported by whoever loads it first
                self._retention = defaults.RETENTION
        return self._retention

    def _run(self, name: str, keys: list[str], args: list[Any], *, again: bool = False) -> Any:
        # A script the server refused to run (OOM at maxmemory, LOADING, READONLY...) is run
        # again once it can: the refusal means nothing was written. One that does the same
        # whether it ran before or not (``again``) is also run again after a lost reply.
        script = self._scripts[name]
        return retry_transient(
            lambda: script(keys=keys, args=args),
            f"task script {name}",
            log,
            patience=self.patience,
            when=transient if again else not_run,
        )

    def now(self) -> float:
        """Redis server time: the one clock of task times (the scripts read it themselves)."""
        return server_time(self.client)
