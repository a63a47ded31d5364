"""The contract's exit codes, and the exception commands raise to end with one of them."""

from __future__ import annotations

from overnight.config.errors import OvernightError

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_REFUSED = 2  # refused, or a lease that ran past its deadline
EXIT_HEARTBEAT_GAP = 3
EXIT_LEASE_LOST = 4
# A night's end (`up --exit-when-done`, `--until`, the coordinator's): not every task of it
# finished verified. 5: one needs a person (ended otherwise, or paused); 6: none does, but
# some did not end before the stop time (they resume from their checkpoints next night).
EXIT_NEEDS_PERSON = 5
EXIT_UNFINISHED = 6
EXIT_USAGE = 64
EXIT_REDIS_DOWN = 69
EXIT_BAD_CONFIG = 78


class CommandError(OvernightError):
    """End the command with ``exit_code`` after printing ``message`` (one line) to stderr."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
