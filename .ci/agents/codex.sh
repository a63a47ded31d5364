#!/usr/bin/env bash
# Installs OpenAI Codex CLI (npm, a Rust binary per platform) outside the project's venv,
# at a pinned version, for the `codex` agent preset. Idempotent: skips when it is there.
set -euo pipefail

version=0.171.0
if command -v codex >/dev/null && [ "$(codex --version 2>/dev/null)" = "codex-cli $version" ]; then
  exit 0
fi
command -v npm >/dev/null || {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm
}
echo "ci: installing @openai/codex@$version"
npm install -g --no-fund --no-audit "@openai/codex@$version"
codex --version
