"""Task files: TOML (or the same keys as JSON) validated into a :class:`TaskSpec`.

Validation is total: every problem of every file is collected as one line naming the
file and the key, so ``overnight submit`` can refuse a whole batch at once. The spec's
shapes live in :mod:`spec` and are re-exported here.
"""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from overnight.config.errors import OvernightError
from overnight.coordinator import agents
from overnight.coordinator.tasks.spec import Rule, TaskLimits, TaskSpec
from overnight.coordinator.workspace import remote as remote_ws
from overnight.coordinator.workspace import rulepath
from overnight.coordinator.workspace import worktree as workspace
from overnight.worker.sandbox import stepuser
from overnight.worker.sandbox.stepenv import DEFAULT_PATH
from overnight.worker.sandbox.stepuser import StepUser

__all__ = [
    "Rule",
    "TaskFileError",
    "TaskLimits",
    "TaskSpec",
    "command_problems",
    "load",
    "load_all",
    "parse_text",
]


class TaskFileError(OvernightError):
    """One or more task files are invalid; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(file)"


def _problem_lines(label: str, exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        key = _loc(tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required key is missing"
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{label}: {key}: {message}")
    return lines


def parse_text(text: str, *, json_format: bool) -> dict[str, Any]:
    """The raw mapping of a task file's text; raises ``ValueError`` with a short reason."""
    if json_format:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("the top level must be a table of keys")
    return data


def load(
    path: Path,
    state: Path | None = None,
    warn: Callable[[str], None] | None = None,
    known: Callable[[str], bool] | None = None,
) -> TaskSpec:
    """Load and validate one task file, and resolve its workspace (its base commit, or the
    snapshot of its protected files, kept under ``state``: default, overnight's state
    folder); raises :class:`TaskFileError`. ``warn`` gets the line about a repository's
    uncommitted changes. An id ``known`` says the namespace holds is not refused for its
    existing branch (``up`` and the coordinator skip known tasks, or resume them)."""
    label = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TaskFileError([f"{label}: (file): cannot read: {reason}"]) from None
    try:
        data = parse_text(text, json_format=path.suffix.lower() == ".json")
    except ValueError as exc:
        raise TaskFileError([f"{label}: (file): {exc}"]) from None
    problems: list[str] = []
    remote = "repo" in data
    problems += [f"{label}: {key}: {why}" for key, why in remote_key_problems(data)]
    workdir_text = data.get("workdir", ".")
    workdir = None
    if remote:
        workdir = Path()
    elif isinstance(workdir_text, str) and "\x00" not in workdir_text:
        try:
            workdir = (path.parent / workdir_text).resolve()
            if not workdir.is_dir():
                problems.append(f"{label}: workdir: no such directory: {workdir}")
        except OSError as exc:  # e.g. a name too long for the file system
            problems.append(f"{label}: workdir: unusable: {exc.strerror or exc}")
    if "base" in data:
        problems.append(f"{label}: base: unknown key")
    try:
        spec = TaskSpec.model_validate(data)
    except ValidationError as exc:
        problems[:0] = _problem_lines(label, exc)
    else:
        problem = allow_hosts_problem(spec, _sandbox_mode())
        if problem is not None:
            problems.append(f"{label}: allow_hosts: {problem}")
    if problems:
        raise TaskFileError(problems)
    assert workdir is not None
    state = state or workspace.state_dir()
    argvs = [rule.run for rule in spec.verifier]
    if remote:
        got = remote_ws.resolve(spec, state)
    else:
        got = workspace.resolve(workdir, spec.workspace, spec.protect, argvs, state)
    if got.problems:
        raise TaskFileError([f"{label}: {key}: {text}" for key, text in got.problems])
    assert got.base is not None
    if spec.id and remote and not (known and known(spec.id)):
        branch = workspace.branch_name(spec.id)
        try:
            pushed = remote_ws.branch_pushed(spec, spec.id, state)
        except (workspace.GitError, OSError) as exc:
            raise TaskFileError([f"{label}: push_to: {exc}"]) from None
        if pushed:
            where = workspace.redact(spec.push_to or spec.repo or "")
            why = (
                f"branch {branch} already exists on {where} (an earlier run of this task): "
                "delete it there, or give the task another id"
            )
            raise TaskFileError([f"{label}: id: {why}"])
    elif spec.id and got.base.mode == workspace.WORKTREE and not (known and known(spec.id)):
        branch = workspace.branch_name(spec.id)
        if workspace.branch_exists(got.base.root, branch):
            why = (
                f"branch {branch} already exists in {got.base.root} (an earlier run of this "
                f"task): `overnight rerun {spec.id}` runs it again on that branch (add "
                f"--from-base to start over), or delete the branch to submit the file afresh"
            )
            raise TaskFileError([f"{label}: id: {why}"])
    where = "" if remote else str(workdir)
    update = {"workdir": where, "workspace": got.base.mode, "base": got.base}
    loaded = spec.model_copy(update=update)
    missing = command_problems(loaded, os.environ.get("PATH", ""), _step_user())
    if missing:
        raise TaskFileError([f"{label}: {key}: {text}" for key, text in missing])
    if got.warning and warn is not None:
        warn(f"{label}: warning: {got.warning}")
    preset = agents.get(loaded.agent) if isinstance(loaded.agent, str) else None
    if preset is not None and warn is not None and shutil.which(preset.program) is None:
        warn(
            f"{label}: warning: agent: the {preset.name} preset needs {preset.program!r} on "
            f"PATH, which it is not here (install: {preset.install}); a worker without it ends "
            "the task agent_failed"
        )
    return loaded


def remote_key_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Why the keys of a task file do not name one workspace: ``workdir`` or ``repo`` (not
    both), ``ref`` and ``push_to`` only with ``repo``, which works on a branch."""
    if "repo" not in data:
        return [(key, "needs repo") for key in ("ref", "push_to") if key in data]
    out = []
    if "workdir" in data:
        out.append(("workdir", "a task names a workdir or a repo, not both"))
    if data.get("workspace", "worktree") != "worktree":
        out.append(("workspace", 'a task from a repo works on its branch ("worktree")'))
    return out


def _lookup_path(path: str, cwd: str) -> str:
    """``path`` with its relative entries made absolute from ``cwd``, as a step started
    there resolves them."""
    return os.pathsep.join(
        e if os.path.isabs(e) else os.path.join(cwd, e) for e in path.split(os.pathsep) if e
    )


def allow_hosts_problem(spec: TaskSpec, sandbox: str) -> str | None:
    """Why ``spec``'s ``allow_hosts`` cannot be kept with steps contained by ``sandbox``."""
    if not spec.allow_hosts:
        return None
    if spec.network == "host":
        return 'needs network = "none" (with "host" the agent reaches every host)'
    if sandbox != "bwrap":
        return (
            f"needs OVERNIGHT_SANDBOX=bwrap (it is {sandbox!r}): without the sandbox a step "
            "reaches every host, so nothing would keep it to the list"
        )
    return None


def _sandbox_mode() -> str:
    """How this process's settings contain steps (``off`` when they cannot be read)."""
    from overnight.config.validate import read_fast

    try:
        fast = read_fast(os.environ)
        if fast is not None:
            return fast.sandbox
        from overnight.config.context import settings

        return settings().sandbox
    except Exception:
        return "off"


def _step_user() -> StepUser | None:
    """Who the steps run as, by this process's settings (None: as this user, or a setting
    that cannot be honoured, which the worker reports itself)."""
    try:
        return stepuser.configured()
    except Exception:
        return None


def _which_as(cmd: str, path: str, user: StepUser | None) -> tuple[str | None, str | None]:
    """Where ``cmd`` is found on ``path`` as ``user`` runs it (as execvp does, an entry the
    user cannot use is passed over), and why the first one passed over could not be used."""
    passed = None
    for entry in path.split(os.pathsep):
        found = os.path.join(entry or ".", cmd)
        if not (os.path.isfile(found) and os.access(found, os.X_OK)):
            continue
        problem = stepuser.run_problem(found, user) if user is not None else None
        if problem is None:
            return found, None
        passed = passed or f"{found} is found but {problem}"
    return None, passed


def command_problems(
    spec: TaskSpec, worker_path: str, user: StepUser | None = None
) -> list[tuple[str, str]]:
    """The agent and rule commands of a loaded ``spec`` that cannot be found as its steps
    will look them up (the agent on the task's PATH or ``worker_path``, from its workdir, and
    run as ``user`` when one is set; a rule on ``worker_path`` without relative entries), as
    (key, problem) pairs. A command in the workdir must be in the commit a worktree checks
    out."""
    out: list[tuple[str, str]] = []
    base = spec.base
    if isinstance(spec.agent, list):
        cmd = spec.agent[0]
        path = _lookup_path(spec.env.get("PATH") or worker_path or DEFAULT_PATH, spec.workdir)
        found, problem = _which_as(cmd, path, user) if "/" not in cmd else (None, None)
        if "/" not in cmd and found is None:
            where = f"where {problem}" if problem else f"on PATH ({path})"
            out.append(("agent", f"command {cmd!r} not found {where}"))
        elif "/" in cmd and not os.path.isabs(cmd):
            if base is not None and base.mode == workspace.WORKTREE and base.sha is not None:
                rel = os.path.normpath(os.path.join(base.subdir, cmd)).replace(os.sep, "/")
                absent = workspace.not_in_commit(base.root, base.sha, rel)
                if absent is not None:
                    out.append(("agent", absent))
            elif not os.path.exists(os.path.join(spec.workdir, cmd)):
                out.append(("agent", f"command {cmd!r} does not exist in {spec.workdir}"))
    # As the rule will look it up: no folder its user could write is on its PATH.
    rule_path = rulepath.rule_path(worker_path, [], rulepath.rule_user(user))
    for i, rule in enumerate(spec.verifier):
        cmd = rule.run[0]
        if "/" not in cmd and shutil.which(cmd, path=rule_path) is None:
            out.append((f"verifier[{i}].run", f"rule {rule.name}: command {cmd!r} not found"))
    return out


def load_all(
    paths: list[Path],
    warn: Callable[[str], None] | None = None,
    known: Callable[[str], bool] | None = None,
) -> list[TaskSpec]:
    """Validate every file before returning any; duplicate ids within the batch are refused."""
    problems: list[str] = []
    specs: list[tuple[Path, TaskSpec]] = []
    for path in paths:
        try:
            specs.append((path, load(path, warn=warn, known=known)))
        except TaskFileError as exc:
            problems.extend(exc.problems)
    seen: dict[str, Path] = {}
    for path, spec in specs:
        if spec.id is None:
            continue
        if spec.id in seen:
            problems.append(f"{path}: id: {spec.id!r} is also the id of {seen[spec.id]}")
        seen.setdefault(spec.id, path)
    if problems:
        raise TaskFileError(problems)
    return [spec for _path, spec in specs]
