"""The allow_hosts proxy's rules as tables: which entries are rules, which requests parse,
which targets a rule lets through, which resolved addresses are refused; the sandbox's
argv with a proxy bridged in, and the bridge's forwards. Then the proxy itself on this
host's loopback only: what close() ends, what it says. No sandbox."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from overnight.worker.sandbox import bridge
from overnight.worker.sandbox.bwrap import GATEWAY_SOCKET, PROXY_SOCKET, SandboxSpec, launch_argv
from overnight.worker.sandbox.proxy import (
    SAID_EACH,
    HostRule,
    Proxy,
    address_problem,
    allowed,
    inside_port,
    parse_request,
    parse_rule,
    proxy_env,
)
from tests.helpers import wait_for

RULES = [
    parse_rule(text)
    for text in [
        "example.com",
        "Api.Example.org:8443",
        "*.pypi.org",
        "10.9.8.7:8080",
        "[2001:db8::1]:9000",
        "trailing.dot.",
    ]
]


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("example.com", HostRule("example.com", 443)),
        ("EXAMPLE.com.", HostRule("example.com", 443)),
        ("example.com:80", HostRule("example.com", 80)),
        ("*.pypi.org", HostRule("pypi.org", 443, wildcard=True)),
        ("*.pypi.org:80", HostRule("pypi.org", 80, wildcard=True)),
        ("10.9.8.7", HostRule("10.9.8.7", 443)),
        ("[2001:DB8:0::1]:9000", HostRule("2001:db8::1", 9000)),
        ("under_score.example", HostRule("under_score.example", 443)),
    ],
)
def test_entries_that_are_rules(text: str, rule: HostRule) -> None:
    assert parse_rule(text) == rule


@pytest.mark.parametrize(
    "text",
    [
        "",
        "user@example.com",
        "user:pw@example.com:443",
        "example.com:0",
        "example.com:65536",
        "example.com:+443",
        "example.com:\u0664\u0664\u0663",  # digits, but not ASCII ones
        "example.com:000443",
        "example.com:443:1",
        "2001:db8::1",  # an IPv6 address needs its brackets
        "[2001:db8::1",
        "[not-ip]:443",
        "http://example.com",
        "example.com/path",
        "exa mple.com",
        "example..com",
        "-example.com",
        "127.1",  # inet_aton's short form of 127.0.0.1
        "2130706433",  # and its integer form
        "0x7f.0.0.1",
        "010.9.8.7",
        "*.com",
        "*.10.0.0.1",
        "*example.com",
        "a.*.example.com",
        "exam%70le.com",
        "example.com\n",
    ],
)
def test_entries_that_are_not(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rule(text)


@pytest.mark.parametrize(
    ("host", "port", "ok"),
    [
        ("example.com", 443, True),
        ("EXAMPLE.COM", 443, True),  # case
        ("example.com.", 443, True),  # one trailing dot
        ("example.com..", 443, False),
        ("example.com", 80, False),  # port
        ("www.example.com", 443, False),  # an exact rule covers no subdomain
        ("api.example.org", 8443, True),
        ("api.example.org", 443, False),
        ("files.pypi.org", 443, True),  # wildcard
        ("a.b.pypi.org", 443, True),
        ("pypi.org", 443, False),  # a wildcard is not its domain
        ("evilpypi.org", 443, False),
        ("pypi.org.evil.com", 443, False),
        ("files.pypi.org", 80, False),
        ("10.9.8.7", 8080, True),  # an IP literal listed as itself
        ("10.9.8.7", 443, False),
        ("10.9.8.8", 8080, False),  # IP literals refused unless listed
        ("127.0.0.1", 443, False),
        ("2001:db8::1", 9000, True),
        ("[2001:db8:0:0::1]", 9000, True),
        ("2001:db8::2", 9000, False),
        ("trailing.dot", 443, True),
        ("user@example.com", 443, False),  # userinfo
        ("example.com@evil.com", 443, False),
        ("", 443, False),
    ],
)
def test_which_targets_pass(host: str, port: int, ok: bool) -> None:
    assert allowed(host, port, RULES) is ok


def test_no_rules_let_nothing_through() -> None:
    assert not allowed("example.com", 443, ())


@pytest.mark.parametrize(
    ("address", "host", "refused"),
    [
        ("93.184.216.34", "example.com", False),
        ("10.1.2.3", "internal.example", False),
        ("127.0.0.1", "example.com", True),  # a name that leads to this host's services
        ("127.0.0.53", "example.com", True),
        ("::1", "example.com", True),
        ("::ffff:127.0.0.1", "example.com", True),
        ("0.0.0.0", "example.com", True),
        ("169.254.169.254", "example.com", True),  # link-local (cloud metadata)
        ("fe80::1%eth0", "example.com", True),
        ("224.0.0.1", "example.com", True),
        ("127.0.0.1", "127.0.0.1", False),  # listed as itself: the task asked for it
        ("169.254.169.254", "169.254.169.254", False),
    ],
)
def test_which_resolved_addresses_are_refused(address: str, host: str, refused: bool) -> None:
    assert (address_problem(address, host) is not None) is refused


@pytest.mark.parametrize(
    ("head", "host", "port", "connect"),
    [
        ("CONNECT example.com:443 HTTP/1.1", "example.com", 443, True),
        ("CONNECT Example.COM.:443 HTTP/1.0", "example.com", 443, True),
        ("CONNECT [2001:db8::1]:9000 HTTP/1.1", "2001:db8::1", 9000, True),
        ("GET http://example.com/x?y=1 HTTP/1.1", "example.com", 80, False),
        ("POST http://10.9.8.7:8080 HTTP/1.1", "10.9.8.7", 8080, False),
        ("GET http://example.com?q HTTP/1.1", "example.com", 80, False),
    ],
)
def test_requests_that_parse(head: str, host: str, port: int, connect: bool) -> None:
    request = parse_request(f"{head}\r\nHost: x\r\n\r\n".encode())
    assert (request.host, request.port, request.connect) == (host, port, connect)


@pytest.mark.parametrize(
    "head",
    [
        "CONNECT example.com HTTP/1.1",  # no port
        "CONNECT user@example.com:443 HTTP/1.1",
        "CONNECT example.com:443 HTTP/2.0",
        "CONNECT example.com:443",
        "CONNECT  example.com:443 HTTP/1.1",
        "GET / HTTP/1.1",  # origin-form: not a proxy request
        "GET https://example.com/ HTTP/1.1",  # TLS is CONNECT's
        "GET http://user:pw@example.com/ HTTP/1.1",
        "GET http://allowed.com@evil.com/ HTTP/1.1",
        "GET http://127.1/ HTTP/1.1",
        "get http://example.com/ HTTP/1.1",
        "GET ftp://example.com/ HTTP/1.1",
        "GET http://exa\u00e9mple.com/ HTTP/1.1",
    ],
)
def test_requests_that_are_refused(head: str) -> None:
    with pytest.raises(ValueError):
        parse_request(f"{head}\r\n\r\n".encode())


def test_a_plain_request_goes_upstream_in_origin_form_without_proxy_headers() -> None:
    head = (
        b"GET http://example.com:8080/a?b HTTP/1.1\r\nHost: evil.com\r\n"
        b"Proxy-Authorization: secret\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n"
    )
    sent = parse_request(head).head.decode()
    assert sent.startswith("GET /a?b HTTP/1.1\r\nHost: example.com:8080\r\n")
    assert "Accept: */*" in sent and "Connection: close\r\n\r\n" in sent
    assert "evil.com" not in sent and "secret" not in sent and "keep-alive" not in sent


def test_the_step_env_points_at_the_proxy_and_keeps_loopback_direct() -> None:
    env = proxy_env(3128)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        assert env[name] == "http://127.0.0.1:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1"
    assert inside_port(None) == inside_port(4680) == 3128
    assert inside_port(3128) == 3129  # never the gateway's port


def _spec(**more: object) -> SandboxSpec:
    base: dict[str, object] = {
        "argv": ("agent",),
        "worktree": "/srv/wt",
        "cwd": "/srv/wt",
        "uid": 999,
        "gid": 995,
        "home": "/home/step",
        "passwd_fd": 3,
        "group_fd": 4,
        "top": {"usr": None},
    }
    return SandboxSpec(**{**base, **more})  # type: ignore[arg-type]


BRIDGE = ("/usr/bin/python3", "-I", "-S", "-c", "CODE")


def test_the_proxy_is_bound_in_and_bridged_beside_the_gateway() -> None:
    argv = launch_argv(
        _spec(
            gateway_socket="/srv/gw.sock",
            gateway_port=4680,
            proxy_socket="/srv/px.sock",
            proxy_port=3128,
            bridge=BRIDGE,
        )
    )
    at = argv.index("/srv/px.sock")
    assert argv[at - 1 : at + 2] == ["--ro-bind", "/srv/px.sock", PROXY_SOCKET]
    cut = argv.index(BRIDGE[0], at)
    assert argv[cut:] == [*BRIDGE, "4680", GATEWAY_SOCKET, "3128", PROXY_SOCKET, "--", "agent"]


def test_a_proxy_without_a_gateway_is_bridged_alone() -> None:
    argv = launch_argv(_spec(proxy_socket="/srv/px.sock", proxy_port=3128, bridge=BRIDGE))
    assert argv[-9:] == [*BRIDGE, "3128", PROXY_SOCKET, "--", "agent"]
    assert GATEWAY_SOCKET not in argv


@pytest.mark.parametrize(
    "more",
    [
        {"proxy_socket": "/srv/px.sock"},
        {"proxy_port": 3128},
        {"proxy_socket": "/srv/px.sock", "proxy_port": 3128},  # no bridge argv
        {
            "proxy_socket": "/srv/px.sock",
            "proxy_port": 4680,
            "gateway_socket": "/srv/gw.sock",
            "gateway_port": 4680,
            "bridge": BRIDGE,
        },
    ],
)
def test_a_half_or_clashing_proxy_is_refused(more: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        launch_argv(_spec(**more))


def test_host_network_has_no_proxy() -> None:
    argv = launch_argv(
        _spec(network="host", proxy_socket="/srv/px.sock", proxy_port=3128, bridge=BRIDGE)
    )
    assert "/srv/px.sock" not in argv and argv[-1] == "agent"


@pytest.mark.parametrize(
    ("args", "parsed"),
    [
        (["4680", "/g", "--", "a"], ([(4680, "/g")], ["a"])),
        (
            ["4680", "/g", "3128", "/p", "--", "a", "--", "b"],
            ([(4680, "/g"), (3128, "/p")], ["a", "--", "b"]),
        ),
        (["4680", "/g", "--"], None),
        (["4680", "--", "a"], None),
        (["x", "/g", "--", "a"], None),
        (["--", "a"], None),
        (["4680", "/g", "a"], None),
    ],
)
def test_the_bridge_reads_its_forwards(
    args: list[str], parsed: tuple[list[tuple[int, str]], list[str]] | None
) -> None:
    assert bridge._forwards(args) == parsed


@pytest.fixture
def holder() -> Iterator[tuple[int, list[socket.socket]]]:
    """A loopback server that answers nothing and never closes what it accepted."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1], held
    server.close()
    for conn in held:
        conn.close()


def _ask(path: str, head: bytes) -> tuple[socket.socket, bytes]:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(10)
    client.connect(path)
    client.sendall(head)
    return client, client.recv(4096)


def test_close_ends_a_tunnel_the_far_end_holds_open(
    holder: tuple[int, list[socket.socket]],
) -> None:
    port, held = holder
    said: list[bytes] = []
    proxy = Proxy([parse_rule(f"127.0.0.1:{port}")], lease_id="l1", task_id="t1", say=said.append)
    client, answer = _ask(proxy.path, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 200"), answer
    wait_for(lambda: held)
    proxy.close()
    assert client.recv(100) == b""  # ended by close, though the far end never closed
    assert not os.path.exists(proxy.path) and said == []  # nothing refused, nothing said
    client.close()


def test_refusals_past_the_first_twenty_are_counted_not_said() -> None:
    said: list[bytes] = []
    proxy = Proxy([parse_rule("example.com")], lease_id="l2", task_id="t2", say=said.append)
    try:
        for i in range(SAID_EACH + 5):
            client, answer = _ask(proxy.path, f"CONNECT h{i}.example:443 HTTP/1.1\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.1 403"), answer
            client.close()
        assert len(said) == SAID_EACH  # each counted and said before its 403
    finally:
        proxy.close()
    assert said[0] == b"overnight: task t2: proxy refused h0.example:443: not in allow_hosts\n"
    assert said[-1].startswith(b"overnight: task t2: proxy refused 25 connection(s) (h0.example")
    assert b"and 15 more); 0 let through" in said[-1]
    assert len(said) == SAID_EACH + 1
