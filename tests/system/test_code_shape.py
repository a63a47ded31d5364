"""The shape the code keeps: every Lua script loaded one way, with a header saying its KEYS,
ARGV and reply, never a reply of joined fields; worker and config modules of at most 400
lines in folders of at most 14 modules."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import ROOT

SCRIPTS = sorted(
    [*(ROOT / "worker" / "lua").glob("*.lua"), *(ROOT / "coordinator" / "lua").glob("*.lua")]
)
LIBRARIES = {"envelope_lib.lua"}
# A reply built by joining fields: `return '0|' .. x`, `return a .. '|' .. b`.
JOINED = re.compile(r"return\s+[^\n]*(?:'[^'\n]*\|[^'\n]*'|\"[^\"\n]*\|[^\"\n]*\")")
SOURCE = [p for layer in ("config", "worker", "coordinator") for p in (ROOT / layer).rglob("*.py")]
MAX_LINES = 400
MAX_MODULES = 14


def header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines if line.startswith("--"))


@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.name not in LIBRARIES], ids=str)
def test_every_script_says_its_keys_args_and_reply(path: Path) -> None:
    text = header(path)
    assert re.search(r"^-- KEYS", text, re.MULTILINE), path.name
    assert re.search(r"^-- ARGV", text, re.MULTILINE), path.name
    assert re.search(r"^-- Returns", text, re.MULTILINE), path.name


@pytest.mark.parametrize("path", SCRIPTS, ids=str)
def test_no_script_replies_with_joined_fields(path: Path) -> None:
    code = "\n".join(
        line for line in path.read_text().splitlines() if not line.lstrip().startswith("--")
    )
    assert not JOINED.search(code), path.name


def test_joined_replies_are_caught() -> None:
    assert JOINED.search("if x then return '0|0|bad-kind' end")
    assert JOINED.search("return allowed .. '|' .. reason")
    assert not JOINED.search("return {0, 'bad-args'}")


def test_scripts_are_registered_in_one_place() -> None:
    loader = ROOT / "worker" / "redisio" / "scripts.py"
    others = [p for p in SOURCE if p != loader and "register_script(" in p.read_text()]
    assert others == []


@pytest.mark.parametrize("layer", ["config", "worker"])
def test_modules_and_folders_stay_small(layer: str) -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / layer).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
    crowded = {
        str(d.relative_to(ROOT)): n
        for d in [ROOT / layer, *(ROOT / layer).rglob("*/")]
        if d.is_dir() and (n := len(list(d.glob("*.py")))) > MAX_MODULES
    }
    assert crowded == {}
