#!/usr/bin/env bash
# Installs aider (PyPI aider-chat, CLI `aider`) in a venv of its own outside the project's,
# at a pinned version, for the `aider` agent preset. Idempotent: skips when it is there.
# Heavy: about a hundred wheels (litellm, tree-sitter grammars, numpy, ...).
set -euo pipefail

version=0.86.2
venv=/opt/overnight-agents/aider
have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("aider-chat"))' \
  2>/dev/null || true)
if [ "$have" = "$version" ] && [ -x /usr/local/bin/aider ]; then
  exit 0
fi
/usr/bin/python3 -c 'import ensurepip' 2>/dev/null || {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
}
echo "ci: installing aider-chat==$version"
mkdir -p /opt/overnight-agents
[ -x "$venv/bin/pip" ] || /usr/bin/python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "aider-chat==$version"
chmod -R a+rX "$venv"
ln -sf "$venv/bin/aider" /usr/local/bin/aider
