"""Benchmark: how long after ``up --until`` a night with a hung step ends.

``python -m bench.stop [--rounds 3] [--grace 1]`` starts a private redis-server and, each
round, runs ``overnight up --until <now + lead>`` on one task whose agent hangs (``sleep``,
no output, a long heartbeat gap). It prints, per round, when the hung step's lease ended
and when ``up`` exited, both after the stop time. Target: the step ends within
grace + 2 s of the stop.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.redisio import receipts

BIN = Path(sys.executable).parent
STEP_VARS = ("OVERNIGHT_STEP_USER", "OVERNIGHT_ALLOW_ROOT_STEPS")
TASK = """id = "hung"
assignment = "Never finish."
workdir = "work"
agent = ["sh", "-c", "echo started; sleep 600"]
max_calls = 4
heartbeat_gap = 300
lease_seconds = 900
deadline = 3600

[[verifier]]
name = "never"
run = ["false"]
"""


def one_round(url: str, grace: float, lead: float, folder: Path) -> tuple[float, float]:
    namespace = f"bench-stop-{uuid.uuid4().hex[:8]}"
    tasks = folder / namespace
    (tasks / "work").mkdir(parents=True)
    (tasks / "work").chmod(0o777)
    (tasks / "hung.toml").write_text(TASK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_") or k in STEP_VARS}
    if os.geteuid() == 0 and not any(k in env for k in STEP_VARS):
        env["OVERNIGHT_ALLOW_ROOT_STEPS"] = "1"
    env.update(
        {
            "OVERNIGHT_REDIS_URL": url,
            "OVERNIGHT_NAMESPACE": namespace,
            "OVERNIGHT_GRACE": str(grace),
        }
    )
    stop_at = datetime.now().astimezone() + timedelta(seconds=lead)
    done = subprocess.run(
        [
            str(BIN / "overnight"),
            "up",
            "--tasks",
            str(tasks),
            "--budget",
            "10",
            "--workers",
            "1",
            "--until",
            stop_at.isoformat(),
            "--state-dir",
            str(folder / f"{namespace}-state"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=lead + 120,
    )
    exited = time.time()
    if done.returncode != 0:
        raise SystemExit(f"up exited {done.returncode}: {done.stderr}")
    client = redis.Redis.from_url(url, decode_responses=True)
    seen = receipts.read(client, Keys(namespace), task_id="hung")
    step = next(rc for rc in seen if rc.kind == "step_finished" and rc.data.get("stopped"))
    ended = next(
        rc
        for rc in seen
        if rc.lease_id == step.lease_id and rc.kind in ("lease_ended", "subprocess_lease_expired")
    )
    client.close()
    return ended.ts - stop_at.timestamp(), exited - stop_at.timestamp()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grace", type=float, default=1.0)
    parser.add_argument("--lead", type=float, default=15.0, help="seconds from launch to stop")
    args = parser.parse_args()
    worst = 0.0
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(Path(tmp) / "redis", password=uuid.uuid4().hex) as server,
    ):
        Path(tmp).chmod(0o755)
        for i in range(args.rounds):
            step_end, up_exit = one_round(server.url, args.grace, args.lead, Path(tmp))
            worst = max(worst, step_end)
            print(
                f"round {i + 1}: hung step ended {step_end:.2f} s after the stop "
                f"(grace {args.grace:g} s); up exited {up_exit:.2f} s after it",
                flush=True,
            )
    target = args.grace + 2.0
    print(
        f"worst: {worst:.2f} s after the stop; target <= grace + 2 s = {target:.2f} s: "
        f"{'met' if worst <= target else 'MISSED'}"
    )
    return 0 if worst <= target else 1


if __name__ == "__main__":
    sys.exit(main())
