"""Does the assignment at once."""

from pathlib import Path

Path("greeting.txt").write_text("hello\n")
print("wrote greeting.txt")
