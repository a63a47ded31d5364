"""Hangs without a sound on its first turn (the lease's heartbeat gap ends it), then works."""

import time
from pathlib import Path

counter = Path(".agent-turns")
turn = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(turn))

if turn == 1:
    print("waiting for a tool that never answers...", flush=True)
    time.sleep(3600)
Path("done.txt").write_text("ok\n")
print("wrote done.txt")
