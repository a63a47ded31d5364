"""What the morning reads: status, the report model and its HTML, logs, metrics, notifications,
progress.
"""
