"""The environment a step runs with: an allowlist, never the supervisor's own environment.

A supervised child (``overnight supervise``, an agent step, a verifier rule) gets:

- from the supervisor's environment only the names in :data:`ALLOWED` (and ``LC_*``);
- what the caller adds for the step: the task's declared ``env`` and overnight's own step
  variables (``OVERNIGHT_TASK_ID``, ``OVERNIGHT_TURN``, the prompt variables);
- ``HOME`` (and ``TMPDIR`` inside it): a scratch folder made for this step alone, mode
  0700, removed when the step ends;
- ``OVERNIGHT_LEASE_ID`` and the beat channel (:mod:`worker.beat.channel`).

A credential never passes, whoever names it: :func:`is_credential` (the Redis URL, any
``REDIS*`` name, the lease token, any ``*_API_KEY``) is dropped from every source, and the
names overnight sets itself (:func:`is_reserved`) cannot be overridden by what a task
declares. Task files are refused at validation for either (:func:`declared_problem`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING

from overnight.worker.sandbox import nofollow

if TYPE_CHECKING:
    from overnight.worker.sandbox.stepuser import StepUser

ALLOWED = frozenset({"PATH", "LANG", "LANGUAGE", "TERM", "TZ"})
ALLOWED_PREFIXES = ("LC_",)
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
CREDENTIALS = frozenset({"OVERNIGHT_REDIS_URL", "OVERNIGHT_LEASE_TOKEN"})
RESERVED = frozenset(
    {"HOME", "TMPDIR", "OVERNIGHT_LEASE_ID", "OVERNIGHT_TASK_ID", "OVERNIGHT_BEAT_SOCKET"}
)


def is_credential(name: str) -> bool:
    """True for a name that may carry a credential no step ever gets."""
    up = name.upper()
    return up in CREDENTIALS or up.startswith("REDIS") or up.endswith("_API_KEY")


def is_reserved(name: str) -> bool:
    """True for a name overnight sets for every step itself."""
    return name.upper() in RESERVED


def declared_problem(name: str) -> str | None:
    """Why a task may not declare ``name`` in its ``env``, or None if it may."""
    if not name or "=" in name or "\x00" in name:
        return "is not a usable variable name"
    if is_credential(name):
        return "names a credential; a step never gets one"
    if is_reserved(name) or name.upper().startswith("OVERNIGHT_"):
        return "is set by overnight itself"
    return None


def step_environment(
    base: Mapping[str, str],
    declared: Mapping[str, str] | None,
    *,
    lease_id: str | None,
    task_id: str | None = None,
    home: str | None = None,
    channel: Mapping[str, str] | None = None,
    gateway: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of one step.

    ``base`` is the supervisor's environment (only :data:`ALLOWED` names pass), ``declared``
    what the step adds (the task's ``env``, overnight's step variables), ``home`` its scratch
    folder, ``channel`` the beat channel's variables. Credentials are dropped from every
    source; reserved names come only from the arguments. ``gateway`` is the step's
    per-lease gateway token and base URLs (:mod:`worker.gateway.grant`): set last, since
    ``OPENAI_API_KEY`` is named like a credential but is only good while this lease runs.
    """
    env = {k: v for k, v in base.items() if k in ALLOWED or k.startswith(ALLOWED_PREFIXES)}
    env.setdefault("PATH", DEFAULT_PATH)
    for name, value in (declared or {}).items():
        if not is_credential(name) and not is_reserved(name):
            env[name] = value
    for name, value in (channel or {}).items():
        if not is_credential(name):
            env[name] = value
    env.update(gateway or {})
    if home is not None:
        env["HOME"] = home
        env["TMPDIR"] = os.path.join(home, "tmp")
    if lease_id is not None:
        env["OVERNIGHT_LEASE_ID"] = lease_id
    if task_id is not None:
        env["OVERNIGHT_TASK_ID"] = task_id
    return env


def make_home(
    lease_id: str, owner: StepUser | None = None, files: Mapping[str, str] | None = None
) -> str:
    """A fresh scratch folder for one step (mode 0700), with ``tmp/`` inside it, owned by
    ``owner`` (the step user) if given. ``files`` (relative path -> text) are written into
    it first (0600, folders 0700): an agent preset's configuration."""
    home = tempfile.mkdtemp(prefix=f"overnight-home-{lease_id[:24]}-")
    made = [os.path.join(home, "tmp")]
    os.mkdir(made[0], 0o700)
    for rel, text in (files or {}).items():
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"not a plain relative path: {rel!r}")
        folder = home
        for part in parts[:-1]:
            folder = os.path.join(folder, part)
            if not os.path.isdir(folder):
                os.mkdir(folder, 0o700)
                made.append(folder)
        path = os.path.join(folder, parts[-1])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        made.append(path)
    if owner is not None:
        for path in [*made, home]:
            os.chown(path, owner.uid, owner.gid)
    return home


def remove_home(home: str) -> None:
    """Remove a step's scratch folder and all it holds (read-only folders it left, a Go
    module cache, too), never following a link the step left in it or swapped in for it:
    a concurrent step of the same user can do either while overnight (root) removes it."""
    with contextlib.suppress(OSError):
        nofollow.remove_path(home)
