"""Git repositories for the workspace tests: a tiny project with a bug, its tests and a
check script, and task files (JSON) whose agent is a line of Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PY = sys.executable
BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
CHECK = "from calc import add\nraise SystemExit(0 if add(2, 3) == 5 else 1)\n"


def sh(cwd: Path, *argv: str) -> str:
    return subprocess.run(
        ["git", *argv], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


def make_repo(folder: Path) -> Path:
    folder.mkdir(parents=True)
    sh(folder, "init", "-q", "-b", "main")
    sh(folder, "config", "user.name", "Tester")
    sh(folder, "config", "user.email", "tester@example.invalid")
    (folder / "calc.py").write_text(BUGGY)
    (folder / "check.py").write_text(CHECK)
    (folder / "tests").mkdir()
    (folder / "tests" / "test_calc.py").write_text(TEST)
    (folder / ".gitignore").write_text("__pycache__/\n*.pyc\nbuild/\n")
    sh(folder, "add", "-A")
    sh(folder, "commit", "-q", "-m", "base")
    return folder


def task_toml(folder: Path, agent: str, *, name: str = "task", **extra: object) -> Path:
    """A task file (JSON, same keys as TOML) for ``folder`` whose agent runs ``agent``."""
    path = folder.parent / f"{name}.json"
    data = {
        "assignment": "fix add in calc.py",
        "workdir": folder.name,
        "agent": [PY, "-c", agent],
        "max_calls": 9,
        "protect": ["tests/**"],
        "env": {"PATH": "bin:" + os.environ.get("PATH", "")},
        "verifier": [
            {"name": "check", "run": ["python3", "check.py"]},
            {"name": "tests", "run": [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]},
        ],
        **extra,
    }
    path.write_text(json.dumps(data))
    return path


FIX = "import pathlib; pathlib.Path('calc.py').write_text('def add(a, b):\\n    return a + b\\n')"

# ``python -c REWRITER WHERE BRANCH BASE MARK``: waits (up to 60 s) until BRANCH of the
# repository at WHERE has a commit past BASE (an agent step's, committed), then for 20 s
# writes the fix into BRANCH's worktree every 20 ms, writing MARK after its first write.
REWRITER = f"""
import os, pathlib, subprocess, sys, time
where, branch, base, mark = sys.argv[1:5]
def git(*args):
    done = subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=where,
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""
def tree():
    path = None
    for line in git("worktree", "list", "--porcelain").splitlines():
        if line.startswith("worktree "):
            path = line[len("worktree "):]
        elif line == "branch refs/heads/" + branch:
            return path
end = time.monotonic() + 60
while git("rev-parse", "--verify", "-q", branch) in ("", base) or not tree():
    if time.monotonic() > end:
        sys.exit(1)
    time.sleep(0.05)
calc = pathlib.Path(tree(), "calc.py")
end = time.monotonic() + 20
while time.monotonic() < end:
    calc.write_text({FIXED!r})
    if not os.path.exists(mark):
        pathlib.Path(mark).write_text("landed")
    time.sleep(0.02)
"""

# Ways to pass the checks without fixing the bug, each an agent in one line of Python.
TAMPERS = {
    "edit-the-test": (
        "import pathlib;"
        "pathlib.Path('tests/test_calc.py').write_text('def test_add():\\n    pass\\n')"
    ),
    "conftest-passes-failures": (
        "import pathlib; pathlib.Path('tests/conftest.py').write_text("
        "'import pytest\\n@pytest.hookimpl(hookwrapper=True)\\n"
        "def pytest_runtest_makereport(item, call):\\n    o = yield\\n"
        '    r = o.get_result()\\n    r.outcome = "passed"\\n\');'
        "pathlib.Path('check.py').write_text('raise SystemExit(0)\\n')"
    ),
    "conftest-sys-exit": (
        "import pathlib; pathlib.Path('conftest.py').write_text('import os\\nos._exit(0)\\n');"
        "pathlib.Path('check.py').write_text('import sys\\nsys.exit(0)\\n')"
    ),
    "delete-the-tests": "import os; os.remove('tests/test_calc.py'); open('check.py','w').close()",
    "skip-the-tests": (
        "import pathlib; p = pathlib.Path('tests/test_calc.py');"
        "p.write_text('import pytest\\npytestmark = pytest.mark.skip\\n' + p.read_text())"
    ),
    "path-shim": (
        "import os, pathlib; pathlib.Path('bin').mkdir(exist_ok=True);"
        "s = pathlib.Path('bin/python3'); s.write_text('#!/bin/sh\\nexit 0\\n');"
        "os.chmod(s, 0o755);"
        "pathlib.Path('tests/test_calc.py').unlink()"
    ),
    # Leaves a process behind that rewrites calc.py fixed once the step's commit is taken,
    # while the rules run (REWRITER): the rules must check the commit, not the live tree.
    "background-rewriter": (
        "import os, subprocess, sys; os.makedirs('build', exist_ok=True);"
        "g = lambda *a: subprocess.run(['git', *a], capture_output=True, text=True).stdout.strip();"
        "argv = [os.environ.get('REWRITE_REPO', '.'), g('symbolic-ref', '--short', 'HEAD'),"
        " g('rev-parse', 'HEAD'),"
        " os.environ.get('REWRITE_MARK', 'build/landed')];"
        f"p = subprocess.Popen([sys.executable, '-c', {REWRITER!r}, *argv],"
        " start_new_session=True,"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL);"
        "open('build/pid', 'w').write(str(p.pid))"
    ),
}


# A rule that passes once MARK exists (the rewrite landed), fails after 30 s without it.
WAIT_FOR_MARK = (
    "import os, sys, time\nend = time.monotonic() + 30\n"
    "while not os.path.exists(sys.argv[1]):\n"
    "    if time.monotonic() > end:\n        sys.exit(1)\n    time.sleep(0.05)\n"
)


def rewriter_task(folder: Path, mark: Path, **extra: object) -> Path:
    """The background-rewriter task for ``folder``: its first rule waits until the rewrite
    landed (MARK), so the other two run while the live tree holds the fix; one turn
    (an agent step and three rules)."""
    verifier = [
        {"name": "landed", "run": [PY, "-c", WAIT_FOR_MARK, str(mark)]},
        {"name": "check", "run": ["python3", "check.py"]},
        {"name": "tests", "run": [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]},
    ]
    # The user's repository, where the rewriter sees the step's commit land (the tree's own
    # repository is the task's alone: overnight's commits are not made there).
    env = {
        "PATH": "bin:" + os.environ.get("PATH", ""),
        "REWRITE_MARK": str(mark),
        "REWRITE_REPO": str(folder),
    }
    extra = {"max_calls": 4, **extra}
    return task_toml(folder, TAMPERS["background-rewriter"], verifier=verifier, env=env, **extra)
