"""Several hosts on one machine: each a Linux network namespace made here, joined to one
Redis in its own namespace by a veth pair (a private link 10.231.K.0/24 that exists only
between namespaces this module made), with its own host name (``unshare --uts``) and
``OVERNIGHT_HOST_ID``; the coordinator's commands run in a namespace of their own. With
:meth:`Cluster.start_sentinels`, replicas and sentinels join the primary in the Redis
namespace and every process is given a ``redis+sentinel://`` URL.

The test process itself reaches that Redis only through its Unix socket (a file, which no
network namespace hides), so no traffic leaves the namespaces made here. A host can be
killed whole (every process of its namespace at once) or cut off (its link down, its
processes alive) and joined again. :meth:`Cluster.close` ends every process of every
namespace and deletes them, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import redis

from overnight.config.keys import Keys
from overnight.config.runtime import gateway_folder
from overnight.coordinator.night.embedded_redis import find_redis_server

OVERNIGHT = str(Path(sys.executable).with_name("overnight"))
REDIS_PORT = 6390  # the primary's; its replicas' are the next ones
SENTINEL_PORT = 26390
SERVICE = "night"  # the name the sentinels know the primary by
# The Redis namespace's end of the coordinator's link: the one address of it every host can
# reach (given a route), so the one the sentinels name the primary by.
SHARED_ADDR = "10.231.0.1"
# Settings every process of the cluster gets (timing knobs shrunk for tests).
FAST = {
    "OVERNIGHT_TASK_CLAIM_TTL": "1",
    "OVERNIGHT_RECOVERY_INTERVAL": "0.5",
    "OVERNIGHT_GRACE": "0.5",
    "OVERNIGHT_REAPER_INTERVAL": "0.25",
    "OVERNIGHT_REAPER_HOST_TTL": "2",
    # The harness runs as root and its steps write to the test's own (root's) folders.
    "OVERNIGHT_ALLOW_ROOT_STEPS": "1",
    "PYTHONUNBUFFERED": "1",
}


class NamespacesRefused(Exception):
    """The kernel (or the lack of root or of ``ip``) refuses network namespaces here."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def namespaces_refused() -> str | None:
    """Why this machine cannot make network namespaces, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool} command (iproute2 / util-linux)"
    probe = f"ovnp{secrets.token_hex(4)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"the kernel refuses network namespaces: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One host: its namespace, id, link and the processes started on it."""

    index: int
    netns: str
    host_id: str
    redis_addr: str  # Redis as this host reaches it
    link: str  # the Redis side of its veth pair (in the Redis namespace)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    model_url: str | None = None  # a scripted upstream on the host's own loopback
    extra_env: dict[str, str] = field(default_factory=dict)  # this host's own settings

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs if p.exists())


class Cluster:
    """N hosts, one Redis, one coordinator namespace (see the module docstring)."""

    def __init__(self, folder: Path, hosts: int, extra_env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.tag = secrets.token_hex(3)
        self.password = uuid.uuid4().hex
        self.namespace = f"h-{self.tag}"
        self.extra_env = dict(extra_env or {})
        self.redis_ns = f"ovn{self.tag}r"
        self.coord_ns = f"ovn{self.tag}c"
        self.made: list[str] = []
        self.hosts: list[Host] = []
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.socket = folder / "redis.sock"
        self._client: redis.Redis | None = None
        self._client_socket = self.socket
        self._count = hosts
        self.servers: dict[int, Path] = {}  # port -> Unix socket, of every redis-server
        self.replica_procs: list[subprocess.Popen[bytes]] = []  # replicas and sentinels
        self.sentinel_sockets: list[Path] = []
        self.sentinel_password = ""
        self.redis_url: str | None = None  # every process's, when not the primary's own

    # --- building -------------------------------------------------------------------------

    def start(self) -> Cluster:
        self._netns(self.redis_ns)
        self._netns(self.coord_ns)
        self.coord_addr = self._link(0, self.coord_ns)[0]
        for i in range(1, self._count + 1):
            netns = f"ovn{self.tag}h{i}"
            self._netns(netns)
            addr, link = self._link(i, netns)
            self.hosts.append(Host(i - 1, netns, f"host-{i}-{self.tag}", addr, link))
        self._start_redis()
        return self

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _link(self, k: int, netns: str) -> tuple[str, str]:
        """A veth pair between the Redis namespace and ``netns`` on 10.231.k.0/24."""
        near, far = f"r{k}", "eth0"
        _ip(
            "-n",
            self.redis_ns,
            "link",
            "add",
            near,
            "type",
            "veth",
            "peer",
            "name",
            far,
            "netns",
            netns,
        )
        _ip("-n", self.redis_ns, "addr", "add", f"10.231.{k}.1/24", "dev", near)
        _ip("-n", netns, "addr", "add", f"10.231.{k}.2/24", "dev", far)
        _ip("-n", self.redis_ns, "link", "set", near, "up")
        _ip("-n", netns, "link", "set", far, "up")
        return f"10.231.{k}.1", near

    def service(self, name: str) -> tuple[str, str]:
        """A namespace of its own for a service every host and the coordinator reach (a
        git server): a bridge at 10.232.0.1/24 there, one veth to each of them; returns the
        namespace and the bridge's address."""
        netns = f"ovn{self.tag}{name[:1]}"
        self._netns(netns)
        _ip("-n", netns, "link", "add", "br0", "type", "bridge")
        _ip("-n", netns, "addr", "add", "10.232.0.1/24", "dev", "br0")
        _ip("-n", netns, "link", "set", "br0", "up")
        for k, other in enumerate([self.coord_ns, *(h.netns for h in self.hosts)], start=2):
            near = f"s{k}"
            _ip(
                "-n",
                netns,
                "link",
                "add",
                near,
                "type",
                "veth",
                "peer",
                "name",
                "svc0",
                "netns",
                other,
            )
            _ip("-n", netns, "link", "set", near, "master", "br0")
            _ip("-n", netns, "link", "set", near, "up")
            _ip("-n", other, "addr", "add", f"10.232.0.{k}/24", "dev", "svc0")
            _ip("-n", other, "link", "set", "svc0", "up")
        return netns, "10.232.0.1"

    def _start_redis(self) -> None:
        self.redis_proc = self._redis_server("redis", REDIS_PORT, self.socket, [])
        self.servers[REDIS_PORT] = self.socket

    def _redis_server(
        self, name: str, port: int, socket: Path, config: list[str], *, sentinel: bool = False
    ) -> subprocess.Popen[bytes]:
        """A redis-server (or a sentinel) in the Redis namespace on ``port`` (every address
        of it) and its Unix socket; ``config`` lines go in through stdin (or, for a sentinel,
        a file: it rewrites its own), so no password is in an argument list. Returns once
        it answers PING on its socket."""
        data = self.folder / name
        data.mkdir(parents=True, exist_ok=True)
        own = [
            f"port {port}",
            "bind 0.0.0.0",
            f"unixsocket {socket}",
            "unixsocketperm 700",
            f"dir {data}",
            f"logfile {data / 'redis.log'}",
            'save ""',
            "appendonly no",
            "daemonize no",
            *config,
        ]
        exe = ["ip", "netns", "exec", self.redis_ns, find_redis_server()]
        quiet = subprocess.DEVNULL
        if sentinel:
            conf = data / "sentinel.conf"
            conf.write_text("\n".join(own[:6] + config) + "\n")
            conf.chmod(0o600)
            argv, text = [*exe, str(conf), "--sentinel"], b""
        else:
            own.append(f"requirepass {self.password}")
            argv, text = [*exe, "-"], ("\n".join(own) + "\n").encode()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=quiet, stderr=quiet)
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(text)
        password = self.sentinel_password if sentinel else self.password
        deadline = time.monotonic() + 15
        while True:
            probe = redis.Redis(unix_socket_path=str(socket), password=password)
            with contextlib.suppress(redis.RedisError, OSError), probe:
                if probe.ping():
                    return proc
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start; see {data / 'redis.log'}")
            time.sleep(0.05)

    def start_sentinels(self, replicas: int = 2, sentinels: int = 3) -> str:
        """Replicas of the primary and sentinels watching it (quorum 2), all in the Redis
        namespace, each on a port and a Unix socket of its own, every one with a password.
        They name the primary (and, after a failover, a replica) by the Redis namespace's
        address on the coordinator's link, :data:`SHARED_ADDR`, to which every host is given
        a route. From now on every process of the cluster gets the ``redis+sentinel://`` URL
        (returned) and :attr:`client` follows the primary the sentinels name."""
        self.sentinel_password = uuid.uuid4().hex
        follow = [
            f"masterauth {self.password}",
            f"replicaof {SHARED_ADDR} {REDIS_PORT}",
            f"replica-announce-ip {SHARED_ADDR}",
        ]
        for i in range(1, replicas + 1):
            socket = self.folder / f"redis-{i}.sock"
            self.replica_procs.append(
                self._redis_server(f"redis-{i}", REDIS_PORT + i, socket, follow)
            )
            self.servers[REDIS_PORT + i] = socket
        for k, host in enumerate(self.hosts, start=1):
            _ip("-n", host.netns, "route", "add", f"{SHARED_ADDR}/32", "via", f"10.231.{k}.1")
        watch = [
            f"sentinel announce-ip {SHARED_ADDR}",
            f"sentinel monitor {SERVICE} {SHARED_ADDR} {REDIS_PORT} 2",
            f"sentinel auth-pass {SERVICE} {self.password}",
            f"sentinel down-after-milliseconds {SERVICE} 1000",
            f"sentinel failover-timeout {SERVICE} 10000",
            f"requirepass {self.sentinel_password}",
            f"sentinel sentinel-pass {self.sentinel_password}",
        ]
        ports = [SENTINEL_PORT + i for i in range(sentinels)]
        for port in ports:
            socket = self.folder / f"sentinel-{port}.sock"
            self.replica_procs.append(
                self._redis_server(f"sentinel-{port}", port, socket, watch, sentinel=True)
            )
            self.sentinel_sockets.append(socket)
        deadline = time.monotonic() + 60
        while not self._watching(replicas, sentinels):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinels never saw every server; see {self.folder}")
            time.sleep(0.1)
        watchers = ",".join(f"{SHARED_ADDR}:{p}" for p in ports)
        self.redis_url = (
            f"redis+sentinel://:{self.password}@{watchers}/{SERVICE}"
            f"?sentinel_password={self.sentinel_password}"
        )
        return self.redis_url

    def _watching(self, replicas: int, sentinels: int) -> bool:
        """Every sentinel knows the primary's replicas and the other sentinels, and every
        replica is in sync."""
        try:
            for socket in self.sentinel_sockets:
                with self._sentinel(socket) as s:
                    reps = s.execute_command("SENTINEL", "replicas", SERVICE)
                    others = s.execute_command("SENTINEL", "sentinels", SERVICE)
                if (len(reps), len(others)) != (replicas, sentinels - 1):
                    return False
            for port, socket in self.servers.items():
                if port == REDIS_PORT:
                    continue
                with redis.Redis(unix_socket_path=str(socket), password=self.password) as r:
                    if r.info("replication").get("master_link_status") != "up":
                        return False
        except (redis.RedisError, OSError):
            return False
        return True

    def _sentinel(self, socket: Path) -> redis.Redis:
        return redis.Redis(
            unix_socket_path=str(socket), password=self.sentinel_password, socket_timeout=2
        )

    def primary_port(self) -> int | None:
        """The port the sentinels name for the primary now: None while they disagree (or
        none answers)."""
        named = set()
        for socket in self.sentinel_sockets:
            try:
                with self._sentinel(socket) as s:
                    addr = s.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
            except (redis.RedisError, OSError):
                return None
            named.add(int(addr[1]) if addr else None)
        return named.pop() if len(named) == 1 else None

    def kill_primary(self) -> float:
        """SIGKILL the first primary (``ip netns exec`` execs redis-server: the same pid);
        returns when (wall clock)."""
        assert self.redis_proc is not None
        at = time.time()
        self.redis_proc.kill()
        self.redis_proc.wait(5)
        return at

    # --- reaching things ----------------------------------------------------------------------

    @property
    def client(self) -> redis.Redis:
        """The test's own text client (through the primary's Unix socket; with sentinels,
        the primary they name: after a failover, the promoted replica's)."""
        socket = self.socket
        if self.sentinel_sockets:
            socket = self.servers.get(self.primary_port() or REDIS_PORT, self.socket)
        if self._client is None or self._client_socket != socket:
            if self._client is not None:
                self._client.close()
            self._client = redis.Redis(
                unix_socket_path=str(socket), password=self.password, decode_responses=True
            )
            self._client_socket = socket
        return self._client

    def url(self, addr: str) -> str:
        return f"redis://:{self.password}@{addr}:{REDIS_PORT}/0"

    def env(self, host: Host | None = None, **extra: str) -> dict[str, str]:
        """The environment of a host's processes (or of the coordinator's, for None)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_")}
        env.pop("MODEL_URL", None)
        env.update(FAST)
        env.update(self.extra_env)
        env["OVERNIGHT_NAMESPACE"] = self.namespace
        env["OVERNIGHT_QUEUE"] = self.namespace
        addr = host.redis_addr if host is not None else self.coord_addr
        env["OVERNIGHT_REDIS_URL"] = self.redis_url or self.url(addr)
        env["OVERNIGHT_HOST_ID"] = host.host_id if host is not None else f"coord-{self.tag}"
        if host is not None and host.model_url:
            env["OVERNIGHT_MODEL_URL"] = host.model_url
        if host is not None:
            env.update(host.extra_env)
        env.update(extra)
        return env

    def _in(self, netns: str, name: str, argv: list[str]) -> list[str]:
        """``argv`` run in ``netns`` with the host name ``name`` (its own UTS namespace) and
        the host's own gateway folder (a private mount namespace binds it over the machine's):
        a gateway's socket belongs with its loopback port, and hosts that shared one would
        find another host's gateway answering it while nothing listens on their own port."""
        own = self.folder / "hosts" / name / "gateway"
        own.mkdir(parents=True, exist_ok=True)
        own.chmod(0o755)  # as overnight makes it: its user's own, open to steps
        shared = gateway_folder()
        shared.mkdir(mode=0o755, exist_ok=True)  # the mount point
        return [
            "ip",
            "netns",
            "exec",
            netns,
            "unshare",
            "--uts",
            "--mount",
            "--",
            "sh",
            "-c",
            'hostname "$0" && mount --bind "$1" "$2" && shift 2 && exec "$@"',
            name,
            str(own),
            str(shared),
            *argv,
        ]

    def coordinator(self, *args: str, timeout: float = 40) -> subprocess.CompletedProcess[str]:
        """``overnight ARGS`` in the coordinator's namespace."""
        argv = self._in(self.coord_ns, f"coord-{self.tag}", [OVERNIGHT, *args])
        return subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )

    def start_upstream(self, host: Host) -> str:
        """tests/scripted_upstream.py on the host's own loopback; the host's gateway (one per
        host, started by its first worker) forwards model requests to it."""
        script = Path(__file__).with_name("scripted_upstream.py")
        argv = self._in(host.netns, host.host_id, [sys.executable, str(script)])
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        proc.stdout.close()
        host.procs.append(proc)
        host.model_url = f"http://127.0.0.1:{line.split()[1]}"
        return host.model_url

    def upstream_requests(self, host: Host) -> list[str]:
        """The path of every request the host's scripted upstream got (asked from inside the
        host's namespace: its loopback is the host's own)."""
        assert host.model_url is not None
        code = (
            "import json, sys, urllib.request\n"
            "with urllib.request.urlopen(sys.argv[1] + '/_seen', timeout=10) as answer:\n"
            "    print(json.dumps([s['path'] for s in json.load(answer)]))"
        )
        argv = ["ip", "netns", "exec", host.netns, sys.executable, "-c", code, host.model_url]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
        paths: list[str] = json.loads(done.stdout)
        return paths

    def start_worker(self, host: Host, *, reaper: bool) -> subprocess.Popen[bytes]:
        """``overnight worker [--with-reaper]`` on ``host``, its output in a log file."""
        argv = [OVERNIGHT, "worker", *(["--with-reaper"] if reaper else [])]
        log = self.folder / f"{host.host_id}-{len(host.procs)}.log"
        out: IO[bytes] = log.open("wb")
        with out:
            proc = subprocess.Popen(
                self._in(host.netns, host.host_id, argv),
                env=self.env(host),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        host.procs.append(proc)
        host.logs.append(log)
        return proc

    def idle_workers(self, host: Host) -> int:
        """How many RQ workers of ``host`` wait for work, as RQ's own registry says."""
        from rq import Queue, Worker

        self.client.ping()  # the primary's socket, as of now
        with redis.Redis(unix_socket_path=str(self._client_socket), password=self.password) as raw:
            found = Worker.all(queue=Queue(self.namespace, connection=raw))
            return sum(w.hostname == host.host_id and w.get_state() == "idle" for w in found)

    def reaper_up(self, host: Host) -> bool:
        """True while the host's reaper heartbeat is in Redis."""
        return bool(self.client.exists(Keys(self.namespace).reaper_host(host.host_id)))

    # --- faults -------------------------------------------------------------------------------

    def pids(self, netns: str) -> list[int]:
        """Every process of ``netns``."""
        out = _ip("netns", "pids", netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: Host) -> float:
        """SIGKILL every process of the host's namespace at once; returns when (wall clock)."""
        at = time.time()
        for _ in range(50):
            pids = self.pids(host.netns)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        for proc in host.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        return at

    def cut(self, host: Host) -> float:
        """Take the host's link down (its processes live on); returns when."""
        _ip("-n", self.redis_ns, "link", "set", host.link, "down")
        return time.time()

    def join(self, host: Host) -> float:
        """Bring the host's link back up; returns when."""
        _ip("-n", self.redis_ns, "link", "set", host.link, "up")
        return time.time()

    # --- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        """End every process of every namespace made here and delete the namespaces."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        for netns in self.made:
            for _ in range(50):
                pids = self.pids(netns)
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.02)
        procs = [p for h in self.hosts for p in h.procs]
        procs += [self.redis_proc] if self.redis_proc is not None else []
        procs += self.replica_procs
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(5)
        for netns in self.made:
            _ip("netns", "del", netns, check=False)
        self.made.clear()


@contextlib.contextmanager
def cluster(folder: Path, hosts: int, extra_env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """A started :class:`Cluster` of ``hosts`` hosts, closed on the way out in every case."""
    made = Cluster(folder, hosts, extra_env)
    try:
        yield made.start()
    finally:
        made.close()


# --- what the agents leave: a trace of every run ----------------------------------------

AGENT = """\
import os, socket, sys, time, uuid
trace, task, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
run, host, end = uuid.uuid4().hex[:12], socket.gethostname(), time.time() + secs
while True:
    now = time.time()
    with open(trace, "a") as fh:
        fh.write(f"{task} {host} {run} {os.getpid()} {now:.3f}\\n")
    print(run, now, flush=True)  # a beat, never the same output twice
    if now >= end:
        break
    time.sleep(0.05)
open("ok.txt", "w").close()
"""


# The same, but its work is model requests through its host's gateway (the step's
# environment names it): N requests a run; a refused one (429: the envelope is spent) ends
# the run's requests.
GATEWAY_AGENT = """\
import json, os, socket, sys, time, uuid, urllib.request, urllib.error
trace, task, times = sys.argv[1], sys.argv[2], int(sys.argv[3])
run, host = uuid.uuid4().hex[:12], socket.gethostname()
def mark():
    with open(trace, "a") as fh:
        fh.write(f"{task} {host} {run} {os.getpid()} {time.time():.3f}\\n")
mark()
for _ in range(times):
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": []}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30).read()
    except urllib.error.HTTPError:
        break
    print(run, time.time(), flush=True)
    mark()
"""


@dataclass(frozen=True)
class Run:
    """One run of one task's agent, as its trace lines show it."""

    task: str
    host: str
    run: str
    pid: int
    start: float
    end: float


def write_agent(folder: Path, gateway: bool = False) -> Path:
    path = folder / ("gateway_agent.py" if gateway else "agent.py")
    path.write_text(GATEWAY_AGENT if gateway else AGENT)
    return path


def runs(trace: Path) -> list[Run]:
    """Every run the trace shows (first and last line of each)."""
    seen: dict[str, list[Any]] = {}
    if not trace.exists():
        return []
    for line in trace.read_text().splitlines():
        parts = line.split()
        if len(parts) != 5:
            continue
        task, host, run, pid, at = parts
        t = float(at)
        if run in seen:
            seen[run][5] = max(seen[run][5], t)
            seen[run][4] = min(seen[run][4], t)
        else:
            seen[run] = [task, host, run, int(pid), t, t]
    return [Run(*row) for row in seen.values()]


def overlaps(all_runs: list[Run]) -> list[tuple[Run, Run]]:
    """Pairs of runs of one task that were alive at the same time."""
    found = []
    by_task: dict[str, list[Run]] = {}
    for r in all_runs:
        by_task.setdefault(r.task, []).append(r)
    for task_runs in by_task.values():
        task_runs.sort(key=lambda r: r.start)
        latest: Run | None = None  # of the runs so far, the one alive longest
        for r in task_runs:
            if latest is not None and r.start <= latest.end:
                found.append((latest, r))
            if latest is None or r.end > latest.end:
                latest = r
    return found
