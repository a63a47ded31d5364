"""``OVERNIGHT_NOTIFY_URL``: a small JSON summary POSTed when the night ends and when a task
pauses for a person. A failed POST is logged and retried a few times from a thread; it
never stops or slows the night.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from overnight.coordinator.report.model import Report, needs_person

log = logging.getLogger("overnight.notify")
ATTEMPTS = 4
TIMEOUT_SEC = 5.0
BACKOFF_SEC = 1.0


def night_summary(report: Report, reason: str, path: Path | None) -> dict[str, Any]:
    """The end-of-night payload (docs/running.md: "The notification")."""
    return {
        "event": "night_ended",
        "reason": reason,
        "namespace": report.namespace,
        "started_unix": round(report.start, 3),
        "ended_unix": round(report.end, 3),
        "wall_sec": round(report.wall_sec, 3),
        "tasks": sum(report.counts.values()),
        "counts": dict(sorted(report.counts.items())),
        "needs_person": needs_person(report),
        "envelopes": [
            {
                "name": e.name,
                "budget": e.budget,
                "remaining": e.remaining,
                "consumed_model": e.consumed_model,
                "consumed_tool": e.consumed_tool,
                "consumed_tokens": e.consumed_tokens,
            }
            for e in report.envelopes
            if e.exists
        ],
        "report": str(path) if path is not None else None,
    }


def pause_summary(namespace: str, task_id: str, detail: str, path: Path | None) -> dict[str, Any]:
    """The payload sent when a task pauses for a person."""
    return {
        "event": "task_paused",
        "namespace": namespace,
        "task": task_id,
        "detail": detail,
        "report": str(path) if path is not None else None,
    }


def post(
    url: str, payload: dict[str, Any], attempts: int = ATTEMPTS, backoff: float = BACKOFF_SEC
) -> bool:
    """POST ``payload`` as JSON; retries with a growing pause; True once a 2xx came back."""
    body = json.dumps(payload).encode()
    for attempt in range(1, attempts + 1):
        request = urllib.request.Request(
            url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "overnight"},
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_SEC) as resp:
                if 200 <= resp.status < 300:
                    return True
                why = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            why = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        log.warning(
            "notify %s (%s): attempt %d of %d failed: %s",
            payload.get("event"),
            url,
            attempt,
            attempts,
            why,
        )
        if attempt < attempts:
            time.sleep(backoff * attempt)
    return False


def send(url: str | None, payload: dict[str, Any]) -> threading.Thread | None:
    """POST from a daemon thread (join it to wait); None when no URL is set."""
    if not url:
        return None
    thread = threading.Thread(target=post, args=(url, payload), name="notify", daemon=True)
    thread.start()
    return thread
