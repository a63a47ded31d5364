"""Leases: the Redis document and liveness key, its file mirror, and the supervisor's local proof
of the process it started.
"""
