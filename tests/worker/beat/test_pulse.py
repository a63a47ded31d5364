"""``worker.beat.pulse``: beat() and the pulse thread over the beat channel (no Redis involved),
against a real :class:`~worker.beat.channel.Channel` served from a thread, and end to end
under ``overnight supervise``."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.beat import pulse
from overnight.worker.beat.channel import Beat, Channel
from overnight.worker.lease.store import LeaseRefused, Leases
from overnight.worker.supervise.procs import read_proc
from tests.helpers import start, wait_for


class Served:
    """A channel whose root is ``root`` (this process by default), answered from a thread."""

    def __init__(self, root: int, gap: float = 0.6) -> None:
        self.channel = Channel("lease-under-test")
        self.gap = gap
        self.beats: list[Beat] = []
        self.poller = select.poll()
        row = read_proc(root)
        self.channel.attach(self.poller, root, row.start if row else None)
        self.environ = self.channel.environment()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _answer(self, beat: Beat) -> float:
        return self.gap

    def _serve(self) -> None:
        while not self._stop.is_set():
            for fd, _mask in self.poller.poll(50):
                if self.channel.handles(fd):
                    self.beats.extend(self.channel.event(fd, self._answer))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.channel.close()


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served(os.getpid())
    yield s
    s.close()


def test_beat_outside_a_lease_raises() -> None:
    with pytest.raises(pulse.NoLease):
        pulse.beat(environ={})
    with pytest.raises(pulse.NoLease):
        pulse.beat(environ={"OVERNIGHT_LEASE_ID": "x"})


def test_beat_reaches_the_channel_with_its_note(served: Served) -> None:
    assert pulse.beat(note="halfway", environ=served.environ) == pytest.approx(0.6)
    pulse.beat(environ=served.environ)
    # The reply goes out before the serving thread records the beat: wait for the record.
    assert wait_for(lambda: served.beats if len(served.beats) == 2 else None, timeout=5) == [
        Beat("halfway"),
        Beat(None),
    ]


def test_a_beat_for_another_lease_id_is_refused(served: Served) -> None:
    environ = {**served.environ, "OVERNIGHT_LEASE_ID": "some-other-lease"}
    with pytest.raises(LeaseRefused) as err:
        pulse.beat(environ=environ)
    assert err.value.reason == "bad-request" and served.beats == []


def test_a_process_outside_the_tree_is_refused(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    s = Served(sleeper.pid)  # the channel of a tree this test process is not part of
    try:
        with pytest.raises(LeaseRefused) as err:
            pulse.beat(environ=s.environ)
        assert err.value.reason == "not-this-lease" and s.beats == []
        assert s.channel.refused == 1
    finally:
        s.close()
        sleeper.kill()
        sleeper.wait()


def test_pulse_beats_at_a_third_of_the_gap(served: Served) -> None:
    with pulse.pulse(environ=served.environ) as p:
        assert p.interval == pytest.approx(0.2)
        wait_for(lambda: p.beats >= 3, timeout=10)
    assert not p.alive and p.refused is None
    count = len(served.beats)
    assert count >= 4  # the first beat, then the thread's


def test_pulse_stops_for_good_once_refused(served: Served) -> None:
    with pulse.pulse(interval=0.05, environ=served.environ) as p:
        wait_for(lambda: p.beats >= 1, timeout=10)
        served.close()  # the lease ends: its channel is gone
        wait_for(lambda: not p.alive, timeout=5)
        assert p.refused is not None and p.refused.reason.startswith("not-running")


def test_pulse_on_a_closed_channel_raises_at_once(served: Served) -> None:
    served.close()
    with pytest.raises(LeaseRefused), pulse.pulse(environ=served.environ):
        pytest.fail("the block must not run")


def test_a_note_from_the_child_reaches_the_lease(
    env: dict[str, str], r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    script = (
        "import os, time\nfrom overnight import beat\n"
        "left = beat(note='halfway')\nassert 0 < left <= 5, left\n"
        f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.02)\n"
    )
    proc = start(  # from tmp_path: the tree a sandboxed step sees, "go" in it
        ["--gap", "5", "--lease-id", f"note-{namespace}", "--", sys.executable, "-c", script],
        env,
        cwd=tmp_path,
    )
    try:
        leases = Leases(r, Keys(namespace))

        def noted() -> bool:
            doc = leases.get(f"note-{namespace}")
            return doc is not None and doc.note == "halfway"

        wait_for(noted, timeout=10)
    finally:
        go.touch()
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
