"""``python -m bench.tasks`` runs its three shapes end to end (a small run: the figures
themselves belong to the benchmark, not to a test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from overnight.worker.sandbox import launch
from tests.helpers import capability

ROOT = Path(__file__).resolve().parents[2]
pytestmark = capability(None if launch.find_bwrap() else "bubblewrap is not installed")


def test_the_three_shapes_run_and_are_compared() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "bench.tasks", "--tasks", "3", "--workers", "1", "--rounds", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ratio = re.search(r"^overhead ratio\s*:\s+([\d.]+)x .* (PASS|MISS)$", out.stdout, re.M)
    assert ratio is not None, out.stdout + out.stderr
    met = float(ratio.group(1)) <= 1.5
    assert ratio.group(2) == ("PASS" if met else "MISS")
    assert out.returncode == (0 if met else 1), out.stdout + out.stderr  # make bench's verdict
    rates = dict(
        re.findall(
            r"^(plain RQ|sandboxed RQ|overnight) \w+\s*:\s+([\d.]+) tasks/s", out.stdout, re.M
        )
    )
    assert set(rates) == {"plain RQ", "sandboxed RQ", "overnight"}, out.stdout
    assert all(float(rate) > 0 for rate in rates.values())
    assert "over sandboxed RQ" in out.stdout and "sandboxed / plain" in out.stdout
