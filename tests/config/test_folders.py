"""overnight's own folders: the rule on what lstat says (a table), and folders made with
their mode whatever the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from overnight.config.exits import EXIT_BAD_CONFIG
from overnight.config.folders import FolderUnusable, folder_problem, make_folders, usable


def info(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("seen", "euid", "private", "problem"),
    [
        (None, 1000, False, None),
        (info(stat.S_IFDIR | 0o700, 1000), 1000, False, None),
        (info(stat.S_IFDIR | 0o711, 0), 0, False, None),
        (info(stat.S_IFDIR | 0o755, 1000), 1000, False, None),
        (info(stat.S_IFDIR | 0o755, 0), 1001, False, "it belongs to uid 0, not to uid 1001"),
        (info(stat.S_IFDIR | 0o777, 1000), 1000, False, "others can write it (mode drwxrwxrwx)"),
        (info(stat.S_IFDIR | 0o770, 1000), 1000, False, "others can write it (mode drwxrwx---)"),
        (info(stat.S_IFLNK | 0o777, 1000), 1000, False, "it is a symbolic link"),
        (info(stat.S_IFREG | 0o600, 1000), 1000, False, "it is not a folder"),
        (info(stat.S_IFDIR | 0o700, 1000), 1000, True, None),
        (info(stat.S_IFDIR | 0o711, 1000), 1000, True, "others can enter it (mode drwx--x--x)"),
        (info(stat.S_IFDIR | 0o757, 1000), 1000, True, "others can write it (mode drwxr-xrwx)"),
    ],
)
def test_folder_problem(
    seen: os.stat_result | None, euid: int, private: bool, problem: str | None
) -> None:
    got = folder_problem(seen, euid, private)
    if problem is None:
        assert got is None
    else:
        assert got is not None and got.startswith(problem)


def test_folders_get_their_mode_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        made = make_folders(tmp_path / "a" / "b" / "c", 0o711)
    finally:
        os.umask(old)
    for level in (tmp_path / "a", tmp_path / "a" / "b", made):
        assert stat.S_IMODE(level.stat().st_mode) == 0o711
    old = os.umask(0o077)
    try:
        make_folders(tmp_path / "a" / "d", 0o711)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "d").stat().st_mode) == 0o711
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o711  # an existing one is kept
    make_folders(tmp_path / "e" / "f", 0o700, above=0o711)
    assert stat.S_IMODE((tmp_path / "e").stat().st_mode) == 0o711
    assert stat.S_IMODE((tmp_path / "e" / "f").stat().st_mode) == 0o700


def test_an_unusable_folder_is_one_line_naming_the_path_and_the_fix(tmp_path: Path) -> None:
    open_to_all = tmp_path / "shared"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(FolderUnusable) as caught:
        usable(open_to_all, 0o700, "set OVERNIGHT_STATE_DIR to a folder of your own")
    assert caught.value.exit_code == EXIT_BAD_CONFIG
    assert caught.value.message == (
        f"cannot use {open_to_all}: others can write it (mode drwxrwxrwx); "
        "set OVERNIGHT_STATE_DIR to a folder of your own"
    )
    mine = usable(tmp_path / "mine" / "x", 0o700, "unused")  # its benign twin
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700


def test_a_folder_only_overnight_uses_gets_its_mode_back(tmp_path: Path) -> None:
    folder = tmp_path / "runtime"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(FolderUnusable):  # named by a person: refused, never changed
        usable(folder, 0o700, "fix", private=True)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    usable(folder, 0o700, "fix", private=True, own=True)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
