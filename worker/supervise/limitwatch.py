"""The supervisor's side of a step's limits (:mod:`worker.sandbox.limits`): the ``prlimit``
prefix of its launch, and the watch over its tree that ends it naming the limit."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from overnight.worker.sandbox import limits as step_limits
from overnight.worker.sandbox.bwrap import TMPFS_PRIVATE
from overnight.worker.supervise import outcome, procs, tree

if TYPE_CHECKING:
    from overnight.worker.sandbox.cgroup import StepGroup
    from overnight.worker.sandbox.launch import Prepared
    from overnight.worker.supervise.outcome import Outcome
    from overnight.worker.supervise.spec import StepSpec

log = logging.getLogger("overnight.supervisor")


class Guard:
    """One step's limits: :attr:`prefix` goes before its argv; once the child is started
    (:meth:`attach`), :meth:`tick` says when the tree is over one of them."""

    def __init__(self, spec: StepSpec) -> None:
        self.limits = spec.limits or step_limits.configured()
        self.spec = spec
        self.watch = step_limits.Watch(step_limits.Limits(), (), (), 0.0)
        self.tree: tree.Tree | None = None
        self.said = ""

    def launch(
        self, argv: list[str], home: str | None, ready: Prepared | None, group: StepGroup | None
    ) -> list[str]:
        """``argv`` behind the ``prlimit`` prefix (and the limits in the step's cgroup
        ``group`` where its controllers are delegated); the writable trees measured from
        now: the worktree and, in the sandbox, its tmpfs mounts, else the scratch ``home``."""
        spec = self.spec
        if group is not None:
            step_limits.apply_cgroup(str(group.path), self.limits)
        uid = spec.user.uid if spec.user is not None else os.getuid()  # bwrap's uid too
        trees: list[str] = []
        mounts: tuple[str, ...] = ()
        if ready is not None:
            trees.append(spec.worktree or spec.cwd or os.getcwd())
            mounts = (*TMPFS_PRIVATE, ready.home)
        elif spec.worktree is not None:
            trees.append(spec.worktree)
        if home is not None:
            trees.append(home)
        self.watch = step_limits.Watch(self.limits, trees, mounts, time.monotonic())
        alone = spec.user is not None and spec.user.alone
        return [*step_limits.launch_prefix(self.limits, uid, alone=alone), *argv]

    def attach(self, pid: int, ticks: int | None, lease_id: str) -> Guard:
        """Watch the tree of the started child ``pid``."""
        self.tree = tree.Tree(root=pid, root_start=ticks, lease_id=lease_id, adopter=os.getpid())
        return self

    @property
    def next_check(self) -> float:
        return self.watch.next_check if self.tree is not None else float("inf")

    def tick(self, now: float) -> Outcome | None:
        """The step's end if its tree is over a limit now (a look only when one is due)."""
        if self.tree is None or now < self.watch.next_check:
            return None
        kind = self.watch.check(now, self.tree.members(procs.scan()))
        if kind is None:
            return None
        self.said = step_limits.note(kind, self.limits)
        seen = self.watch.last
        log.warning(
            "lease=%s host=%s task=%s: %s (seen: %d processes, %d bytes resident, %.1f s CPU, "
            "%s bytes written); ending the tree",
            self.tree.lease_id,
            procs.hostname(),
            self.spec.task_id,
            self.said,
            seen.pids,
            seen.memory,
            seen.cpu,
            "?" if seen.disk is None else seen.disk,
        )
        return outcome.over_limit(self.said)
