"""Works slowly and never gets there: the task ends only when the shared envelope is empty."""

import time
from pathlib import Path

for step in range(4):
    print(f"thinking ({step + 1}/4)...", flush=True)
    time.sleep(0.5)
with Path("proof.txt").open("a") as fh:
    fh.write("an attempt, not yet convincing\n")
print("another attempt written")
