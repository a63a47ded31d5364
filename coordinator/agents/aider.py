"""aider (PyPI ``aider-chat``) run headless: one ``--message`` in the worktree's root, edits
applied without asking, nothing committed (overnight commits after the step).

aider speaks OpenAI chat completions through litellm (``openai/<model>``: ``OPENAI_API_BASE``
and ``OPENAI_API_KEY`` from the step's environment), streamed, with no tools: the model's
edits are blocks in its text (``whole`` files for a model aider does not know, search/replace
for most it does), and with ``--yes-always`` aider edits any file of the repository the model
names, adds a file a reply mentions to the chat and asks again, and runs no shell command (it
wants an explicit yes for those). It prints prose only: the reader picks out aider's own
fixed lines. As aider recommends, it adds ``.aider*`` to the repository's ``.gitignore`` once,
so its chat history and tags cache in the worktree are never committed.
"""

from __future__ import annotations

from overnight.coordinator.agents import Context, Launch, Preset, Reader, Said, one_line, register

VERSION = "0.86.2"  # what .ci/agents/aider.sh installs

FLAGS = (
    "--yes-always",
    "--no-auto-commits",  # overnight commits the step's changes itself
    "--no-dirty-commits",
    "--no-check-update",
    "--no-show-release-notes",
    "--no-analytics",
    "--no-show-model-warnings",  # an unknown model name only warns
    "--no-pretty",  # plain lines in the step's log
    "--no-fancy-input",
    "--no-detect-urls",  # a URL in the prompt is not fetched
    "--no-suggest-shell-commands",  # --yes-always never runs them
)

ENV = {
    # litellm fetches its model price list from the web at import unless told not to.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}

# The step's own git identity (its scratch HOME's): without one aider writes a made-up one
# into the repository's config (the step user may not: aider dies), though it commits nothing.
# (The loop makes git trust the task's worktree for the step user: safe.directory.)
GITCONFIG = """[user]
\tname = aider (overnight step)
\temail = aider@overnight.invalid
"""

HOME_FILES = {
    # aider downloads the same list into this cache when it is missing or empty; a fresh,
    # non-empty cache stops that, and litellm's own copy answers for known models.
    ".aider/caches/model_prices_and_context_window.json": '{"overnight-no-download": {}}\n',
    ".gitconfig": GITCONFIG,
}


def model_name(model: str) -> str:
    """litellm's name for ``model`` on an OpenAI-compatible base URL."""
    return model if model.startswith("openai/") else f"openai/{model}"


def launch(ctx: Context) -> Launch:
    model = model_name(ctx.model)
    # The weak model writes commit messages and history summaries: the task's model too.
    argv = [
        "aider",
        *FLAGS,
        "--model",
        model,
        "--weak-model",
        model,
        "--message-file",
        ctx.prompt_file,
    ]
    return Launch(argv=argv, env=dict(ENV), home_files=dict(HOME_FILES))


APPLIED = b"Applied edit to "
ANSWERED = b"Tokens: "  # aider's report after each model reply
FAILED = b"litellm."  # an API error, e.g. "litellm.RateLimitError: ..."


class AiderReader(Reader):
    """aider exits 0 even when it gave up on the model's API: its last API error with no
    answer after it is a failed step; else the files it edited, or that it edited none."""

    def __init__(self) -> None:
        self.applied: list[str] = []
        self.answers = 0
        self.error: str | None = None

    def __call__(self, line: bytes) -> None:
        text = line.strip()
        if text.startswith(APPLIED):
            path = text[len(APPLIED) :].decode("utf-8", "replace")
            if path not in self.applied:
                self.applied.append(path)
        elif text.startswith(ANSWERED):
            self.answers += 1
            self.error = None
        elif text.startswith(FAILED) and b"Error" in text.split(b":", 1)[0]:
            self.error = text.decode("utf-8", "replace")

    def said(self) -> Said | None:
        if self.error is not None:
            return Said(False, one_line(self.error))
        if self.applied:
            return Said(True, one_line("applied edits to " + ", ".join(self.applied)))
        if self.answers:
            return Said(True, "the model answered without editing a file")
        return None


PRESET = register(
    Preset(
        name="aider",
        program="aider",
        wire="openai",
        install=f"pip install aider-chat=={VERSION} in a venv of its own (.ci/agents/aider.sh)",
        launch=launch,
        reader=AiderReader,
    )
)
