#!/usr/bin/env bash
# Claude Code for the "claude" agent preset: npm's package (its native binary comes as a
# per-platform optional dependency of the same registry), installed globally, outside the
# project's venv, so the step user finds /usr/bin/claude. Skipped when the pin is there.
set -euo pipefail
version=2.1.332
if command -v claude >/dev/null && [ "$(claude --version 2>/dev/null | awk '{print $1}')" = "$version" ]; then
  exit 0
fi
command -v npm >/dev/null || {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm
}
echo "ci: installing Claude Code $version"
npm install -g --no-fund --no-audit --loglevel=error "@anthropic-ai/claude-code@$version"
claude --version
