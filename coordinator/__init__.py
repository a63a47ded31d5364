"""The control plane: the CLI, task dispatch on RQ, the task loop and the coordinator process."""
