"""Beats from inside a step: the channel to the supervisor, and the ``beat``/``pulse`` helpers."""
