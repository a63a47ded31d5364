"""A step's limits: processes, memory, open files, CPU time and disk written.

The host here delegates no cgroup controller, so two things hold them together:

- rlimits set before the step's first program runs, by ``prlimit`` as the first element of
  the launch chain (no ``preexec_fn``): ``RLIMIT_NPROC`` (the step uid's processes already
  running plus ``pids``; the kernel counts every process of a real uid, so this is a
  per-uid backstop), ``RLIMIT_DATA`` (each process's data segment, not address space:
  runtimes that reserve but never touch memory still start), ``RLIMIT_NOFILE`` and
  ``RLIMIT_CPU`` (a little above the limit: a backstop, SIGXCPU then SIGKILL);
- the supervisor's :class:`Watch`, which samples the tree (its process count, summed
  resident memory, each process's CPU time) and the bytes in its writable trees (the
  worktree's growth, walked; the sandbox's private tmpfs mounts, measured through
  ``/proc/PID/root`` by ``statvfs``), and ends the step naming the limit in words.

The sandbox's tmpfs mounts are also capped at the disk limit (bwrap ``--size``), so a
writer there fills them and gets ENOSPC before the watch's next look.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROC_EVERY = 0.5  # seconds between looks at the tree's processes
DISK_EVERY = 2.0  # seconds between looks at the writable trees (a walk of the worktree)
WALK_SHARE = 20  # a big worktree is walked at most 1/20 of the time (its walk's cost x 20)
CPU_SLACK = 5  # the rlimit's CPU seconds above the limit: the watch names it first
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")
KEYS = ("pids", "memory", "open_files", "cpu", "disk")


@dataclass(frozen=True)
class Limits:
    """What one step may use; 0 means no limit of that kind."""

    pids: int = 0
    memory: int = 0  # bytes
    open_files: int = 0
    cpu: int = 0  # seconds, per process
    disk: int = 0  # bytes written into the worktree, HOME and tmp

    def overridden(self, task: Mapping[str, int | None]) -> Limits:
        """These limits with a task's own values (None: keep the setting's)."""
        given = {k: v for k, v in task.items() if k in KEYS and v is not None}
        return replace(self, **given)


def configured() -> Limits:
    """The limits this process's settings name (the fast path's reader where it can)."""
    from overnight.config.validate import read_fast

    source: object = read_fast(os.environ)
    if source is None:
        from overnight.config.context import settings

        source = settings()
    return Limits(**{k: int(getattr(source, f"step_{k}")) for k in KEYS})


def words(kind: str, limit: int) -> str:
    """A limit in words, as the lease note, status, report and next prompt say it."""
    if kind == "pids":
        return f"process limit reached ({limit} processes)"
    if kind == "memory":
        return f"memory limit reached ({human(limit)})"
    if kind == "cpu":
        return f"CPU time limit reached ({limit} s in one process)"
    if kind == "disk":
        return f"disk limit reached ({human(limit)} written to the worktree, HOME and tmp)"
    return f"{kind} limit reached ({limit})"


def human(size: int) -> str:
    """Bytes as the settings write them (``4 GiB``, ``512 MiB``, ``1000 bytes``)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} bytes"


def rlimit_args(limits: Limits, *, uid_procs: int, nofile_hard: int) -> list[str]:
    """``prlimit`` options for ``limits``: ``uid_procs`` is how many processes the step's real
    uid runs now (``RLIMIT_NPROC`` counts them all), ``nofile_hard`` the highest open-files
    limit this process may set."""
    args: list[str] = []
    if limits.pids:
        args.append(f"--nproc={uid_procs + limits.pids}")
    if limits.memory:
        args.append(f"--data={limits.memory}")
    if limits.open_files:
        args.append(f"--nofile={min(limits.open_files, nofile_hard)}")
    if limits.cpu:
        args.append(f"--cpu={limits.cpu + CPU_SLACK}:{limits.cpu + 2 * CPU_SLACK}")
    return args


@dataclass(frozen=True)
class Sample:
    """What the watch saw of a step: its processes, their resident bytes, the most CPU
    seconds of any one, and the bytes written into its writable trees (None: not looked)."""

    pids: int = 0
    memory: int = 0
    cpu: float = 0.0
    disk: int | None = None


def over(limits: Limits, seen: Sample) -> str | None:
    """The first limit ``seen`` reaches (its kind), or None."""
    checks = (
        ("pids", limits.pids, seen.pids),
        ("memory", limits.memory, seen.memory),
        ("cpu", limits.cpu, seen.cpu),
        ("disk", limits.disk, seen.disk or 0),
    )
    for kind, limit, value in checks:
        if limit and value >= limit:
            return kind
    return None


def cgroup_files(limits: Limits) -> dict[str, str]:
    """The cgroup v2 files that hold ``limits`` where the host delegates the ``pids`` and
    ``memory`` controllers to the step's group (a file that is absent there is skipped)."""
    files: dict[str, str] = {}
    if limits.pids:
        files["pids.max"] = str(limits.pids)
    if limits.memory:
        files["memory.max"] = str(limits.memory)
        files["memory.swap.max"] = "0"
    return files


def note(kind: str, limits: Limits) -> str:
    """The lease note of a step ended over ``kind`` (``over-limit: <words>``)."""
    return f"over-limit: {words(kind, getattr(limits, kind))}"


# --- I/O --------------------------------------------------------------------------------


def find_prlimit() -> str | None:
    """The prlimit program of the system folders (never one a step could have planted)."""
    return shutil.which("prlimit", path=SYSTEM_PATH)


def uid_processes(uid: int) -> int:
    """How many processes have ``uid`` as their real uid (as ``RLIMIT_NPROC`` counts)."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with (
            contextlib.suppress(OSError, ValueError, IndexError),
            open(f"/proc/{name}/status", "rb") as fh,
        ):
            for line in fh:
                if line.startswith(b"Uid:"):
                    count += int(line.split()[1]) == uid
                    break
    return count


def launch_prefix(limits: Limits, uid: int, *, alone: bool = False) -> list[str]:
    """The argv prefix that sets ``limits`` on the step's first program as ``uid``; empty
    when there is nothing to set or no prlimit (the watch still holds them). ``alone``: no
    other process runs as ``uid`` (a task's own uid between its steps, each ended whole), so
    ``/proc`` is not walked to count them; were one left, the step would only get fewer."""
    program = find_prlimit()
    if program is None:
        return []
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile_hard = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if uid == 0:  # root ignores RLIMIT_NPROC: no walk of /proc for it (the watch holds)
        limits = replace(limits, pids=0)
    count = uid_processes(uid) if limits.pids and not alone else 0
    args = rlimit_args(limits, uid_procs=count, nofile_hard=nofile_hard)
    return [program, *args, "--"] if args else []


def apply_cgroup(group: str, limits: Limits) -> list[str]:
    """Write :func:`cgroup_files` into the step's cgroup folder ``group`` where its
    controllers exist; the names written (empty where none is delegated)."""
    written = []
    for name, value in cgroup_files(limits).items():
        path = os.path.join(group, name)
        if not os.path.exists(path):
            continue
        with contextlib.suppress(OSError), open(path, "w") as fh:
            fh.write(value)
            written.append(name)
    return written


def tree_usage(pids: Iterable[int]) -> tuple[int, int, float]:
    """The live processes among ``pids``, their resident bytes, the most CPU seconds of one."""
    count, rss, cpu = 0, 0, 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/statm", "rb") as fh:
                resident = int(fh.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if fields[0] in (b"Z", b"X"):
            continue
        count += 1
        rss += resident * PAGE
        cpu = max(cpu, (int(fields[11]) + int(fields[12])) / TICKS)
    return count, rss, cpu


def tree_bytes(root: str) -> int:
    """Bytes allocated under ``root`` (links not followed, other file systems not entered)."""
    try:
        top = os.lstat(root)
    except OSError:
        return 0
    total, stack = 0, [root]
    while stack:
        folder = stack.pop()
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if info.st_dev != top.st_dev:
                        continue
                    total += info.st_blocks * 512
                    if stat.S_ISDIR(info.st_mode):
                        stack.append(entry.path)
    return total


def mount_bytes(pid: int, mounts: Iterable[str]) -> int | None:
    """Bytes used in each of ``mounts`` (the sandbox's tmpfs folders) as ``pid``, a process
    inside the sandbox, sees them; None if they cannot be reached through it."""
    total = 0
    for mount in mounts:
        try:
            info = os.statvfs(f"/proc/{pid}/root{mount}")
        except OSError:
            return None
        total += (info.f_blocks - info.f_bfree) * info.f_frsize
    return total


class Watch:
    """The supervisor's look at one step's tree against its limits.

    ``trees`` are host folders whose growth counts as written (the worktree; without the
    sandbox, the scratch HOME); ``mounts`` the sandbox's private tmpfs folders, measured
    through a member of the tree that lives in the sandbox's mount namespace.
    """

    def __init__(
        self, limits: Limits, trees: Iterable[str], mounts: Iterable[str], now: float
    ) -> None:
        self.limits = limits
        self.trees = tuple(trees) if limits.disk else ()
        self.mounts = tuple(mounts) if limits.disk else ()
        self.disk_every = DISK_EVERY
        self.base = self._walk()
        self.proc_at = now + PROC_EVERY
        self.disk_at = now + self.disk_every
        self.own_mnt = _mnt(os.getpid())
        self.last = Sample()

    @property
    def active(self) -> bool:
        return any(getattr(self.limits, k) for k in ("pids", "memory", "cpu", "disk"))

    @property
    def next_check(self) -> float:
        return min(self.proc_at, self.disk_at) if self.active else float("inf")

    def check(self, now: float, members: Iterable[int]) -> str | None:
        """The limit the tree (``members``) is over now (its kind), or None; looks only
        when a look is due."""
        if not self.active or now < self.next_check:
            return None
        members = tuple(members)
        count, rss, cpu = tree_usage(members)
        disk = None
        if now >= self.disk_at and (self.trees or self.mounts):
            disk = self._disk(members)
            self.disk_at = now + self.disk_every
        elif now >= self.disk_at:
            self.disk_at = float("inf")
        self.proc_at = now + PROC_EVERY
        self.last = Sample(count, rss, cpu, disk)
        return over(self.limits, self.last)

    def _walk(self) -> int:
        started = time.monotonic()
        total = sum(tree_bytes(t) for t in self.trees)
        self.disk_every = max(DISK_EVERY, WALK_SHARE * (time.monotonic() - started))
        return total

    def _disk(self, members: Iterable[int]) -> int:
        grown = max(0, self._walk() - self.base)
        if not self.mounts:
            return grown
        for pid in sorted(members, reverse=True):
            mnt = _mnt(pid)
            if mnt is None or mnt == self.own_mnt:
                continue
            used = mount_bytes(pid, self.mounts)
            if used is not None:
                return grown + used
        return grown


def _mnt(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None
