"""A git server for tests: ``git http-backend`` behind a small HTTP server that wants basic
auth (one user, one token) for every request, fetches and pushes alike.

Run as ``GITSERVER_TOKEN=T python gitserver.py ROOT USER [HOST]`` (the token in the
environment, not in an argv every process may read): serves the repositories under ROOT on
HOST (default 127.0.0.1) and a free port, prints ``listening PORT`` once ready, and appends
one line per request (``METHOD PATH STATUS``) to ROOT/../requests.log.

Imported, it makes the served project (:func:`make_project`) and starts the server
(:func:`start`).
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BACKEND = os.path.join(
    subprocess.run(
        ["git", "--exec-path"], capture_output=True, text=True, check=True
    ).stdout.strip(),
    "git-http-backend",
)


def serve(root: Path, user: str, token: str, host: str) -> None:
    want = "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()
    log = root.parent / "requests.log"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _note(self, status: int) -> None:
            with log.open("a") as fh:
                fh.write(f"{self.command} {self.path} {status}\n")

        def _handle(self) -> None:
            body = self._body() if self.command == "POST" else b""
            if self.headers.get("Authorization") != want:
                self._note(401)
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="git"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            path, _, query = self.path.partition("?")
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "GIT_PROJECT_ROOT": str(root),
                "GIT_HTTP_EXPORT_ALL": "1",
                "REMOTE_USER": user,
                "REQUEST_METHOD": self.command,
                "PATH_INFO": path,
                "QUERY_STRING": query,
                "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                "CONTENT_LENGTH": str(len(body)),
                "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
                "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
                "GIT_CONFIG_NOSYSTEM": "1",
                "HOME": str(root),
            }
            done = subprocess.run([BACKEND], input=body, env=env, capture_output=True, check=False)
            head, _, payload = done.stdout.partition(b"\r\n\r\n")
            if not _:
                head, _, payload = done.stdout.partition(b"\n\n")
            status, headers = 200, []
            for line in head.decode("latin-1").splitlines():
                name, _, value = line.partition(":")
                if name.lower() == "status":
                    status = int(value.split()[0])
                elif name:
                    headers.append((name, value.strip()))
            self._note(status)
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = _handle
        do_POST = _handle

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    server.daemon_threads = True
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


# What the task's agent runs (python3 agent.py SLOW), from the task's own tree: it keeps all
# it can see (its environment; the command line and environment of each process it can look
# at, its parents first; its repository's git config) in seen-<turn>.txt, which overnight
# commits and pushes; from turn 2 it fixes calc.py, except where its tree's path holds SLOW
# (a host's own state folder: in a sandbox, the host name is the sandbox's), where it beats
# until it is killed.
AGENT = """\
import os, pathlib, socket, subprocess, sys, time
turn = int(os.environ.get("OVERNIGHT_TURN", "0"))
host = socket.gethostname()
slow = sys.argv[1] if len(sys.argv) > 1 else ""
out = [f"host {host} turn {turn}"]
out += [f"env {k}={v}" for k, v in sorted(os.environ.items())]
def dump(pid, why):
    for part in ("cmdline", "environ"):
        try:
            data = pathlib.Path(f"/proc/{pid}/{part}").read_bytes().replace(b"\\0", b" ")
            text = data.decode(errors="replace")
        except OSError as exc:
            text = f"unreadable: {exc.strerror}"
        out.append(f"{why} {pid} {part} {text}")
pid, parents = os.getppid(), set()
while pid > 0 and pid not in parents:
    parents.add(pid)
    dump(pid, "parent")
    try:
        pid = int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        break
for entry in os.listdir("/proc"):
    if entry.isdigit() and int(entry) not in parents:
        dump(int(entry), "proc")
git = subprocess.run(["git", "config", "--list", "--show-origin"], capture_output=True, text=True)
out.append("git-config " + git.stdout + git.stderr)
pathlib.Path(f"seen-{turn}.txt").write_text("\\n".join(out) + "\\n")
with open("turns.txt", "a") as fh:
    fh.write(f"{turn} {host}\\n")
if turn >= 2 and slow and slow in os.getcwd():
    while True:
        print("working", time.time(), flush=True)
        time.sleep(0.2)
if turn >= 2:
    pathlib.Path("calc.py").write_text("def add(a, b):\\n    return a + b\\n")
"""
CALC = "def add(a, b):\n    return a - b\n"
CHECK = "from calc import add\nraise SystemExit(0 if add(2, 3) == 5 else 1)\n"


def git(cwd: Path, *argv: str) -> str:
    done = subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True, text=True)
    return done.stdout


def make_project(root: Path, name: str = "project.git") -> Path:
    """A bare repository ROOT/NAME holding calc.py (with a bug), check.py and agent.py on
    its main branch (its HEAD)."""
    work = root.parent / "seed"
    work.mkdir(parents=True)
    git(work, "init", "-q", "-b", "main")
    for path, text in (("calc.py", CALC), ("check.py", CHECK), ("agent.py", AGENT)):
        (work / path).write_text(text)
    git(work, "add", "-A")
    git(work, "-c", "user.name=T", "-c", "user.email=t@example.invalid", "commit", "-qm", "base")
    bare = root / name
    root.mkdir(parents=True, exist_ok=True)
    git(root, "clone", "-q", "--bare", str(work), name)
    git(bare, "config", "http.receivepack", "true")
    return bare


def start(
    root: Path, user: str, token: str, prefix: list[str] | None = None, host: str = "127.0.0.1"
) -> tuple[subprocess.Popen[bytes], int]:
    """The server for ROOT (run under ``prefix``, e.g. ``ip netns exec NS``); returns it
    and its port once it listens."""
    argv = [*(prefix or []), sys.executable, __file__, str(root), user, host]
    env = {**os.environ, "GITSERVER_TOKEN": token}
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    proc.stdout.close()
    if not line.startswith("listening "):
        proc.kill()
        raise RuntimeError(f"the git server did not start: {line!r}")
    return proc, int(line.split()[1])


def requests(root: Path) -> list[str]:
    log = root.parent / "requests.log"
    return log.read_text().splitlines() if log.exists() else []


if __name__ == "__main__":
    where = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    serve(Path(sys.argv[1]), sys.argv[2], os.environ.pop("GITSERVER_TOKEN"), where)
