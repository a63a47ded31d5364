"""The argv that launches one step inside a bubblewrap sandbox: a pure function of a small spec.

What the step sees (and nothing else of the host):

- the system folders read-only (``/usr``, ``/etc``, ``/opt`` and the top-level links or
  folders ``/bin``, ``/lib*``, ``/sbin``), with a generated ``/etc/passwd`` and ``/etc/group``
  that name its uid (Node's ``os.userInfo()``, git and ssh fail on a nameless uid);
- its task's worktree read-write, the paths its caller lists read-only (the task's prompt
  folder, overnight's own code) or read-write, at the same paths as outside;
- a private ``/tmp``, ``/var/tmp``, ``/dev/shm`` and HOME (tmpfs: they vanish with the step),
  the preset's HOME files copied in from file descriptors, a fresh ``/proc`` and a minimal
  ``/dev``;
- its own pid, IPC, UTS and network namespaces: inside the network namespace only loopback
  exists, and a bridge (:mod:`worker.sandbox.bridge`) started before the step forwards the
  loopback port the step's ``base_url`` names to the gateway's Unix socket, bound in (and,
  for a task with ``allow_hosts``, a second port to its proxy's socket).

As root, the step's uid is taken before bwrap starts (``setpriv``), so bwrap runs
unprivileged through a user namespace and the step is the same uid outside (its files are
its own, not root's). bwrap drops every capability and sets ``no_new_privs`` for the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Network = Literal["none", "host"]

# Top-level entries of a Debian-like root that hold programs and libraries, never state.
SYSTEM_TOP = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt")
# Never bound read-write at any depth (the host's live state), nor any of SHARED itself.
HOST_TOP = ("proc", "sys", "dev", "run", "boot")
SHARED = ("/tmp", "/var", "/var/tmp", "/home", "/root", "/srv", "/mnt", "/media")
GATEWAY_SOCKET = "/run/gateway/socket"  # where the gateway's Unix socket is bound inside
PROXY_SOCKET = "/run/proxy/socket"  # where the step's allow_hosts proxy is bound inside
TMPFS_PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass(frozen=True)
class HomeFile:
    """A file overnight places in the step's HOME: its path under HOME and the descriptor
    (readable from its start) bwrap copies it from."""

    rel: str
    fd: int


@dataclass(frozen=True)
class SandboxSpec:
    """Everything :func:`launch_argv` needs; no I/O is done to build the argv.

    ``top`` maps each entry of ``/`` that exists on this host among :data:`SYSTEM_TOP` to its
    link target (None: a real folder). ``switch_uid`` says the launcher runs as root and the
    step as ``uid``/``gid`` (with ``groups``): bwrap is started through ``setpriv`` as that
    uid. ``unprivileged``: bwrap runs as a uid other than 0 (always, with ``switch_uid``).
    ``passwd_fd``/``group_fd`` hold the generated files. ``bridge`` is the argv prefix
    of the network bridge (its program and arguments up to the step's own argv), set when
    ``gateway_socket`` and ``gateway_port`` are, or ``proxy_socket`` and ``proxy_port``.
    """

    argv: tuple[str, ...]
    worktree: str
    cwd: str
    uid: int
    gid: int
    home: str
    passwd_fd: int
    group_fd: int
    top: Mapping[str, str | None]
    switch_uid: bool = False
    unprivileged: bool = False  # bwrap runs as a uid other than 0 (through a user namespace)
    groups: tuple[int, ...] = ()
    writable: tuple[str, ...] = ()
    readable: tuple[str, ...] = ()
    sockets: tuple[str, ...] = ()  # Unix sockets bound in at the same path (the beat channel)
    # Files and folders under the system folders that not everyone may read (/etc/shadow,
    # /etc/ssl/private): emptied inside, for a step whose uid could read them (root steps).
    hidden_files: tuple[str, ...] = ()
    hidden_dirs: tuple[str, ...] = ()
    home_files: tuple[HomeFile, ...] = ()
    network: Network = "none"
    gateway_socket: str | None = None
    gateway_port: int | None = None
    proxy_socket: str | None = None
    proxy_port: int | None = None
    bridge: tuple[str, ...] = ()
    bwrap: str = "bwrap"
    setpriv: str = "setpriv"
    hostname: str = "overnight-sandbox"
    tmpfs_size: int = 0  # bytes each private tmpfs (tmp folders, HOME) may hold; 0: no cap
    extra: tuple[str, ...] = field(default=())  # more bwrap options, placed before the argv


def passwd_text(user: str, uid: int, gid: int, home: str) -> str:
    """A one-user ``/etc/passwd`` (plus root and nobody, as tools expect them)."""
    lines = ["root:x:0:0:root:/root:/usr/sbin/nologin"]
    if uid != 0:
        lines.append(f"{user}:x:{uid}:{gid}:overnight step:{home}:/bin/sh")
    lines.append("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin")
    return "\n".join(lines) + "\n"


def group_text(user: str, gid: int) -> str:
    """A ``/etc/group`` naming the step's group (plus root and nogroup)."""
    lines = ["root:x:0:"]
    if gid != 0:
        lines.append(f"{user}:x:{gid}:")
    lines.append("nogroup:x:65534:")
    return "\n".join(lines) + "\n"


def writable_problem(path: str) -> str | None:
    """Why ``path`` may not be bound read-write into a sandbox (None: it may): it must be
    absolute, not ``/``, not in a system folder or the host's live state (``/run``,
    ``/proc``...), and not a whole shared folder (``/tmp``, ``/home``...): any of these
    would undo the sandbox's view."""
    if not path.startswith("/"):
        return f"{path!r} is not an absolute path"
    parts = [p for p in path.split("/") if p]
    if (
        not parts
        or parts[0] in SYSTEM_TOP + HOST_TOP
        or "/" + "/".join(parts) in SHARED
        or any(p in (".", "..") for p in parts)
    ):
        return f"{path!r} would expose the host read-write"
    return None


def _parents(rel: str) -> list[str]:
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _forwards(spec: SandboxSpec) -> list[tuple[str, str, int]]:
    """(socket outside, socket inside, loopback port) for each socket the bridge serves."""
    if spec.network == "host":
        return []
    if (spec.gateway_socket is None) != (spec.gateway_port is None):
        raise ValueError("a gateway needs both its socket and its port")
    if (spec.proxy_socket is None) != (spec.proxy_port is None):
        raise ValueError("a proxy needs both its socket and its port")
    found = []
    if spec.gateway_socket is not None and spec.gateway_port is not None:
        found.append((spec.gateway_socket, GATEWAY_SOCKET, spec.gateway_port))
    if spec.proxy_socket is not None and spec.proxy_port is not None:
        found.append((spec.proxy_socket, PROXY_SOCKET, spec.proxy_port))
    if found and not spec.bridge:
        raise ValueError("a gateway or proxy needs the bridge's argv")
    if len({port for _, _, port in found}) < len(found):
        raise ValueError("the gateway and the proxy need ports of their own")
    return found


def launch_argv(spec: SandboxSpec) -> list[str]:
    """The full argv that starts ``spec.argv`` in its sandbox."""
    forwards = _forwards(spec)
    for path in (spec.worktree, *spec.writable):
        problem = writable_problem(path)
        if problem is not None:
            raise ValueError(f"cannot bind read-write: {problem}")
    argv: list[str] = []
    if spec.switch_uid:
        groups = ",".join(str(g) for g in spec.groups)
        argv += [spec.setpriv, f"--reuid={spec.uid}", f"--regid={spec.gid}"]
        argv += [f"--groups={groups}"] if groups else ["--clear-groups"]
        argv.append("--")
    argv += [spec.bwrap, "--die-with-parent", "--new-session"]
    if spec.unprivileged:  # no user namespace of its own for the step: less kernel to reach
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if spec.network != "host":
        argv.append("--unshare-net")
    argv += ["--hostname", spec.hostname, "--cap-drop", "ALL"]
    for name in SYSTEM_TOP:
        if name not in spec.top:
            continue
        target = spec.top[name]
        if target is None:
            argv += ["--ro-bind", f"/{name}", f"/{name}"]
        else:
            argv += ["--symlink", target, f"/{name}"]
    for path in spec.hidden_files:
        argv += ["--ro-bind", "/dev/null", path]
    for path in spec.hidden_dirs:
        argv += ["--perms", "0700", "--tmpfs", path]
    argv += ["--ro-bind-data", str(spec.passwd_fd), "/etc/passwd"]
    argv += ["--ro-bind-data", str(spec.group_fd), "/etc/group"]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    size = ["--size", str(spec.tmpfs_size)] if spec.tmpfs_size else []
    for path in TMPFS_PRIVATE:
        argv += ["--perms", "1777", *size, "--tmpfs", path]
    argv += ["--perms", "0700", *size, "--tmpfs", spec.home]
    for item in spec.home_files:
        for parent in _parents(item.rel):
            argv += ["--perms", "0700", "--dir", f"{spec.home}/{parent}"]
        argv += ["--perms", "0600", "--file", str(item.fd), f"{spec.home}/{item.rel}"]
    argv += ["--bind", spec.worktree, spec.worktree]
    for path in spec.writable:
        argv += ["--bind", path, path]
    # Read-only binds last: one inside the worktree stays read-only (bwrap mounts in order).
    for path in spec.readable:
        argv += ["--ro-bind", path, path]
    for path in spec.sockets:
        argv += ["--ro-bind", path, path]
    for outside, inside, _port in forwards:
        argv += ["--ro-bind", outside, inside]
    argv += [*spec.extra, "--chdir", spec.cwd, "--"]
    if forwards:
        argv += list(spec.bridge)
        for _outside, inside, port in forwards:
            argv += [str(port), inside]
        argv.append("--")
    argv += spec.argv
    return argv
