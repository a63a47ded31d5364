"""Process identity on Linux: who a PID really is, so a reused PID is never signalled."""

from __future__ import annotations

import socket
from functools import cache


@cache
def hostname() -> str:
    """This host's name, as leases and reaper heartbeats record it."""
    return socket.gethostname()


@cache
def boot_id() -> str:
    """The kernel's boot id: PIDs and start times are only comparable within one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; split after its last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])


def is_same_process(pid: int, ticks: int | None, boot: str) -> bool:
    """True only if ``pid`` is alive and is the very process that started at ``ticks``."""
    if pid <= 0 or ticks is None or (boot and boot != boot_id()):
        return False
    return start_ticks(pid) == ticks
