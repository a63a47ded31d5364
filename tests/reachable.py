"""The overnight command and interpreter as another user (``nobody``, a plain user) can run
them: the checkout's own where every folder above its venv lets others in; otherwise (a
checkout under /root, or in a 0700 folder) a copy made once per test session in a fresh
folder of the temp folder that others can enter: the venv (hard links where the file system
allows, the scripts' first lines and the editable install's path file rewritten, on an
interpreter of the same version that others can run where the venv's own is out of their
reach) and the package's source."""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)


def others_can_enter(path: Path) -> bool:
    """True if every folder from / down to ``path`` lets any user through (o+x)."""
    for folder in [*reversed(path.parents), path]:
        try:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


@cache
def _copy() -> Path:
    shared = Path(tempfile.mkdtemp(prefix="overnight-tests-venv-"))
    shared.chmod(0o755)
    atexit.register(shutil.rmtree, shared, True)
    venv = shared / "venv"
    linked = subprocess.run(["cp", "-al", str(VENV), str(venv)], capture_output=True, check=False)
    if linked.returncode != 0:  # another file system: a plain copy
        shutil.rmtree(venv, ignore_errors=True)
        shutil.copytree(VENV, venv, symlinks=True)
    src = shared / "src"
    package = Path(__import__("overnight").__file__).resolve().parent
    shutil.copytree(package, src / "overnight", ignore=shutil.ignore_patterns("__pycache__"))
    old, new = str(VENV), str(venv)
    for script in (venv / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        with open(script, "rb") as fh:
            head = fh.read(2)
        if head != b"#!":
            continue
        text = script.read_bytes()
        first, _, rest = text.partition(b"\n")
        if old.encode() in first:
            _replace(script, first.replace(old.encode(), new.encode()) + b"\n" + rest)
    site = next((venv / "lib").glob("python3*/site-packages"))
    if not others_can_enter(Path(os.path.realpath(sys.executable))):
        _use_interpreter(venv, _reachable_interpreter())
        # redis-py imports async_timeout on a 3.11 older than 3.11.3 (a system Python);
        # asyncio's timeout is the same thing (nothing run this way uses asyncio).
        if not (site / "async_timeout").exists() and not (site / "async_timeout.py").exists():
            (site / "async_timeout.py").write_text("from asyncio import timeout\n")
    for pth in site.glob("*.pth"):
        lines = pth.read_text().splitlines()
        if any(line.strip() == str(package.parent) for line in lines):
            fixed = [str(src) if line.strip() == str(package.parent) else line for line in lines]
            _replace(pth, ("\n".join(fixed) + "\n").encode())
    return venv


def _reachable_interpreter() -> Path:
    """An interpreter of this one's version that others can run (root's may live under a
    0700 /root, as pyenv's does): the venv's copy then runs on it."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for folder in ("/usr/bin", "/usr/local/bin", "/bin"):
        found = Path(folder) / version
        if found.is_file() and others_can_enter(Path(os.path.realpath(found))):
            return found
    raise RuntimeError(f"no {version} that other users can run: install one (apt install python3)")


def _use_interpreter(venv: Path, python: Path) -> None:
    """Point the venv copy's interpreter links and ``pyvenv.cfg`` at ``python``."""
    for link in (venv / "bin").iterdir():
        if link.is_symlink() and link.name.startswith("python"):
            link.unlink()
            link.symlink_to(python)
    cfg = venv / "pyvenv.cfg"
    lines = []
    for line in cfg.read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        if key == "home":
            line = f"home = {python.parent}"
        elif key in ("executable", "command"):
            continue
        lines.append(line)
    _replace(cfg, ("\n".join(lines) + "\n").encode())


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` anew (a hard link to the checkout's file is never written through)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    path.unlink()
    path.write_bytes(data)
    path.chmod(mode)


def source_for_others() -> Path:
    """The folder holding the ``overnight`` package that another user can import from: the
    checkout's ``src``, or this session's copy."""
    src = ROOT / "src"
    return src if others_can_enter(src) else _copy().parent / "src"


def venv_for_others() -> Path:
    """The venv another user can run: the checkout's, or this session's copy."""
    interpreter = Path(os.path.realpath(sys.executable))
    reachable = all(others_can_enter(p) for p in (VENV / "bin", ROOT / "src", interpreter))
    return VENV if reachable else _copy()


def overnight() -> str:
    """The ``overnight`` command for another user."""
    return str(venv_for_others() / "bin" / "overnight")


def python() -> str:
    """The venv's interpreter for another user."""
    return str(venv_for_others() / "bin" / Path(sys.executable).name)
