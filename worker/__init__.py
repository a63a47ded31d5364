"""What runs beside every step on a host: the lease, the supervisor, the reaper, the envelope."""
