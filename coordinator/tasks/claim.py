"""The hold of a running task: its claim, renewed while the loop runs, and the server clock
its deadlines run on."""

from __future__ import annotations

import logging
import threading
import time

import redis

from overnight.coordinator.tasks.store import TaskRefused, TaskStore

log = logging.getLogger("overnight.loop")


class ClaimKeeper(threading.Thread):
    """Renews a task claim every third of its TTL; sets ``lost`` when it cannot."""

    def __init__(self, store: TaskStore, task_id: str, token: str, ttl: float) -> None:
        super().__init__(name=f"claim-{task_id}", daemon=True)
        self.store, self.task_id, self.token, self.ttl = store, task_id, token, ttl
        self.lost = threading.Event()
        self._halt = threading.Event()

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self._halt.wait(self.ttl / 3):
            try:
                self.store.renew(self.task_id, self.token, self.ttl)
                last_ok = time.monotonic()
            except TaskRefused:
                self.lost.set()
                return
            except redis.RedisError as exc:  # Redis away: the claim lapses on the server too
                if time.monotonic() - last_ok > self.ttl:
                    log.warning("task %s: claim lost: %s", self.task_id, exc)
                    self.lost.set()
                    return

    def stop(self) -> None:
        self._halt.set()


class ServerClock:
    """Redis server time without a round trip of its own: the server time the last write
    replied with, plus the monotonic time since. Task deadlines run on it, as lease
    deadlines run on the server's clock; no worker's wall clock decides one."""

    def __init__(self, server_now: float) -> None:
        self.set(server_now)

    def set(self, server_now: float) -> None:
        self._at, self._mono = server_now, time.monotonic()

    def __call__(self) -> float:
        return self._at + (time.monotonic() - self._mono)
