"""``overnight agents``: the agent presets and whether each one's CLI is installed here."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import click


@click.command("agents")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per preset, a list.")
def agents_command(as_json: bool) -> None:
    """List the presets a task file's `agent` may name ("codex", "claude", …).

    A preset runs a real agent CLI headless against the host's gateway, with a scratch
    HOME, stdin from /dev/null and the gateway's per-lease token as its only credential.
    For each preset this prints whether its program is on PATH (the PATH a step gets is
    this one), the version it reports, and how to install it when it is missing. A task
    naming a preset whose CLI is missing ends `agent_failed` before any call is charged.
    """
    from overnight.coordinator import agents

    presets = [agents.get(name) for name in agents.names()]
    with ThreadPoolExecutor(max_workers=4) as pool:  # each --version may take a second
        found = list(pool.map(agents.installed, [p for p in presets if p is not None]))
    if as_json:
        click.echo(json.dumps([f.as_json() for f in found], indent=2))
        return
    width = max(len(f.name) for f in found)
    for f in found:
        where = f"{f.path} ({f.version or 'version unknown'})" if f.path else "not installed"
        click.echo(f"{f.name:<{width}}  {f.wire:<9}  {where}")
        if f.path is None:
            click.echo(f"{'':<{width}}  install: {f.install}")
