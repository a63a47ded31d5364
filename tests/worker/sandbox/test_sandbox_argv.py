"""The sandbox's launch argv (pure), as tables: what is bound, how, and in which order."""

from __future__ import annotations

import pytest

from overnight.worker.sandbox.bwrap import (
    GATEWAY_SOCKET,
    HomeFile,
    SandboxSpec,
    group_text,
    launch_argv,
    passwd_text,
    writable_problem,
)
from overnight.worker.sandbox.launch import hidden_from

TOP = {"usr": None, "bin": "usr/bin", "lib": "usr/lib", "etc": None}


def spec(**more: object) -> SandboxSpec:
    base: dict[str, object] = {
        "argv": ("agent", "--go"),
        "worktree": "/state/wt/t1",
        "cwd": "/state/wt/t1/sub",
        "uid": 2001,
        "gid": 2001,
        "home": "/home/step",
        "passwd_fd": 3,
        "group_fd": 4,
        "top": TOP,
    }
    base.update(more)
    return SandboxSpec(**base)  # type: ignore[arg-type]


def pairs(argv: list[str], option: str) -> list[tuple[str, str]]:
    """Every ``option A B`` in ``argv``, as (A, B)."""
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == option]


def tail(argv: list[str]) -> list[str]:
    """What bwrap runs: everything after bwrap's own ``--``."""
    start = argv.index("--chdir")
    return argv[argv.index("--", start) + 1 :]


@pytest.mark.parametrize(
    ("more", "head"),
    [
        ({}, ["bwrap", "--die-with-parent", "--new-session"]),
        (
            {"switch_uid": True},
            [
                "setpriv",
                "--reuid=2001",
                "--regid=2001",
                "--clear-groups",
                "--",
                "bwrap",
                "--die-with-parent",
            ],
        ),
        (
            {"switch_uid": True, "groups": (5, 6)},
            ["setpriv", "--reuid=2001", "--regid=2001", "--groups=5,6", "--", "bwrap"],
        ),
    ],
)
def test_the_uid_is_taken_before_bwrap(more: dict[str, object], head: list[str]) -> None:
    argv = launch_argv(spec(**more))
    assert argv[: len(head)] == head


@pytest.mark.parametrize(("unprivileged", "own_userns"), [(True, True), (False, False)])
def test_no_nested_user_namespace_when_unprivileged(unprivileged: bool, own_userns: bool) -> None:
    argv = launch_argv(spec(unprivileged=unprivileged))
    assert ("--disable-userns" in argv) is own_userns
    assert ("--unshare-user" in argv) is own_userns


@pytest.mark.parametrize(
    ("network", "unshared"),
    [("none", True), ("host", False)],
)
def test_namespaces(network: str, unshared: bool) -> None:
    argv = launch_argv(spec(network=network))
    for option in ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--cap-drop"):
        assert option in argv
    assert ("--unshare-net" in argv) is unshared


def test_system_folders_read_only_links_as_links_nothing_else_of_the_host() -> None:
    argv = launch_argv(spec())
    assert pairs(argv, "--ro-bind")[:2] == [("/usr", "/usr"), ("/etc", "/etc")]
    assert ("usr/bin", "/bin") in pairs(argv, "--symlink")
    assert ("usr/lib", "/lib") in pairs(argv, "--symlink")
    sources = {a for a, _ in pairs(argv, "--ro-bind") + pairs(argv, "--bind")}
    assert sources == {"/usr", "/etc", "/state/wt/t1"}
    assert "/" not in sources


def test_unreadable_system_files_are_emptied_after_etc_is_bound() -> None:
    argv = launch_argv(spec(hidden_files=("/etc/shadow",), hidden_dirs=("/etc/ssl/private",)))
    assert ("/dev/null", "/etc/shadow") in pairs(argv, "--ro-bind")
    at = argv.index("/etc/ssl/private")
    assert argv[at - 1] == "--tmpfs" and at > argv.index("/etc")
    assert argv.index("/etc/shadow") > argv.index("/etc")


def test_worktree_and_extra_paths() -> None:
    argv = launch_argv(spec(readable=("/prompts/t1",), writable=("/cache",), sockets=("/run/b/s",)))
    assert ("/state/wt/t1", "/state/wt/t1") in pairs(argv, "--bind")
    assert ("/cache", "/cache") in pairs(argv, "--bind")
    assert ("/prompts/t1", "/prompts/t1") in pairs(argv, "--ro-bind")
    assert ("/run/b/s", "/run/b/s") in pairs(argv, "--ro-bind")
    assert argv[argv.index("--chdir") + 1] == "/state/wt/t1/sub"
    assert tail(argv) == ["agent", "--go"]


def test_read_only_binds_come_after_the_writable_ones() -> None:
    argv = launch_argv(spec(readable=("/state/wt/t1/.git",), writable=("/cache",)))
    assert argv.index("/state/wt/t1/.git") > argv.index("/cache") > argv.index("/state/wt/t1")


def test_private_tmp_and_home_with_generated_identity() -> None:
    argv = launch_argv(spec(home_files=(HomeFile(".codex/config.toml", 7), HomeFile("a.txt", 8))))
    tmpfs = [argv[i + 1] for i, a in enumerate(argv) if a == "--tmpfs"]
    assert tmpfs == ["/tmp", "/var/tmp", "/dev/shm", "/home/step"]
    at = argv.index("/home/step")
    assert argv[at - 3 : at] == ["--perms", "0700", "--tmpfs"]
    assert pairs(argv, "--ro-bind-data") == [("3", "/etc/passwd"), ("4", "/etc/group")]
    assert ("7", "/home/step/.codex/config.toml") in pairs(argv, "--file")
    assert ("8", "/home/step/a.txt") in pairs(argv, "--file")
    at = argv.index("/home/step/.codex")
    assert argv[at - 1] == "--dir" and at < argv.index("/home/step/.codex/config.toml")
    assert argv[argv.index("--proc") : argv.index("--proc") + 2] == ["--proc", "/proc"]


def test_the_gateway_socket_is_bridged_to_the_base_url_port() -> None:
    bridge = ("/usr/bin/python3", "-I", "-S", "-c", "CODE")
    argv = launch_argv(spec(gateway_socket="/srv/gw.sock", gateway_port=4680, bridge=bridge))
    assert ("/srv/gw.sock", GATEWAY_SOCKET) in pairs(argv, "--ro-bind")
    assert tail(argv) == [*bridge, "4680", GATEWAY_SOCKET, "--", "agent", "--go"]


def test_host_network_has_no_bridge() -> None:
    argv = launch_argv(spec(network="host", gateway_socket="/srv/gw.sock", gateway_port=1))
    assert tail(argv) == ["agent", "--go"]
    assert "/srv/gw.sock" not in argv


@pytest.mark.parametrize(
    "more",
    [
        {"gateway_socket": "/srv/gw.sock"},
        {"gateway_port": 4680},
        {"gateway_socket": "/srv/gw.sock", "gateway_port": 4680},  # no bridge argv
    ],
)
def test_a_half_gateway_is_refused(more: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="gateway"):
        launch_argv(spec(**more))


@pytest.mark.parametrize(
    ("user", "uid", "gid", "home", "line"),
    [
        ("overnight-step", 999, 995, "/home/overnight-step", "overnight-step:x:999:995:"),
        ("root", 0, 0, "/root", "root:x:0:0:"),
    ],
)
def test_passwd_names_the_uid(user: str, uid: int, gid: int, home: str, line: str) -> None:
    text = passwd_text(user, uid, gid, home)
    entries = [row for row in text.splitlines() if row.split(":")[2] == str(uid)]
    assert len(entries) == 1 and entries[0].startswith(line)
    assert entries[0].split(":")[5] == home
    assert f":{gid}:" in group_text(user, gid)


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/state/wt/t1", None),
        ("/tmp/overnight-sbx/wt", None),
        ("/", "would expose the host"),
        ("/usr", "would expose the host"),
        ("/etc/cron.d", "would expose the host"),
        ("/state/../usr", "would expose the host"),
        ("/run/overnight/x", "would expose the host"),
        ("/tmp", "would expose the host"),
        ("/home/", "would expose the host"),
        ("/home/alice/project", None),
        ("/var/lib/overnight/worktrees/t1", None),
        ("wt", "not an absolute path"),
    ],
)
def test_what_may_be_bound_read_write(path: str, problem: str | None) -> None:
    found = writable_problem(path)
    assert (found is None) if problem is None else (problem in (found or ""))
    if problem is not None:
        with pytest.raises(ValueError, match="cannot bind read-write"):
            launch_argv(spec(worktree=path))


@pytest.mark.parametrize(
    ("tree", "kept"),
    [
        ("/srv/proj", ["/opt/venv", "/srv/projx/pkg"]),
        ("/srv", ["/opt/venv"]),  # a task on overnight's own repository edits its code
    ],
)
def test_own_code_inside_the_tree_is_the_trees(tree: str, kept: list[str]) -> None:
    from overnight.worker.sandbox.launch import _outside

    assert _outside(["/opt/venv", "/srv/projx/pkg"], tree) == kept


SECRETS = (("/etc/shadow", 0, 42), ("/etc/redis", 105, 110), ("/etc/mine", 61184, 61184))


@pytest.mark.parametrize(
    ("uid", "gids", "emptied"),
    [
        (0, (0,), ["/etc/shadow", "/etc/redis", "/etc/mine"]),  # root reads them all
        (61184, (61184,), ["/etc/mine"]),  # a task's uid: only what it owns
        (61185, (61185,), []),  # in the others' class of each: nothing to hide
        (1000, (1000, 42), ["/etc/shadow"]),  # a step user in the shadow group
        (105, (105,), ["/etc/redis"]),  # the owner
    ],
)
def test_a_secret_is_emptied_for_whoever_could_read_it(
    uid: int, gids: tuple[int, ...], emptied: list[str]
) -> None:
    assert list(hidden_from(SECRETS, uid, gids)) == emptied
