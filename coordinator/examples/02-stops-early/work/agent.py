"""Behaves like an agent left alone: stops early once, then acts on the unmet rule it is shown."""

import sys
from pathlib import Path

prompt = sys.argv[1] if len(sys.argv) > 1 else ""
counter = Path(".agent-turns")
turn = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(turn))

if turn == 1:
    print("I have a plan: look at calc.add and correct the operator.")
    print("Shall I continue?")
elif "add-works" in prompt:
    print("The prompt says rule add-works is unmet; fixing calc.add.")
    Path("calc.py").write_text("def add(a: int, b: int) -> int:\n    return a + b\n")
else:
    print("Nothing in the prompt tells me what is unmet.")
