"""The gateway's cost: added latency per request, added time to first byte, 200 concurrent
streams, and the gateway's memory.

Run: ``.venv/bin/python -m bench.gateway`` (about a minute). It starts a private
redis-server, the scripted upstream of the tests (``tests/scripted_upstream.py``) and
``overnight gateway``, then measures the same requests sent to the upstream directly and
through the gateway, interleaved: non-streaming latency (p50, p99), streaming time to first
byte, and 200 streams held at once (all answered 200, each read to its end). With
``--litellm BIN`` (the ``litellm`` command of a bench-only venv: ``pip install
'litellm[proxy]'``, never the project's) LiteLLM's proxy is measured the same way on the same
upstream in the same run. Goals: p50 added <= 2 ms and <= 0.5 x LiteLLM's, 200
concurrent streams on this machine, gateway RSS <= 80 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.gateway.grant import Grant, mint
from overnight.worker.lease.store import Leases

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / "tests" / "scripted_upstream.py"
OVERNIGHT = str(Path(sys.executable).with_name("overnight"))
NAMESPACE = "bench-gw"
LITELLM_KEY = "sk-bench-" + "0123456789abcdef" * 4
BODY = json.dumps(
    {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hello " * 50}]}
)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _request(conn: http.client.HTTPConnection, token: str, stream: bool) -> float:
    """Seconds to the whole answer (JSON) or to its first byte (stream)."""
    body = BODY if not stream else BODY[:-1] + ', "stream": true}'
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body, headers)
    resp = conn.getresponse()
    if stream:
        resp.read(1)
        first = time.perf_counter() - started
        resp.read()
        return first
    resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}")
    return time.perf_counter() - started


def _connect(url: str) -> http.client.HTTPConnection:
    where = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=30)


def _paired(direct: str, gateway: str, token: str, n: int, stream: bool) -> dict[str, float]:
    a, b = _connect(direct), _connect(gateway)
    for _ in range(20):  # warm both paths
        _request(a, token, stream)
        _request(b, token, stream)
    plain, through = [], []
    for _ in range(n):
        plain.append(_request(a, token, stream))
        through.append(_request(b, token, stream))
    ms = 1000.0
    return {
        "direct_p50_ms": round(statistics.median(plain) * ms, 3),
        "gateway_p50_ms": round(statistics.median(through) * ms, 3),
        "added_p50_ms": round((statistics.median(through) - statistics.median(plain)) * ms, 3),
        "direct_p99_ms": round(_pct(plain, 0.99) * ms, 3),
        "gateway_p99_ms": round(_pct(through, 0.99) * ms, 3),
        "added_p99_ms": round((_pct(through, 0.99) - _pct(plain, 0.99)) * ms, 3),
    }


async def _streams(url: str, token: str, count: int) -> dict[str, float]:
    body = json.loads(BODY) | {"model": "m-long", "stream": True}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> int | str:
            try:
                auth = {"Authorization": f"Bearer {token}"}
                async with session.post(
                    f"{url}/v1/chat/completions", json=body, headers=auth
                ) as resp:
                    await resp.read()
                    return resp.status
            except aiohttp.ClientError as exc:
                return type(exc).__name__

        started = time.perf_counter()
        statuses = await asyncio.gather(*(one() for _ in range(count)))
    seen: dict[str, int] = {}
    for status in statuses:
        seen[str(status)] = seen.get(str(status), 0) + 1
    return {
        "streams": count,
        "all_ok": all(s == 200 for s in statuses),
        "statuses": seen,
        "seconds": round(time.perf_counter() - started, 2),
    }


def _litellm(binary: str, direct: str, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """LiteLLM's proxy on a free port, routing model ``m`` to the same upstream."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = work / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: m\n    litellm_params:\n      model: openai/m\n"
        f"      api_base: {direct}/v1\n      api_key: sk-bench\n"
    )
    env = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": LITELLM_KEY}
    with (work / "litellm.log").open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            env=env,
            stdout=out,
            stderr=out,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health/liveliness", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"LiteLLM did not start: {(work / 'litellm.log').read_text()[-2000:]}")


def _rss_mb(pid: int) -> tuple[float, float]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--litellm", metavar="BIN", help="also measure LiteLLM's proxy")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(Path(tmp) / "redis", password=uuid.uuid4().hex) as server,
    ):
        up = subprocess.Popen([sys.executable, str(UPSTREAM)], stdout=subprocess.PIPE, text=True)
        assert up.stdout is not None
        direct = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
        env = {
            **os.environ,
            "OVERNIGHT_REDIS_URL": server.url,
            "OVERNIGHT_NAMESPACE": NAMESPACE,
            "OVERNIGHT_MODEL_URL": direct,
        }
        log = Path(tmp) / "gateway.log"
        with log.open("wb") as out:
            gw = subprocess.Popen([OVERNIGHT, "gateway", "--port", "0"], env=env, stderr=out)
        try:
            deadline = time.monotonic() + 20
            while "listening on " not in log.read_text():
                if time.monotonic() > deadline or gw.poll() is not None:
                    raise SystemExit(f"the gateway did not start: {log.read_text()}")
                time.sleep(0.05)
            url = log.read_text().split("listening on ")[1].split()[0]
            client = redis.Redis.from_url(server.url, decode_responses=True)
            keys = Keys(NAMESPACE)
            CallEnvelope(client, "default", NAMESPACE).reset(10**9)
            doc = Leases(client, keys).acquire(budget_sec=3600, gap_sec=600)
            token, _ = mint(client, keys, doc.lease_id, doc.token, Grant(url), 3600, 600)
            idle = _rss_mb(gw.pid)[0]
            report = {
                "json": _paired(direct, url, token, args.requests, stream=False),
                "stream_first_byte": _paired(direct, url, token, args.requests // 2, True),
                "concurrent": asyncio.run(_streams(url, token, args.streams)),
            }
            if args.litellm:
                lite, lite_url = _litellm(args.litellm, direct, Path(tmp))
                try:
                    report["litellm_json"] = _paired(
                        direct, lite_url, LITELLM_KEY, args.requests, stream=False
                    )
                    report["litellm_stream_first_byte"] = _paired(
                        direct, lite_url, LITELLM_KEY, args.requests // 2, True
                    )
                finally:
                    lite.terminate()
                    lite.wait(20)
                ours = report["json"]["added_p50_ms"]
                theirs = report["litellm_json"]["added_p50_ms"]
                report["added_p50_ratio_to_litellm"] = round(ours / theirs, 3) if theirs else None
            rss, peak = _rss_mb(gw.pid)
            report["gateway_rss_mb"] = {
                "idle": round(idle, 1),
                "after": round(rss, 1),
                "peak": round(peak, 1),
            }
            report["envelope"] = CallEnvelope(client, "default", NAMESPACE).snapshot().model_dump()
            print(json.dumps(report, indent=2))
        finally:
            errors = [line for line in log.read_text().splitlines() if "WARNING" in line]
            if errors:
                print(f"gateway warnings: {len(errors)}, first: {errors[0]}", file=sys.stderr)
            gw.terminate()
            gw.wait(10)
            up.terminate()
            up.wait(10)


if __name__ == "__main__":
    main()
