"""A night on one machine: ``up``, its processes, the embedded Redis, the demo, the coordinator's
work, the end.
"""
