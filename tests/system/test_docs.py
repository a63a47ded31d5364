"""The documentation keeps up with the code: every command and setting is documented, every
module path a reader is told to run imports, README stays a short door.

The lists come from the code (the click group, the settings model), so a new command or
setting fails here until docs/ names it.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from rq.utils import import_attribute

from overnight.config.settings import Settings
from overnight.config.validate import ENV_PREFIX
from overnight.coordinator.cli.main import cli as main
from overnight.coordinator.tasks import taskfile
from overnight.coordinator.tasks.taskfile import TaskSpec
from overnight.worker.redisio.receipts import KINDS
from tests.helpers import ROOT
from tests.repos import make_repo

# The checkout's folders that the installed package maps under `overnight.`: a path starting
# with one imports (as a duplicate) only from the checkout's root, never once installed.
LAYER_FOLDERS = {"config", "worker", "coordinator"}
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 250

# `rq worker ... -w some.Class` and `python -m some.module` (python3, flags before -m too).
DOTTED = r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
RQ_WORKER_CLASS = re.compile(r"rq worker\b[^`\n]*?(?:-w|--worker-class)[ =]" + DOTTED)
PYTHON_MODULE = re.compile(r"\bpython3?(?:\.\d+)?(?:\s+-[A-Za-z]+)*\s+-m\s+" + DOTTED)
# An issue reference: "issue 12", "issues 3 and 4", "#12".
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+|(?<![\w&/#])#\d+\b", re.IGNORECASE)
# "1 tasks" (a word ending in a single s after the count one; "1 process" is fine).
ONE_PLURAL = re.compile(r"\b1 [a-z]+[^s\W]s\b")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# A command line in code: `overnight WORD` first on a line, or after a shell operator.
COMMAND_LINE = re.compile(r"(?:^|[;&|(]\s*)overnight ([a-z][a-z-]*)", re.MULTILINE)


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def all_docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in [README, *doc_pages()])


def code_of(text: str) -> str:
    """The code blocks and inline code spans of a Markdown text, one snippet a line."""
    blocks = FENCE.findall(text)
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return "\n".join([*blocks, *spans])


def commands(
    group: click.Group, parent: click.Context
) -> Iterator[tuple[list[str], click.Command, click.Context]]:
    """Every command `--help` lists, depth first: (its words after `overnight`, it, its context)."""
    for name in group.list_commands(parent):
        command = group.get_command(parent, name)
        if command is None or command.hidden:
            continue
        ctx = click.Context(command, info_name=name, parent=parent)
        words = [*parent.command_path.split()[1:], name]
        yield words, command, ctx
        if isinstance(command, click.Group):
            yield from commands(command, ctx)


@functools.cache
def every_command() -> list[tuple[list[str], click.Command, click.Context]]:
    return list(commands(main, click.Context(main, info_name="overnight")))


def undocumented_commands(text: str) -> list[str]:
    missing = []
    for words, _, _ in every_command():
        name = "overnight " + " ".join(words)
        if not re.search(re.escape(name) + r"(?![\w-])", text):
            missing.append(name)
    return missing


def setting_names() -> list[str]:
    return [ENV_PREFIX + field.upper() for field in Settings.model_fields]


def undocumented_settings(text: str) -> list[str]:
    return [n for n in setting_names() if not re.search(rf"(?<![\w]){n}(?![\w])", text)]


def help_texts() -> dict[str, str]:
    """`--help` of `overnight` and of every command, by its command line."""
    top = click.Context(main, info_name="overnight")
    texts = {"overnight": main.get_help(top)}
    for words, command, ctx in every_command():
        texts["overnight " + " ".join(words)] = command.get_help(ctx)
    return texts


def test_every_command_is_on_the_commands_page() -> None:
    page = (DOCS / "commands.md").read_text(encoding="utf-8")
    assert undocumented_commands(page) == []


def undocumented_options(page: str) -> list[str]:
    """`overnight CMD --option` for every option missing from the lines that document CMD."""
    missing = []
    for words, command, _ in every_command():
        name = "overnight " + " ".join(words)
        rows = "\n".join(line for line in page.splitlines() if f"`{name}" in line)
        for param in command.params:
            longs = [o for o in param.opts if o.startswith("--") and o != "--help"]
            if isinstance(param, click.Option) and longs and not any(o in rows for o in longs):
                missing.append(f"{name} {longs[0]}")
    return missing


def test_every_option_is_on_the_commands_page() -> None:
    page = (DOCS / "commands.md").read_text(encoding="utf-8")
    assert undocumented_options(page) == []
    assert "overnight up --budget" in undocumented_options(page.replace("--budget N]", "]"))


def test_a_missing_command_is_caught() -> None:
    page = (DOCS / "commands.md").read_text(encoding="utf-8")
    assert "overnight worktrees prune" in undocumented_commands(page.replace("worktrees prune", ""))


def test_every_setting_is_on_the_configuration_page() -> None:
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert undocumented_settings(page) == []


def test_a_missing_setting_is_caught() -> None:
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert "OVERNIGHT_GRACE" in setting_names()
    assert "OVERNIGHT_GRACE" in undocumented_settings(page.replace("OVERNIGHT_GRACE", ""))


def test_every_task_key_is_on_the_tasks_page() -> None:
    page = (DOCS / "tasks.md").read_text(encoding="utf-8")
    # `base` is set at submit from the workdir; a file that names it is refused.
    keys = [key for key in TaskSpec.model_fields if key != "base"]
    assert [k for k in keys if f"`{k}`" not in page and f"[[{k}]]" not in page] == []


def test_every_receipt_kind_is_on_the_morning_page() -> None:
    page = (DOCS / "morning.md").read_text(encoding="utf-8")
    assert [kind for kind in KINDS if f"`{kind}`" not in page] == []


def unknown_options(code: str) -> list[str]:
    """Options shown on `overnight …` command lines in ``code`` that the command lacks."""
    commands_by_words = {tuple(words): command for words, command, _ in every_command()}
    wrong = []
    for line in code.splitlines():
        for match in re.finditer(r"(?:^|[;&|(]\s*)overnight ([^;&|#`]*)", line):
            tokens = match.group(1).split()
            words: tuple[str, ...] = ()
            while tokens and (*words, tokens[0]) in commands_by_words:
                words, tokens = (*words, tokens[0]), tokens[1:]
            if not words or "--" in tokens:  # what follows `--` is the supervised command's
                tokens = tokens[: tokens.index("--")] if "--" in tokens else []
            command = commands_by_words.get(words)
            known = {o for p in command.params for o in p.opts} if command else set()
            known |= {"--help", "-h"}
            for token in tokens:
                option = token.split("=")[0].rstrip(".,\\")
                if option.startswith("--") and len(option) > 2 and option not in known:
                    wrong.append(f"overnight {' '.join(words)} {option}")
    return wrong


def test_every_command_line_in_the_docs_has_real_options() -> None:
    assert unknown_options(code_of(all_docs_text())) == []
    assert unknown_options("overnight up --tasks . --budgte 3") == ["overnight up --budgte"]


def test_every_command_named_in_the_docs_exists() -> None:
    known = {words[0] for words, _, _ in every_command()}
    named = set(COMMAND_LINE.findall(code_of(all_docs_text())))
    assert named - known == set()


def paths_shown() -> list[tuple[str, str, str]]:
    """(where, kind, dotted path) for every worker class and module a reader is told to run."""
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in [README]}
    sources.update({str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in doc_pages()})
    sources.update(help_texts())
    found = []
    for where, text in sources.items():
        flat = re.sub(r"\s+", " ", text)  # a help text wraps a command line anywhere
        found += [(where, "rq", m) for m in RQ_WORKER_CLASS.findall(flat)]
        found += [(where, "module", m) for m in PYTHON_MODULE.findall(flat)]
    return sorted(set(found))


def test_the_docs_and_help_name_worker_classes_and_modules() -> None:
    kinds = {kind for _, kind, _ in paths_shown()}
    assert kinds == {"rq", "module"}


@pytest.mark.parametrize(("where", "kind", "path"), paths_shown())
def test_every_path_shown_imports(
    where: str, kind: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert path.split(".")[0] not in LAYER_FOLDERS, f"{where}: {path}: not under overnight."
    monkeypatch.syspath_prepend(str(ROOT))  # bench.* runs from the checkout
    if kind == "rq":
        assert isinstance(import_attribute(path), type), f"{where}: rq worker -w {path}"
    else:
        assert importlib.util.find_spec(path) is not None, f"{where}: python -m {path}"


def test_a_wrong_worker_path_is_caught() -> None:
    flat = "rq worker -w coordinator.dispatch.OvernightWorker overnight"
    (path,) = RQ_WORKER_CLASS.findall(flat)
    assert path.split(".")[0] in LAYER_FOLDERS


def test_the_readme_task_file_validates(tmp_path: Path) -> None:
    """README's first-night task file, pointed at a repository with tests, loads as submit
    would load it."""
    (text,) = re.findall(r"```toml\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    workdir = re.search(r'^workdir = "([^"]+)"', text, re.MULTILINE)
    assert workdir is not None
    repo = make_repo(tmp_path / "repo")
    path = tmp_path / "nights" / "fix-parser.toml"
    path.parent.mkdir()
    path.write_text(text.replace(workdir.group(1), str(repo)), encoding="utf-8")
    spec = taskfile.load(path, state=tmp_path / "state")
    assert (spec.id, spec.agent, spec.workspace) == ("fix-parser", "codex", "worktree")


def test_readme_links_resolve() -> None:
    """mkdocs --strict checks the pages' links; README's own are checked here."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert local, "README links to the docs"
    assert [link for link in local if not (ROOT / link).exists()] == []
    pages = {f"docs/{p.name}" for p in doc_pages() if p.name != "index.md"}
    assert sorted(pages - set(local)) == [], "README links to every page"


def test_every_repository_path_in_the_docs_exists() -> None:
    """A file or folder of the checkout named in code (`tests/…`, `worker/…`) is there."""
    top = ("tests/", "worker/", "coordinator/", "config/", "bench/", ".ci/", "src/", "docs/")
    named = re.findall(r"`([\w./-]+)`", all_docs_text())
    paths = {n for n in named if n.startswith(top)}
    assert paths, "the docs name files of the checkout"
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


def test_readme_is_a_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES


def test_no_issue_numbers_in_the_docs() -> None:
    hits = []
    for page in [README, *doc_pages()]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            hits += [f"{page.name}:{number}: {m}" for m in ISSUE_NUMBER.findall(line)]
    assert hits == []
    assert ISSUE_NUMBER.findall("since issue 14, see #12") == ["issue 14", "#12"]


def test_no_issue_numbers_in_the_code() -> None:
    """Comments and docstrings say why, never which issue asked for it."""
    words = re.compile(r"\bissues? #?\d+", re.IGNORECASE)  # "#999" is a colour in code
    folders = ["config", "worker", "coordinator", "overnight", "tests", "bench", ".ci"]
    hits = []
    for path in sorted(p for f in folders for p in (ROOT / f).rglob("*") if p.is_file()):
        if path.suffix not in {".py", ".lua", ".sh", ".toml", ".md"} or path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{number}: {m}" for m in words.findall(line)]
    assert hits == []


def test_every_page_is_in_the_site() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert [p.name for p in doc_pages() if f": {p.name}" not in nav] == []


def test_help_says_no_plural_after_one() -> None:
    wrong = {where: ONE_PLURAL.findall(text) for where, text in help_texts().items()}
    assert {where: found for where, found in wrong.items() if found} == {}
    assert ONE_PLURAL.findall("1 tasks, 1 process, 11 calls") == ["1 tasks"]
