"""Every Redis key overnight writes, in one place.

All keys of a namespace share the hash tag ``{namespace}`` so they live in one cluster
slot and every Lua script stays cluster-safe. Scripts receive keys only through KEYS;
nothing builds a key name inside Lua. RQ's own ``rq:*`` keys are RQ's business.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key names for one namespace."""

    namespace: str

    @property
    def prefix(self) -> str:
        return "{" + self.namespace + "}"

    # --- leases -------------------------------------------------------------------
    def lease(self, lease_id: str) -> str:
        """Hash: the lease document."""
        return f"{self.prefix}:lease:{lease_id}"

    def lease_alive(self, lease_id: str) -> str:
        """String with a TTL: exists exactly while the lease is live (beat gap and deadline)."""
        return f"{self.prefix}:lease:{lease_id}:alive"

    @property
    def lease_seq(self) -> str:
        """String: the last fencing token handed out in this namespace."""
        return f"{self.prefix}:lease-seq"

    @property
    def lease_expiry(self) -> str:
        """Sorted set: running lease id -> when its liveness key lapses (server ms)."""
        return f"{self.prefix}:lease-expiry"

    @property
    def leases(self) -> str:
        """Sorted set: every lease id -> started (server ms), for listing."""
        return f"{self.prefix}:leases"

    # --- reaper ---------------------------------------------------------------------
    def reaper_host(self, host: str) -> str:
        """String with a TTL: a live reaper runs on ``host``."""
        return f"{self.prefix}:reaper:{host}"

    # --- receipts ---------------------------------------------------------------------
    @property
    def receipts(self) -> str:
        """Stream: typed receipts of every lease ending, refusal, verdict and state change."""
        return f"{self.prefix}:receipts"

    # --- envelope ---------------------------------------------------------------------
    def envelope(self, name: str) -> str:
        """Hash: remaining, consumed counters and caps of one shared envelope."""
        return f"{self.prefix}:envelope:{name}"

    def envelope_request(self, name: str, request_id: str) -> str:
        """String with a TTL: the first answer given to ``request_id``."""
        return f"{self.prefix}:envelope:{name}:req:{request_id}"

    def envelope_reservations(self, name: str) -> str:
        """Sorted set: open reservation id -> expiry (server ms)."""
        return f"{self.prefix}:envelope:{name}:reservations"

    def envelope_reservation(self, name: str, reservation_id: str) -> str:
        """Hash: one open reservation (kind, units)."""
        return f"{self.prefix}:envelope:{name}:rsv:{reservation_id}"

    # --- tasks ------------------------------------------------------------------------
    def task(self, task_id: str) -> str:
        """Hash: one task's spec and checkpointed loop state."""
        return f"{self.prefix}:task:{task_id}"

    @property
    def tasks(self) -> str:
        """Sorted set: task id -> submitted (unix seconds)."""
        return f"{self.prefix}:tasks"

    def task_claim(self, task_id: str) -> str:
        """String with a TTL: the token of the worker running the task; lapses if it dies."""
        return f"{self.prefix}:task:{task_id}:claim"

    def task_charged(self, task_id: str) -> str:
        """Set: request ids already charged to the task's own ``max_calls`` (idempotence)."""
        return f"{self.prefix}:task:{task_id}:charged"

    @property
    def task_claims(self) -> str:
        """Sorted set: running task id -> when its claim lapses unless renewed (server ms);
        the recovery index of running tasks (a score of 0: its claim was dropped)."""
        return f"{self.prefix}:task-claims"

    @property
    def task_queued(self) -> str:
        """Sorted set: queued task id -> when recovery next checks that its RQ job is
        there (server seconds): queued-since plus the grace, pushed on by each check."""
        return f"{self.prefix}:task-queued"

    @property
    def tasks_ended(self) -> str:
        """Sorted set: ended task id -> when it ended (server seconds); the retention index
        that lets an expired record leave ``tasks`` too."""
        return f"{self.prefix}:tasks-ended"

    @property
    def recovery_leader(self) -> str:
        """String with a TTL: the token of the one process that runs recovery passes."""
        return f"{self.prefix}:recovery-leader"

    # --- gateway ----------------------------------------------------------------------
    def gateway_token(self, digest: str) -> str:
        """String with a TTL: the lease id a gateway token (known only by its SHA-256
        ``digest``) stands for; deleted when the lease ends."""
        return f"{self.prefix}:gateway:token:{digest}"

    def lease_grant(self, lease_id: str) -> str:
        """Hash with a TTL: what a lease may spend through the gateway (task, envelope, caps,
        the prepaid floor unit), and what only the gateway writes: its progress and refusal."""
        return f"{self.prefix}:lease:{lease_id}:grant"

    # --- coordination -------------------------------------------------------------------
    @property
    def sandbox_modes(self) -> str:
        """Hash: host id -> how the steps of its latest started worker are contained
        (``bwrap`` or ``off``), for status and the report."""
        return f"{self.prefix}:sandbox"

    def instance(self, role: str) -> str:
        """String with a TTL: a running ``overnight up``/coordinator of this namespace."""
        return f"{self.prefix}:instance:{role}"
