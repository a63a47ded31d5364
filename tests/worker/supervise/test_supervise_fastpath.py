"""The tree kill's shortcut: no scan of ``/proc`` only when nothing of the tree can be left.

Each case runs in its own interpreter, which becomes a child subreaper (as a supervisor
does), so the test process never collects strangers' orphans.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from overnight.worker.supervise import tree

PY = sys.executable

PRELUDE = """
import os, subprocess, sys, time
from overnight.worker.supervise import tree

def spawn(argv):
    proc = subprocess.Popen(argv, start_new_session=True)
    row = tree.read_proc(proc.pid)
    return proc, tree.Tree(root=proc.pid, root_start=row.start if row else None,
                           adopter=os.getpid(), group_safe=True, keep_unreaped={proc.pid})

def exited(proc):
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # wait, but leave it unreaped
"""


def run(body: str) -> list[str]:
    script = PRELUDE + textwrap.dedent(body)
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_own_children_include_zombies() -> None:
    out = run("""
        proc = subprocess.Popen(["true"])
        exited(proc)
        print(tree.own_children() == {proc.pid})
        proc.wait()
        print(tree.own_children() == set())
    """)
    assert out == ["True", "True"]


def test_a_lone_exited_child_needs_no_scan() -> None:
    out = run("""
        tree.set_child_subreaper()
        proc, t = spawn(["sleep", "0.3"])
        print(t.exited_alone())  # still running
        exited(proc)
        print(t.exited_alone())
        report = tree.end_tree(t, 1.0)
        print(not report.signalled and not report.killed)
    """)
    assert out == ["False", "True", "True"]


def test_without_the_subreaper_the_scan_still_runs() -> None:
    out = run("""
        proc, t = spawn(["true"])
        exited(proc)
        print(t.exited_alone())
    """)
    assert out == ["False"]


def test_an_orphan_that_came_back_forces_the_scan_and_dies() -> None:
    escape = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execve('/bin/sleep', ['sleep', '60'], {})\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    )
    out = run(f"""
        tree.set_child_subreaper()
        proc, t = spawn([sys.executable, "-c", {escape!r}])
        exited(proc)
        orphans = tree.own_children() - {{proc.pid}}
        print(len(orphans), t.exited_alone())
        report = tree.end_tree(t, 1.0)
        print(report.signalled == orphans)
        for pid in orphans:
            row = tree.read_proc(pid)
            print(row is None or row.dead)
    """)
    assert out == ["1", "False", "True", "True"]


def test_a_child_started_before_the_root_does_not_count() -> None:
    out = run("""
        tree.set_child_subreaper()
        older = subprocess.Popen(["sleep", "30"])
        time.sleep(0.05)  # start times are in clock ticks: be a tick or more older
        proc, t = spawn(["true"])
        exited(proc)
        print(t.exited_alone())
        young = subprocess.Popen(["sleep", "30"])
        time.sleep(0.05)
        print(t.exited_alone())
        for p in (older, young):
            p.kill()
            p.wait()
    """)
    assert out == ["True", "False"]


def test_the_shortcut_never_applies_to_another_adopter() -> None:
    assert not tree.Tree(root=1, root_start=0, adopter=None).exited_alone()


ORPHAN = (
    "import os, sys, time\n"
    "if os.fork() == 0:\n"
    "    time.sleep(float(sys.argv[1]))\n"
    "    os._exit(0)\n"
)


def test_a_dead_orphan_needs_no_scan_and_is_reaped() -> None:
    # The shape of a sandbox's end: bwrap's outer process exits before the namespace's
    # first process, which comes back to us and dies.
    out = run(f"""
        tree.set_child_subreaper()
        proc, t = spawn([sys.executable, "-c", {ORPHAN!r}, "0.2"])
        exited(proc)
        orphans = tree.own_children() - {{proc.pid}}
        print(len(orphans), t.exited_alone())  # alive: the scan runs
        for pid in orphans:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        print(t.exited_alone())  # a zombie now
        report = tree.end_tree(t, 1.0)
        print(not report.signalled and not report.killed)
        print(tree.own_children() == {{proc.pid}})  # reaped; the root left to its owner
    """)
    assert out == ["1", "False", "True", "True", "True"]


def test_settle_waits_for_an_orphan_that_is_exiting_and_no_longer() -> None:
    out = run(f"""
        tree.set_child_subreaper()
        proc, t = spawn([sys.executable, "-c", {ORPHAN!r}, "0.3"])
        exited(proc)
        report = tree.end_tree(t, 1.0, settle=10.0)
        print(not report.signalled and not report.killed)  # it went by itself
        print(tree.own_children() == {{proc.pid}})

        # Its twin never goes: the settle gives up and the tree is ended.
        proc.wait()
        proc, t = spawn([sys.executable, "-c", {ORPHAN!r}, "300"])
        exited(proc)
        orphans = tree.own_children() - {{proc.pid}}
        report = tree.end_tree(t, 0.2, settle=0.3)
        print(bool(orphans) and report.signalled >= orphans)
        print(all(tree.read_proc(pid) is None or tree.read_proc(pid).dead for pid in orphans))
    """)
    assert out == ["True", "True", "True", "True"]
