#!/usr/bin/env bash
# Installs mini-swe-agent (PyPI, CLI `mini`) in a venv of its own outside the project's,
# at a pinned version, for the `mini-swe-agent` agent preset, with the one-line .pth that
# runs the preset's start-up hook (coordinator/agents/mini.py, PTH_LINE) when a step names
# it in OVERNIGHT_MINI_HOOK. Idempotent: skips when both are there.
set -euo pipefail

version=2.4.6
venv=/opt/overnight-agents/mini-swe-agent
pth_line='import os; p = os.path.expanduser(os.environ.pop("OVERNIGHT_MINI_HOOK", "")); p and exec(compile(open(p).read(), p, "exec"), {"__name__": "overnight_mini_hook"})'

have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("mini-swe-agent"))' \
  2>/dev/null || true)
if [ "$have" != "$version" ] || [ ! -x /usr/local/bin/mini ]; then
  /usr/bin/python3 -c 'import ensurepip' 2>/dev/null || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
  }
  echo "ci: installing mini-swe-agent==$version"
  mkdir -p /opt/overnight-agents
  [ -x "$venv/bin/pip" ] || /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "mini-swe-agent==$version"
  ln -sf "$venv/bin/mini" /usr/local/bin/mini
fi
pth="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/overnight_mini_hook.pth"
if [ "$(cat "$pth" 2>/dev/null)" != "$pth_line" ]; then
  printf '%s\n' "$pth_line" >"$pth"
fi
chmod -R a+rX "$venv"
