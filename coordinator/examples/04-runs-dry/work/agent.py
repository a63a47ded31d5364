"""Works slowly and never gets there: the task ends only when the shared envelope is empty."""

import time
from pathlib import Path

counter = Path(".agent-turns")
turn = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(turn))

for step in range(4):
    print(f"attempt {turn}: thinking ({step + 1}/4)...", flush=True)
    time.sleep(0.5)
with Path("proof.txt").open("a") as fh:
    fh.write(f"attempt {turn}, not yet convincing\n")
print(f"attempt {turn} written")
