"""Launching a step in its sandbox: the I/O around :func:`worker.sandbox.bwrap.launch_argv`.

``OVERNIGHT_SANDBOX`` says whether steps run in a bubblewrap sandbox (``bwrap``) or with
only the older containment (``off``: said at start). Where the sandbox is asked for but
cannot start (no bwrap, user namespaces off, a container whose seccomp forbids them),
:func:`require` ends the command with one line naming the fix (exit 78): never a silent
fallback to less containment.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from overnight.config.exits import EXIT_BAD_CONFIG, CommandError
from overnight.worker.sandbox import bwrap
from overnight.worker.sandbox.proxy import proxy_env
from overnight.worker.sandbox.stepuser import reach_problem

if TYPE_CHECKING:
    from overnight.worker.sandbox.stepuser import StepUser

SANDBOX_VAR = "OVERNIGHT_SANDBOX"
BWRAP = "bwrap"
OFF = "off"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROBE_TIMEOUT = 20.0


# What bwrap says when a container's or the kernel's policy refuses it, and the fix of each.
_NAMESPACES = ("no permissions to create new namespace", "creating new namespace failed")
_UID_MAP = "setting up uid map"
_SLAVE = "failed to make / slave"
_PROC = "can't mount proc"
_HOST_USERNS = (
    "allow unprivileged user namespaces (sysctl user.max_user_namespaces=15000; on Ubuntu "
    "24.04 also kernel.apparmor_restrict_unprivileged_userns=0)"
)
_CONTAINER_OPTS = (
    "run the container with security_opt seccomp=unconfined, apparmor=unconfined and "
    "systempaths=unconfined (docker-compose.yml's worker service has them)"
)


def fix_for(problem: str, container: bool) -> str:
    """The fix to name for a sandbox that could not start with ``problem`` (bwrap's own last
    line, or what overnight found), on a host that is (or is not) a container."""
    said = problem.lower()
    if "bwrap is not installed" in said:
        return "install bubblewrap (apt-get install bubblewrap)"
    if "python3" in said:
        return "install python3 in the system folders (apt-get install python3)"
    if container and (_PROC in said or _SLAVE in said or any(n in said for n in _NAMESPACES)):
        return _CONTAINER_OPTS
    if container and _UID_MAP in said:
        return f"{_CONTAINER_OPTS}, and on the host {_HOST_USERNS}"
    if container:
        return f"{_CONTAINER_OPTS}, or {_HOST_USERNS}"
    return _HOST_USERNS


def in_container() -> bool:
    """Whether this process runs in a Docker or Podman container (their marker files)."""
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")


class SandboxUnavailable(CommandError):
    """The sandbox is asked for and cannot start here (exit 78, one line naming the fix)."""

    def __init__(self, problem: str, fix: str | None = None) -> None:
        fix = fix_for(problem, in_container()) if fix is None else fix
        super().__init__(
            f"bad configuration: {SANDBOX_VAR}={BWRAP}: no sandbox can start here ({problem}); "
            f"{fix}, or set {SANDBOX_VAR}={OFF} to run steps without one",
            EXIT_BAD_CONFIG,
        )
        self.problem = problem


def find_bwrap() -> str | None:
    """The bwrap program on the system folders' PATH (never one a step could have planted)."""
    return shutil.which("bwrap", path=SYSTEM_PATH)


def system_python() -> str | None:
    """A Python of the system folders, which every sandbox sees (the bridge runs on it)."""
    return shutil.which("python3", path=SYSTEM_PATH)


def root_entries(root: str = "/") -> dict[str, str | None]:
    """Each of :data:`bwrap.SYSTEM_TOP` present under ``root``: its link target, or None."""
    found: dict[str, str | None] = {}
    for name in bwrap.SYSTEM_TOP:
        path = os.path.join(root, name)
        if os.path.islink(path):
            found[name] = os.readlink(path)
        elif os.path.isdir(path):
            found[name] = None
    return found


# A path under the system folders with its owner and group.
Owned = tuple[str, int, int]


@cache
def hidden(root: str = "/etc") -> tuple[tuple[Owned, ...], tuple[Owned, ...]]:
    """The files and folders under ``root`` that not everyone may read (not followed
    through links), with their owner and group: what a sandbox empties for a step that
    could read them (:func:`hidden_from`; read once a process: such files are rare and
    stay put)."""
    files: list[Owned] = []
    folders: list[Owned] = []
    for top, subs, names in os.walk(root):
        open_subs = []
        for name in subs:
            path = os.path.join(top, name)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                continue
            if info.st_mode & 0o005 != 0o005:
                folders.append((path, info.st_uid, info.st_gid))
            else:
                open_subs.append(name)
        subs[:] = open_subs
        for name in names:
            path = os.path.join(top, name)
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and not info.st_mode & 0o004:
                    files.append((path, info.st_uid, info.st_gid))
    return tuple(sorted(files)), tuple(sorted(folders))


def hidden_from(entries: Sequence[Owned], uid: int, gids: Sequence[int]) -> tuple[str, ...]:
    """The paths of ``entries`` (none of which everyone may read) that a process of ``uid``
    and groups ``gids`` could: root, the owner, a member of the group. Anyone else falls in
    the "others" class the file shuts out already, so emptying it would cost the sandbox
    a mount and hide nothing (each mount is a share of every step's start)."""
    return tuple(path for path, owner, group in entries if uid in (0, owner) or group in gids)


def bridge_argv(python: str) -> tuple[str, ...]:
    """The argv prefix that runs :mod:`worker.sandbox.bridge` from its source text."""
    source = resources.files("overnight.worker.sandbox").joinpath("bridge.py").read_text()
    return (python, "-I", "-S", "-c", source)


def _under_system(path: str) -> bool:
    top = Path(path).parts[1:2]
    return not top or top[0] in bwrap.SYSTEM_TOP  # "/" itself is never bound


def own_code() -> tuple[str, ...]:
    """Folders holding overnight's own code and its Python (read-only in every sandbox, so
    a step can run ``overnight beat`` and overnight's model step runs there)."""
    import overnight.config
    import overnight.coordinator
    import overnight.worker

    folders = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    for package in (overnight, overnight.config, overnight.worker, overnight.coordinator):
        if package.__file__ is not None:  # never a namespace package's path: any folder
            folders.add(os.path.dirname(os.path.realpath(package.__file__)))
    return tuple(sorted(f for f in folders if not _under_system(f)))


def _outside(paths: Sequence[str], tree: str) -> list[str]:
    # overnight's code inside a task's tree (a task on overnight's own repository) is the
    # task's to edit: its read-only bind would cover the tree's.
    root = os.path.realpath(tree)
    return [p for p in paths if os.path.commonpath([os.path.realpath(p), root]) != root]


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class Prepared:
    """A step's launch: the argv, the descriptors it must inherit, its HOME inside."""

    argv: list[str]
    home: str
    pass_fds: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def close(self) -> None:
        """Close the descriptors once the step has started (bwrap copied them)."""
        for fd in self.pass_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.pass_fds = ()


def identity(user: StepUser | None) -> tuple[str, int, int, tuple[int, ...]]:
    """Who the step is inside: name, uid, gid, supplementary groups."""
    if user is not None:
        return user.name, user.uid, user.gid, user.groups
    uid, gid = os.geteuid(), os.getegid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = "overnight"
    return name, uid, gid, ()


def _reachable(paths: Sequence[str], user: StepUser | None) -> tuple[str, ...]:
    kept = []
    for path in dict.fromkeys(paths):
        if not os.path.exists(path):
            continue
        if user is not None and os.geteuid() == 0 and reach_problem(path, user) is not None:
            continue  # bwrap runs as the step's uid: a path it cannot reach cannot be bound
        kept.append(path)
    return tuple(kept)


def prepare(
    argv: Sequence[str],
    *,
    cwd: str,
    worktree: str,
    user: StepUser | None,
    env: Mapping[str, str],
    home_files: Mapping[str, str] | None = None,
    readable: Sequence[str] = (),
    writable: Sequence[str] = (),
    sockets: Sequence[str] = (),
    network: bwrap.Network = "none",
    gateway_socket: str | None = None,
    gateway_port: int | None = None,
    tmpfs_size: int = 0,
    proxy_socket: str | None = None,
    proxy_port: int | None = None,
) -> Prepared:
    """The launch of ``argv`` in its sandbox, as ``user`` (None: this process's user).
    Raises :class:`SandboxUnavailable` without bwrap (or, for a gateway or a proxy, a system
    Python). With a proxy, the step's environment points its HTTP clients at it."""
    for path in (worktree, *writable):
        problem = bwrap.writable_problem(os.path.realpath(path))
        if problem is not None:  # an OSError: the step does not start, and says why
            raise PermissionError(f"the sandbox cannot bind {path} read-write: {problem}")
    program = find_bwrap()
    if program is None:
        raise SandboxUnavailable("bwrap is not installed")
    bridge: tuple[str, ...] = ()
    if (gateway_socket is not None or proxy_socket is not None) and network != "host":
        python = system_python()
        if python is None:
            raise SandboxUnavailable("the gateway bridge needs python3 in the system folders")
        bridge = bridge_argv(python)
    name, uid, gid, groups = identity(user)
    home = "/root" if uid == 0 else f"/home/{name}"
    # The groups the kernel checks: setpriv sets the step user's; else this process's own.
    gids = (gid, *groups) if user is not None else (os.getegid(), *os.getgroups())
    secret_files, secret_dirs = hidden()
    fds: list[int] = []
    try:
        fds.append(_memfd("passwd", bwrap.passwd_text(name, uid, gid, home).encode()))
        fds.append(_memfd("group", bwrap.group_text(name, gid).encode()))
        files = []
        for rel, text in (home_files or {}).items():
            parts = rel.split("/")
            if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"not a plain relative path: {rel!r}")
            fd = _memfd("home-file", text.encode())
            fds.append(fd)
            files.append(bwrap.HomeFile(rel, fd))
        spec = bwrap.SandboxSpec(
            argv=tuple(argv),
            worktree=worktree,
            cwd=cwd,
            uid=uid,
            gid=gid,
            home=home,
            passwd_fd=fds[0],
            group_fd=fds[1],
            top=root_entries(),
            switch_uid=os.geteuid() == 0 and user is not None,
            unprivileged=uid != 0,
            groups=groups,
            writable=tuple(writable),
            readable=_reachable([*_outside(own_code(), worktree), *readable], user),
            sockets=_reachable(sockets, user),
            hidden_files=hidden_from(secret_files, uid, gids),
            hidden_dirs=hidden_from(secret_dirs, uid, gids),
            home_files=tuple(files),
            network=network,
            gateway_socket=gateway_socket,
            gateway_port=gateway_port if gateway_socket is not None else None,
            proxy_socket=proxy_socket,
            proxy_port=proxy_port if proxy_socket is not None else None,
            bridge=bridge,
            bwrap=program,
            setpriv=shutil.which("setpriv", path=SYSTEM_PATH) or "setpriv",
            tmpfs_size=tmpfs_size,
        )
        launch = bwrap.launch_argv(spec)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    inside = {**env, "HOME": home, "TMPDIR": "/tmp"}
    if proxy_socket is not None and proxy_port is not None and network != "host":
        inside.update(proxy_env(proxy_port))
    return Prepared(launch, home, tuple(fds), inside)


@cache
def probe(user: StepUser | None) -> str | None:
    """Why a sandbox cannot start here for ``user`` (None: it can), by starting one."""
    import tempfile

    here = tempfile.mkdtemp(prefix="overnight-probe-")
    os.chmod(here, 0o755)
    try:
        ready = prepare(["true"], cwd=here, worktree=here, user=user, env={"PATH": SYSTEM_PATH})
    except SandboxUnavailable as exc:
        os.rmdir(here)
        return exc.problem
    try:
        done = subprocess.run(
            ready.argv,
            env=ready.env,
            pass_fds=ready.pass_fds,
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not run: {exc}"
    finally:
        ready.close()
        os.rmdir(here)
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"bwrap: {lines[-1] if lines else f'exit {done.returncode}'}"
    return None


def require(
    mode: str,
    user: StepUser | None,
    tried: Callable[[StepUser | None], str | None] = probe,
) -> bool:
    """True if steps run sandboxed (``mode`` is ``bwrap`` and a sandbox starts here),
    False for ``off``; raises :class:`SandboxUnavailable` when one is asked for and cannot.
    ``tried`` starts one and says why it could not (None: it could)."""
    if mode != BWRAP:
        return False
    problem = tried(user)
    if problem is not None:
        raise SandboxUnavailable(problem)
    return True


@cache
def configured(user: StepUser | None) -> bool:
    """:func:`require` by this process's settings (read once): whether its steps, run as
    ``user``, are sandboxed; :class:`SandboxUnavailable` (exit 78) if asked for and impossible."""
    from overnight.config.validate import read_fast

    fast = read_fast(os.environ)
    if fast is not None:
        return require(fast.sandbox, user)
    from overnight.config.context import settings

    return require(settings().sandbox, user)
