"""OVERNIGHT_HOST_ID from a ``.env`` file counts as any other setting does: in ``Settings``,
in every host id overnight records, and on ``supervise``'s fast path."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from overnight.config import validate
from overnight.config.settings import ConfigError, load_settings
from tests.helpers import OVERNIGHT, final_doc

HOST = socket.gethostname()


@pytest.mark.parametrize(
    ("environ", "dotenv", "expected"),
    [
        ({}, "OVERNIGHT_HOST_ID=from-file\n", "from-file"),
        ({}, "overnight_host_id=lower-case\n", "lower-case"),  # any case, as Settings
        ({}, 'OVERNIGHT_HOST_ID="quoted.id"  # why\n', "quoted.id"),
        ({}, "export OVERNIGHT_HOST_ID=exported\n", "exported"),
        ({"OVERNIGHT_HOST_ID": "from-env"}, "OVERNIGHT_HOST_ID=from-file\n", "from-env"),
        ({"OVERNIGHT_HOST_ID": ""}, "OVERNIGHT_HOST_ID=from-file\n", "from-file"),  # empty: unset
        ({"overnight_host_id": "env-lower"}, "OVERNIGHT_HOST_ID=from-file\n", "env-lower"),
        ({}, "OVERNIGHT_HOST_ID=\n", None),
        ({}, "OVERNIGHT_HOST_ID=a b\n", None),  # invalid: the host name here, exit 78 elsewhere
        ({}, "OVERNIGHT_NAMESPACE=x\n", None),
        ({}, None, None),  # no .env at all
    ],
)
def test_this_host_reads_dotenv_like_settings(
    environ: dict[str, str],
    dotenv: str | None,
    expected: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.upper().startswith("OVERNIGHT_"):
            monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    if dotenv is not None:
        (tmp_path / ".env").write_text(dotenv)
    assert validate.this_host(environ, str(tmp_path / ".env")) == (expected or HOST)
    assert validate.this_host() == (expected or HOST)  # the process's environment, ./.env
    try:
        from_settings = load_settings().host_id
    except ConfigError as exc:
        assert "OVERNIGHT_HOST_ID" in str(exc) and expected is None
    else:
        assert from_settings == expected  # Settings and every recorded host id agree


def test_env_file_none_reads_only_the_environment(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("OVERNIGHT_HOST_ID=from-file\n")
    assert validate.this_host({}, None) == HOST


def _lease_host(cwd: Path, env: dict[str, str]) -> tuple[str, str]:
    """Run ``overnight supervise`` in ``cwd``; the host its lease recorded, and the host
    its fresh interpreter's ``procs.hostname()`` gives there."""
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--deadline", "30", "--", "true"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    code = "from overnight.worker.supervise import procs; print(procs.hostname())"
    here = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return str(final_doc(proc.stdout)["host"]), here.stdout.strip()


def test_supervise_and_config_take_the_host_id_from_dotenv(
    env: dict[str, str], tmp_path: Path
) -> None:
    """With a .env, supervise's fast path defers to Settings, and the lease it writes names
    the .env's host; without one, the fast path reads the environment alone."""
    env = {k: v for k, v in env.items() if k != "OVERNIGHT_HOST_ID"}
    with_file = tmp_path / "with"
    with_file.mkdir()
    (with_file / ".env").write_text("OVERNIGHT_HOST_ID=dotenv-host-1\n")
    assert _lease_host(with_file, env) == ("dotenv-host-1", "dotenv-host-1")
    shown = subprocess.run(
        [OVERNIGHT, "config"],
        cwd=with_file,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(shown.stdout)["host_id"] == "dotenv-host-1"
    bare = tmp_path / "bare"
    bare.mkdir()
    assert _lease_host(bare, env) == (HOST, HOST)
    assert _lease_host(bare, {**env, "OVERNIGHT_HOST_ID": "env-host-2"}) == ("env-host-2",) * 2
    # The environment wins over .env, as for every setting.
    overridden = {**env, "OVERNIGHT_HOST_ID": "env-host-3"}
    assert _lease_host(with_file, overridden) == ("env-host-3",) * 2
