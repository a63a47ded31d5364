"""Defaults of the settings that are also read without the settings model.

``Settings`` declares every default; those below are the ones a module also needs where it
cannot load pydantic (the supervise path, a lease store at import, a model step reading its
own stdin), so each is written here once and both read it. Any other default lives only in
``Settings``.
"""

from __future__ import annotations

REDIS_URL = "redis://127.0.0.1:6379/0"
NAMESPACE = "overnight"
HEARTBEAT_GAP = 30.0
DEADLINE = 180.0
GRACE = 5.0
# A running task's claim, renewed while its worker lives; lost steps before a task pauses.
TASK_CLAIM_TTL = 15.0
MAX_LOST_LEASES = 3
SANDBOX = "bwrap"
# The uids a task's steps may run as when overnight is root without a step user (one uid per
# live task on a host); systemd's range for dynamic users.
STEP_UIDS = "61184-65519"
MODEL_NAME = "gpt-4o-mini"
MODEL_TIMEOUT = 60.0
# How long an envelope remembers a request id (a day).
REQUEST_ID_TTL = 86_400
# How long an ended task's record, its receipts and ended lease documents are kept (a week).
RETENTION = 604_800
REAPER_HOST_TTL = 30.0
# A step's limits (0: none): processes in its tree, memory (bytes, the tree's resident set;
# each process's data segment), open files per process, CPU seconds per process, and
# bytes written into its worktree, HOME and tmp folders.
STEP_PIDS = 512
STEP_MEMORY = 4 * 1024**3
STEP_OPEN_FILES = 4096
STEP_CPU = 3600
STEP_DISK = 2 * 1024**3
