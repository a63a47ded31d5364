"""What a step runs inside: its user, its environment, its cgroup."""
