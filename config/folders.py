"""overnight's own folders: made with the mode they need whatever the umask, and checked at
start, so a folder it cannot use is one line naming the path and the fix before any task is
taken (never a worker that dies on its first task).

:func:`folder_problem` is the rule, on what ``lstat`` said; :func:`usable` applies it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from overnight.config.exits import EXIT_BAD_CONFIG, CommandError


class FolderUnusable(CommandError):
    """A folder overnight must write is not its own (exit 78, one line: path and fix)."""

    def __init__(self, path: Path, why: str, fix: str) -> None:
        super().__init__(f"cannot use {path}: {why}; {fix}", EXIT_BAD_CONFIG)
        self.path = path


def folder_problem(info: os.stat_result | None, euid: int, private: bool = False) -> str | None:
    """Why a folder of overnight's, as ``lstat`` saw it (None: missing, to be made), is not
    usable by uid ``euid``: not a folder, a link, someone else's, writable by others (or,
    ``private``, open to them at all)."""
    if info is None:
        return None
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != euid:
        return f"it belongs to uid {info.st_uid}, not to uid {euid} that overnight runs as"
    if info.st_mode & (0o077 if private else 0o022):
        what = (
            "others can enter it" if private and not info.st_mode & 0o022 else "others can write it"
        )
        return f"{what} (mode {stat.filemode(info.st_mode)})"
    return None


def make_folders(path: Path, mode: int, above: int | None = None) -> Path:
    """``path`` and each missing folder above it, made with ``mode`` exactly (those above
    with ``above``, if given; the umask does not apply); folders that exist keep theirs.
    Returns ``path``."""
    missing = []
    level = path
    while not os.path.lexists(level) and level != level.parent:
        missing.append(level)
        level = level.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode)
        except FileExistsError:
            continue
        os.chmod(folder, mode if folder == path or above is None else above)
    return path


def usable(path: Path, mode: int, fix: str, *, private: bool = False, own: bool = False) -> Path:
    """Make ``path`` (see :func:`make_folders`) and check it is this user's own (and, if
    ``private``, closed to others), or raise :class:`FolderUnusable` naming it and ``fix``.
    ``own``: a folder only overnight uses (not one a person named), so one of this user's
    with another mode gets ``mode``."""
    try:
        make_folders(path, mode)
        info: os.stat_result | None = os.lstat(path)
        fixable = own and info is not None and folder_problem(info, os.geteuid()) is None
        if fixable and info is not None and stat.S_IMODE(info.st_mode) != mode:
            os.chmod(path, mode)
            info = os.lstat(path)
    except OSError as exc:
        raise FolderUnusable(path, exc.strerror or str(exc), fix) from None
    why = folder_problem(info, os.geteuid(), private)
    if why is not None:
        raise FolderUnusable(path, why, fix)
    if not os.access(path, os.W_OK | os.X_OK):
        raise FolderUnusable(path, "this user cannot write it", fix)
    return path
