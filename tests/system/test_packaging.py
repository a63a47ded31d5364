"""The wheel: it builds without warnings, installs one import name and runs the demo from a
folder whose files are named like the repository's layers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import redis

from tests.helpers import ROOT, plant_shadows, remove_demo_scratch

# What a build leaves in a source tree or what never goes into a wheel; copying the rest
# lets the build write its build/ and egg-info away from the checkout.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "*.egg-info", ".overnight", "*_cache", "__pycache__", "tests"
)


def build_wheel(tmp_path: Path) -> tuple[Path, str]:
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    out = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(out), str(source)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    (wheel,) = out.glob("overnight-*.whl")
    return wheel, proc.stdout


def backend_warnings(build_log: str) -> list[str]:
    """Lines of the build backend's output (pip indents them) that warn about anything."""
    return [
        line
        for line in build_log.splitlines()
        if line.startswith(" ") and re.search(r"warn", line, re.IGNORECASE)
    ]


def test_backend_warnings_are_found() -> None:
    log = (
        "Looking in links: /opt/wheels\n"
        "  running bdist_wheel\n"
        "  /tmp/x/setuptools/dist.py:759: SetuptoolsDeprecationWarning: License classifiers\n"
        "  warning: build_py: byte-compiling is disabled, skipping.\n"
    )
    assert len(backend_warnings(log)) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_installs_one_import_name_and_runs_the_demo_anywhere(tmp_path: Path) -> None:
    wheel, build_log = build_wheel(tmp_path)
    assert backend_warnings(build_log) == []

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
        top_level = zf.read(f"{dist_info}/top_level.txt").decode().split()
    assert {n.split("/")[0] for n in names} == {"overnight", dist_info}
    assert top_level == ["overnight"]
    assert any(n.startswith("overnight/coordinator/examples/") for n in names)
    # Every module of every layer (subpackages too: the package list is explicit).
    root = ROOT
    for layer in ("config", "worker", "coordinator"):
        for module in (root / layer).rglob("*.py"):
            assert f"overnight/{module.relative_to(root)}" in names, module

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    (site,) = (venv / "lib").glob("python3*/site-packages")
    before = set(os.listdir(site))
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert set(os.listdir(site)) - before == {"overnight", dist_info}

    # The dependencies (not overnight itself: that site holds only an editable finder, which
    # a path entry never runs) come from this test's environment, so no index is needed.
    deps = Path(redis.__file__).resolve().parent.parent
    (site / "_test_dependencies.pth").write_text(f"{deps}\n")

    folder = plant_shadows(tmp_path / "elsewhere")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_")}
    where = subprocess.run(
        [str(python), "-P", "-c", "import overnight; print(overnight.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(site)
    # No folder at the checkout's root is named like the package: run there (its folder
    # first on sys.path), an interpreter still imports every layer of the installed one.
    at_root = subprocess.run(
        [str(python), "-c", "import overnight.config, overnight.worker; print(overnight.__file__)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert at_root.returncode == 0, at_root.stderr
    assert Path(at_root.stdout.strip()).is_relative_to(site)

    try:
        demo = subprocess.run(
            [str(venv / "bin" / "overnight"), "demo"],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        remove_demo_scratch(folder / ".overnight")
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "shadowed" not in demo.stdout + demo.stderr
    assert demo.stdout.count("as expected") == 4, demo.stdout
    listed = subprocess.run(
        [str(venv / "bin" / "overnight"), "agents", "--json"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert [row["name"] for row in json.loads(listed.stdout)] == [
        "aider",
        "claude",
        "codex",
        "mini-swe-agent",
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_editable_install_is_a_plain_path_entry_and_warns_of_nothing(tmp_path: Path) -> None:
    source = tmp_path / "checkout"
    # Links kept as links: src/overnight's layers point at the copy's own folders.
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE, symlinks=True)
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-v", "--no-deps"]
    install = subprocess.run(
        [*pip, "-e", str(source)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert install.returncode == 0, install.stdout[-4000:]
    assert "same name as your package" not in install.stdout
    assert "meta path finder" not in install.stdout
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (pth,) = site.glob("__editable__.overnight-*.pth")
    assert pth.read_text().split() == [str((source / "src").resolve())]
    assert not list(site.glob("__editable___overnight*finder.py"))

    deps = Path(redis.__file__).resolve().parent.parent
    (site / "_test_dependencies.pth").write_text(f"{deps}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_")}
    code = "import overnight.config.settings, overnight; print(overnight.__file__)"
    at_root = subprocess.run(
        [str(python), "-c", code],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert at_root.returncode == 0, at_root.stderr
    assert Path(at_root.stdout.strip()) == source / "src" / "overnight" / "__init__.py"
