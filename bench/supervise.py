"""Supervisor benchmark: how fast a silent child is killed, and what a supervisor costs.

``.venv/bin/python -m bench.supervise`` starts its own private redis-server. Targets: p95
of (kill time - last beat) <= gap + 0.1 s over 20 runs at gap 1 s; median wall of
``overnight supervise --quiet -- true`` <= 0.35 s, and in the sandbox
(``OVERNIGHT_SANDBOX=bwrap``) within 1.3x of the same without it (``off``), measured in
the same run, alternating; supervisor peak RSS <= 40 MB. As root, both root steps
(``OVERNIGHT_ALLOW_ROOT_STEPS=1``) and the step user (``OVERNIGHT_STEP_USER``, default
``overnight-step`` where it exists) are measured; the silent-child runs use the caller's
own ``OVERNIGHT_STEP_USER`` or ``OVERNIGHT_ALLOW_ROOT_STEPS`` (root steps by default), and
no sandbox.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from overnight.coordinator.night.embedded_redis import EmbeddedRedis

WALL = 0.35  # seconds: the median of `supervise --quiet -- true`
SANDBOX_RATIO = 1.3  # the sandbox's median within this of the same run without it
# Who steps run as (contract §1): kept from the caller's environment.
STEP_VARS = ("OVERNIGHT_STEP_USER", "OVERNIGHT_ALLOW_ROOT_STEPS")


OVERNIGHT = str(Path(sys.executable).with_name("overnight"))
# Beats once (its first output line, its time noted just before), then stays silent; notes
# when SIGTERM arrives. The child's own clock: the lease's heartbeat_unix is its last renewal,
# which may trail the last progress (up to gap/3).
SILENT = """
import signal, sys, time
def term(*_):
    open(sys.argv[1], "w").write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(sys.argv[2], "w").write(repr(time.time()))
print("started", flush=True)
while True:
    time.sleep(10)
"""


def _spawn(argv: list[str], env: dict[str, str], stdout: int) -> tuple[float, int, float]:
    """Run ``argv`` to completion: (wall seconds, exit code, peak RSS in MB of it and its
    waited-for descendants)."""
    t = time.perf_counter()
    devnull = os.open(os.devnull, os.O_RDWR)
    pid = os.posix_spawn(
        argv[0],
        argv,
        env,
        file_actions=[
            (os.POSIX_SPAWN_DUP2, devnull, 0),
            (os.POSIX_SPAWN_DUP2, stdout, 1),
            (os.POSIX_SPAWN_DUP2, devnull, 2),
        ],
    )
    os.close(devnull)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t
    return wall, os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024


def detection(env: dict[str, str], runs: int, gap: float, work: Path) -> list[float]:
    """Seconds from the child's last beat (its one output line) to SIGTERM reaching it."""
    script = work / "silent.py"
    script.write_text(SILENT)
    out: list[float] = []
    for i in range(runs):
        marker, beat = work / f"term-{i}", work / f"beat-{i}"
        doc_path = work / f"doc-{i}.json"
        fd = os.open(doc_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        argv = [
            OVERNIGHT,
            "supervise",
            "--gap",
            str(gap),
            "--grace",
            "1",
            "--",
            sys.executable,
            str(script),
            str(marker),
            str(beat),
        ]
        _wall, code, _rss = _spawn(argv, env, fd)
        os.close(fd)
        text = doc_path.read_text()
        doc = json.loads(text[text.rfind('{\n  "lease_id"') :])
        if code != 3 or not marker.exists():
            raise SystemExit(f"run {i}: exit {code}, note {doc.get('note')}")
        out.append(float(marker.read_text()) - float(beat.read_text()))
    return out


def modes(env: dict[str, str]) -> dict[str, dict[str, str]]:
    """Who steps run as, by label: the environment of each (root steps and the step user
    as root; this user otherwise)."""
    if os.geteuid() != 0:
        return {"self": env}
    from overnight.worker.sandbox.stepuser import lookup

    plain = {k: v for k, v in env.items() if k not in STEP_VARS}
    found = {"root": {**plain, "OVERNIGHT_ALLOW_ROOT_STEPS": "1"}}
    user = env.get("OVERNIGHT_STEP_USER") or "overnight-step"
    if lookup(user) is not None:
        found["step user"] = {**plain, "OVERNIGHT_STEP_USER": user}
    return found


def overhead(
    envs: dict[str, dict[str, str]], runs: int
) -> tuple[dict[tuple[str, str], list[float]], list[float], list[float]]:
    """Wall seconds of supervised ``true`` per (who, sandbox), alternating; of bare
    ``true``; the supervisor's peak RSS (MB)."""
    true = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"
    sup: dict[tuple[str, str], list[float]] = {}
    bare: list[float] = []
    rss: list[float] = []
    devnull = os.open(os.devnull, os.O_WRONLY)
    for _ in range(runs):
        for who, env in envs.items():
            for sandbox in ("off", "bwrap"):
                argv = [OVERNIGHT, "supervise", "--quiet", "--", true]
                wall, code, peak = _spawn(argv, {**env, "OVERNIGHT_SANDBOX": sandbox}, devnull)
                if code != 0:
                    raise SystemExit(f"supervise true ({who}, sandbox {sandbox}): exit {code}")
                sup.setdefault((who, sandbox), []).append(wall)
                rss.append(peak)
        bare.append(_spawn([true], env, devnull)[0])
    os.close(devnull)
    return sup, bare, rss


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.supervise", description=__doc__)
    parser.add_argument("--runs", type=int, default=20, help="runs per figure [20]")
    parser.add_argument("--gap", type=float, default=1.0, help="heartbeat gap [1.0]")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-supervise-") as tmp:
        work = Path(tmp) / "work"  # the steps' folder (and, sandboxed, their worktree)
        work.mkdir(mode=0o777)
        work.chmod(0o1777)
        os.chmod(tmp, 0o755)
        server = EmbeddedRedis(Path(tmp) / "redis", password=uuid.uuid4().hex)
        server.start()
        here = os.getcwd()
        try:
            os.chdir(work)
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith("OVERNIGHT_") or k in STEP_VARS
            }
            env.update(OVERNIGHT_REDIS_URL=server.url, OVERNIGHT_NAMESPACE="bench-supervise")
            sup, bare, rss = overhead(modes(env), args.runs)
            if os.geteuid() == 0 and not any(k in env for k in STEP_VARS):
                env["OVERNIGHT_ALLOW_ROOT_STEPS"] = "1"
            # Without the sandbox: in it, its pid 1 dies of the SIGTERM too and the kernel
            # SIGKILLs the child before it can note the time the SIGTERM came.
            det = detection({**env, "OVERNIGHT_SANDBOX": "off"}, args.runs, args.gap, work)
        finally:
            os.chdir(here)
            server.stop()
    target = args.gap + 0.1  # kill latency within gap + 0.1 s
    p95 = _pct(det, 0.95)
    peak = max(rss)
    print(f"detection over {len(det)} runs at gap {args.gap:g}s, sandbox off (kill - last beat):")
    print(
        f"  p50 {_pct(det, 0.5):.3f}s  p95 {p95:.3f}s  max {max(det):.3f}s  "
        f"target p95 <= {target:.1f}s  {'PASS' if p95 <= target else 'MISS'}"
    )
    print(
        f"overhead of `overnight supervise --quiet -- true`, {args.runs} runs each, "
        f"alternating (bare true {statistics.median(bare) * 1000:.1f}ms):"
    )
    for who in dict.fromkeys(w for w, _ in sup):
        off, box = statistics.median(sup[(who, "off")]), statistics.median(sup[(who, "bwrap")])
        ratio = box / off
        fine = off <= WALL and box <= WALL and ratio <= SANDBOX_RATIO
        print(
            f"  {who}: sandbox off median {off:.3f}s, bwrap {box:.3f}s: {ratio:.2f}x  "
            f"target <= {WALL:.2f}s and <= {SANDBOX_RATIO:.1f}x  {'PASS' if fine else 'MISS'}"
        )
    print(
        f"  supervisor peak RSS {peak:.1f} MB (median {statistics.median(rss):.1f} MB)  "
        f"target <= 40 MB  {'PASS' if peak <= 40 else 'MISS'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
