"""The built-in model step, for tasks with no ``agent``.

Run as ``python -P -m overnight.coordinator.model_step``.

It reads the turn's prompt from ``$OVERNIGHT_PROMPT_FILE`` (else ``$OVERNIGHT_PROMPT``),
asks the OpenAI-compatible ``/v1/chat/completions`` endpoint at ``OVERNIGHT_MODEL_URL``
(bearer ``OVERNIGHT_MODEL_API_KEY``, bounded by ``OVERNIGHT_MODEL_TIMEOUT``), and writes
the answer under ``out/`` of its working directory: ``out/turn-NNN.json`` and
``out/answer.md``. With no URL a deterministic echo stub writes the same shape, with no
network. The API key is never printed. Exit 0 on an answer, 1 when the model failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

SYSTEM = (
    "You are the agent step of an unattended task. Answer with what to change so that "
    "the failing checks pass. Be concise."
)
STUB_MODEL = "echo-stub"
MAX_ERROR_BODY = 300


class ModelError(Exception):
    """The model endpoint did not give a usable answer (one line, no secret)."""


def endpoint(url: str) -> str:
    """The chat-completions URL for a base URL, a ``/v1`` URL or the full endpoint."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def _scrub(text: str, secret: str | None) -> str:
    text = " ".join(text.split())
    return text.replace(secret, "****") if secret else text


def ask_model(url: str, api_key: str | None, model: str, prompt: str, timeout: float) -> str:
    """One chat completion; raises :class:`ModelError` on HTTP errors, timeouts, bad shapes."""
    body = json.dumps(
        {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": prompt},
            ],
        }
    ).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(endpoint(url), data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read(MAX_ERROR_BODY).decode("utf-8", "replace")
        raise ModelError(f"model answered HTTP {exc.code}: {_scrub(detail, api_key)}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ModelError(f"model unreachable: {_scrub(str(reason), api_key)}") from None
    try:
        data = json.loads(raw)
        content = data["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ModelError("model answer is not a chat completion") from None
    if not isinstance(content, str):
        raise ModelError("model answer has no text content")
    return content


def echo_stub(prompt: str) -> str:
    """The deterministic answer given when no model URL is configured."""
    return "[echo stub: OVERNIGHT_MODEL_URL is not set, so no model was asked]\n\n" + prompt


def write_answer(workdir: Path, turn: int, record: dict[str, Any]) -> Path:
    """Write ``out/turn-NNN.json`` and ``out/answer.md``; returns the JSON file's path."""
    out = workdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"turn-{turn:03d}.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (out / "answer.md").write_text(str(record["answer"]), encoding="utf-8")
    return path


def _prompt() -> str:
    name = os.environ.get("OVERNIGHT_PROMPT_FILE")
    if name:
        try:
            return Path(name).read_text(encoding="utf-8")
        except OSError:
            pass
    return os.environ.get("OVERNIGHT_PROMPT", "")


def main() -> int:
    """Run one model step; returns the exit code."""
    from overnight.config.settings import ConfigError, load_settings, mask_url

    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"model step: bad configuration: {exc}", file=sys.stderr)
        return 78
    prompt = _prompt()
    try:
        turn = int(os.environ.get("OVERNIGHT_TURN", "1"))
    except ValueError:
        turn = 1
    key = settings.model_api_key.get_secret_value() if settings.model_api_key else None
    if settings.model_url:
        print(
            f"model step: asking {mask_url(settings.model_url)} ({settings.model_name})", flush=True
        )
        try:
            answer = ask_model(
                settings.model_url, key, settings.model_name, prompt, settings.model_timeout
            )
        except ModelError as exc:
            print(f"model step: {exc}", file=sys.stderr, flush=True)
            return 1
        model, source = settings.model_name, "http"
    else:
        answer, model, source = echo_stub(prompt), STUB_MODEL, "stub"
    record = {
        "turn": turn,
        "task_id": os.environ.get("OVERNIGHT_TASK_ID"),
        "model": model,
        "source": source,
        "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
        "answer": answer,
    }
    path = write_answer(Path.cwd(), turn, record)
    digest = hashlib.sha256(answer.encode()).hexdigest()[:16]
    where = path.relative_to(Path.cwd())
    print(f"model step: wrote {where} ({source}, {len(answer)} chars, {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
