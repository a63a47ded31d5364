"""Run every benchmark in turn (``make bench``); each prints its own figures and ratios."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

BENCHES = ("supervise", "envelope", "reaper", "tasks", "soak", "stop")


def main() -> int:
    failed = []
    for name in BENCHES:
        module = f"bench.{name}"
        if importlib.util.find_spec(module) is None:
            print(f"== {module}: not present, skipped", flush=True)
            continue
        print(f"== {module}", flush=True)
        if subprocess.run([sys.executable, "-m", module], check=False).returncode != 0:
            failed.append(name)
    if failed:
        print(f"benchmarks that missed a target or failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
