"""What ``run_supervised`` is given (:class:`StepSpec`) and gives back
(:class:`SupervisedResult`), and how a step's sandboxed launch is prepared from its spec."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from overnight.config import defaults
from overnight.worker.beat.channel import SOCKET_VAR
from overnight.worker.gateway.grant import Grant
from overnight.worker.lease.store import LeaseDoc
from overnight.worker.supervise import tree

if TYPE_CHECKING:
    from overnight.worker.sandbox.bwrap import Network
    from overnight.worker.sandbox.launch import Prepared
    from overnight.worker.sandbox.limits import Limits
    from overnight.worker.sandbox.stepuser import StepUser


@dataclass
class StepSpec:
    """One command to run under one lease.

    ``deadline`` is the lease budget, ``gap`` the longest silence allowed, ``grace`` the
    time between SIGTERM and SIGKILL, all in seconds. ``env`` is what the step adds to the
    allowlisted environment (:func:`worker.sandbox.stepenv.step_environment`: the task's declared
    variables, overnight's step variables; never a credential). ``stdin_data``, if given, is
    the child's whole stdin (a pre-filled pipe; else /dev/null): how overnight's own model
    step gets its settings without the environment. ``install_signals`` makes
    SIGTERM/SIGINT/SIGHUP to this process end the step (main thread only; the CLI uses it,
    an RQ horse does not). ``user`` is who the step runs as (None: this process's user;
    the commands decide it by :func:`worker.sandbox.stepuser.configured`); its scratch HOME is its
    own and ``cwd`` must be a folder it can write, else the step does not start.
    ``contain`` puts the step in a per-lease cgroup where this host and user allow it (a
    sandboxed step only where that cgroup would hold its limits: its pid namespace ends
    its tree, :func:`worker.sandbox.cgroup.holds_limits`).
    """

    argv: list[str]
    deadline: float = defaults.DEADLINE
    gap: float = defaults.HEARTBEAT_GAP
    grace: float = defaults.GRACE
    lease_id: str | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    output_beats: bool = True
    beat_while_alive: bool = False
    lease_file: str | None = None
    task_id: str | None = None
    install_signals: bool = False
    stdin_data: bytes | None = None
    note: str = "boot"
    user: StepUser | None = None
    contain: bool = True
    # What the step may spend through the gateway; None: it gets no gateway token.
    grant: Grant | None = None
    # Written into the step's scratch HOME before it starts (an agent preset's config files).
    home_files: dict[str, str] | None = None
    # In a bubblewrap sandbox of its own (worker.sandbox.launch): the worktree (default:
    # cwd) read-write, ``readable``/``writable`` paths bound in, its network only the gateway
    # (reached through ``gateway_socket``, else a per-step relay to the grant's base_url).
    sandbox: bool = False
    worktree: str | None = None
    readable: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    network: Network = "none"
    gateway_socket: str | None = None
    # Hosts (worker.sandbox.proxy) the sandboxed step reaches through a proxy of its own.
    allow_hosts: tuple[str, ...] = ()
    # Processes, memory, open files, CPU and disk (worker.sandbox.limits); None: the settings'.
    limits: Limits | None = None


class Served(Protocol):
    """What a sandbox is served through until its step ends (a relay, a proxy)."""

    def close(self) -> None: ...


@dataclass
class SupervisedResult:
    """How a step ended.

    ``exit_code`` is the contract's ``supervise`` exit; ``doc`` the final lease document
    (as Redis holds it, or as the supervisor last knew it if Redis was lost); ``reason`` the
    note the supervisor ended the lease with; ``returncode`` the child's own status (negative
    for a signal, None if it never ran); ``ended_here`` is False when another writer (the
    reaper) ended the lease first.
    """

    exit_code: int
    doc: LeaseDoc
    reason: str
    returncode: int | None = None
    lease_lost: bool = False
    ended_here: bool = True
    seconds: float = 0.0
    kill: tree.KillReport | None = None


def serialized(on_output: Callable[[bytes], None] | None) -> Callable[[bytes], None] | None:
    """``on_output`` called by one thread at a time (the step's pipes and its proxy share it)."""
    if on_output is None:
        return None
    lock = threading.Lock()

    def say(line: bytes) -> None:
        with lock:
            on_output(line)

    return say


def prepare_sandbox(
    spec: StepSpec,
    env: dict[str, str],
    lease_id: str,
    tmpfs_size: int = 0,
    say: Callable[[bytes], None] | None = None,
) -> tuple[Prepared, list[Served]]:
    """The sandboxed launch of ``spec`` (:mod:`worker.sandbox.launch`) and what it needs
    served until it ends: the per-step relay to a TCP-only gateway (none when the gateway's
    socket is bound in, or no grant) and the proxy to its ``allow_hosts`` (``say`` gets the
    proxy's lines for the step's output)."""
    from overnight.worker.sandbox import launch, relay
    from overnight.worker.sandbox.proxy import Proxy, inside_port, parse_rule

    cwd = spec.cwd or os.getcwd()
    socket, port = None, None
    opened: list[Served] = []
    if spec.grant is not None and spec.network != "host":
        port = relay.url_port(spec.grant.base_url)
        socket = spec.gateway_socket
        if socket is None:
            step_relay = relay.Relay(lease_id, "127.0.0.1", port)
            opened.append(step_relay)
            socket = step_relay.path
    proxy: Proxy | None = None
    try:
        if spec.allow_hosts and spec.network != "host":
            rules = [parse_rule(text) for text in spec.allow_hosts]
            proxy = Proxy(rules, lease_id=lease_id, task_id=spec.task_id, say=say)
            opened.append(proxy)
        beat = env.get(SOCKET_VAR)
        prepared = launch.prepare(
            spec.argv,
            cwd=cwd,
            worktree=spec.worktree or cwd,
            user=spec.user,
            env=env,
            home_files=spec.home_files,
            readable=spec.readable,
            writable=spec.writable,
            sockets=(beat,) if beat else (),
            network=spec.network,
            gateway_socket=socket,
            gateway_port=port,
            tmpfs_size=tmpfs_size,
            proxy_socket=proxy.path if proxy is not None else None,
            proxy_port=inside_port(port) if proxy is not None else None,
        )
    except BaseException:
        for item in opened:
            item.close()
        raise
    return prepared, opened
