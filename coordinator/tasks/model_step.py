"""The built-in model step, for tasks with no ``agent``.

Run as ``python -P -m overnight.coordinator.tasks.model_step``.

It reads the turn's prompt from ``$OVERNIGHT_PROMPT_FILE`` (else ``$OVERNIGHT_PROMPT``),
asks the OpenAI-compatible ``/v1/chat/completions`` endpoint at ``OVERNIGHT_MODEL_URL``
(bearer ``OVERNIGHT_MODEL_API_KEY``, bounded by ``OVERNIGHT_MODEL_TIMEOUT``), and writes
the answer under ``out/`` of its working directory: ``out/turn-NNN.json`` and
``out/answer.md``. With no URL a deterministic echo stub writes the same shape, with no
network. The API key is never printed. Exit 0 on an answer, 1 when the model failed.

Under a worker with a gateway the step asks the gateway, with the per-lease token its
environment holds (``OPENAI_API_KEY``), never the real key. Otherwise its environment
holds no key (worker.sandbox.stepenv): with
``OVERNIGHT_MODEL_SETTINGS=stdin`` the ``OVERNIGHT_MODEL_*`` values come instead as one JSON
object on stdin (:func:`settings_line`), a pipe the supervisor filled and closed before the
step started, so neither ``/proc/PID/environ`` nor a descendant ever shows the key. Run by
hand, the step reads the settings as every command does.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overnight.config import defaults
from overnight.config.errors import OvernightError

SYSTEM = (
    "You are the agent step of an unattended task. Answer with what to change so that "
    "the failing checks pass. Be concise."
)
STUB_MODEL = "echo-stub"
MAX_ERROR_BODY = 300
SETTINGS_VAR = "OVERNIGHT_MODEL_SETTINGS"
MODEL_VARS = (
    "OVERNIGHT_MODEL_URL",
    "OVERNIGHT_MODEL_API_KEY",
    "OVERNIGHT_MODEL_NAME",
    "OVERNIGHT_MODEL_TIMEOUT",
)


@dataclass(frozen=True)
class ModelSettings:
    url: str | None
    api_key: str | None
    name: str
    timeout: float


def settings_line(model_env: Mapping[str, str], gateway_url: str | None = None) -> bytes:
    """The model settings (``OVERNIGHT_MODEL_*`` names) as the step reads them on stdin.

    With a gateway the step asks the gateway (with the per-lease token its environment
    holds as ``OPENAI_API_KEY``) and is handed no upstream URL or key at all.
    """
    values = {k: v for k, v in model_env.items() if k in MODEL_VARS}
    if gateway_url is not None:
        values.pop("OVERNIGHT_MODEL_API_KEY", None)
        values["OVERNIGHT_MODEL_URL"] = gateway_url.rstrip("/") + "/v1"
    return json.dumps(values).encode() + b"\n"


def settings_from_line(line: bytes) -> ModelSettings:
    """Parse :func:`settings_line` with the settings' own rules; ``ValueError`` names the
    variable (never the value)."""
    from overnight.config.validate import RULES

    try:
        data = json.loads(line or b"{}")
    except ValueError:
        raise ValueError("stdin: not a JSON object") from None
    if not isinstance(data, dict):
        raise ValueError("stdin: not a JSON object")
    values: dict[str, Any] = {
        "model_name": defaults.MODEL_NAME,
        "model_timeout": defaults.MODEL_TIMEOUT,
    }
    for var in MODEL_VARS:
        if data.get(var) in (None, ""):
            continue
        field = var.removeprefix("OVERNIGHT_").lower()
        try:
            values[field] = RULES[field](data[var])
        except ValueError as exc:
            raise ValueError(f"{var}: {exc}") from None
    return ModelSettings(
        values.get("model_url"),
        values.get("model_api_key"),
        values["model_name"],
        values["model_timeout"],
    )


def _settings() -> ModelSettings:
    if os.environ.get(SETTINGS_VAR) == "stdin":
        return settings_from_line(sys.stdin.buffer.read(65536))
    from overnight.config.settings import ConfigError, load_settings

    try:
        s = load_settings()
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    key = s.model_api_key.get_secret_value() if s.model_api_key else None
    return ModelSettings(s.model_url, key, s.model_name, s.model_timeout)


class ModelError(OvernightError):
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
    from overnight.config.validate import mask_url

    try:
        settings = _settings()
    except ValueError as exc:
        print(f"model step: bad configuration: {exc}", file=sys.stderr)
        return 78
    prompt = _prompt()
    try:
        turn = int(os.environ.get("OVERNIGHT_TURN", "1"))
    except ValueError:
        turn = 1
    if settings.url:
        print(f"model step: asking {mask_url(settings.url)} ({settings.name})", flush=True)
        try:
            # Under a gateway the key is the step's own per-lease token.
            key = settings.api_key or os.environ.get("OPENAI_API_KEY")
            answer = ask_model(settings.url, key, settings.name, prompt, settings.timeout)
        except ModelError as exc:
            print(f"model step: {exc}", file=sys.stderr, flush=True)
            return 1
        model, source = settings.name, "http"
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
