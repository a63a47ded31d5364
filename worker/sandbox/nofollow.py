"""Acting on trees a step controls without following them.

overnight (root, often) removes a step's scratch HOME, commits and copies a task's tree and
appends to step logs, in folders a step can write while overnight works in them. Every such
act here is relative to a folder's file descriptor: a folder is entered with
``O_NOFOLLOW | O_DIRECTORY``, listed through its descriptor, made writable through its
descriptor (never by a path a link may have been swapped into), and a link is only ever
removed or read as a link. :func:`follow_ok` is the one rule for the few links followed (in
folders no one but root or overnight's own user can write).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
APPEND_FLAGS = (
    os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
) | os.O_NONBLOCK


def follow_ok(folder: os.stat_result, euid: int) -> bool:
    """True if a link found in ``folder`` may be followed: only root or ``euid`` owns it and
    no one else can write it (a system link such as ``/var/run``), never one in ``/tmp``."""
    return folder.st_uid in (0, euid) and not folder.st_mode & 0o022


def closed_mode(mode: int) -> int:
    """``mode`` with no one but the owner writing, and no set-id or sticky bit: what a
    folder of overnight's others could write, or a copy of a step's file, gets."""
    return stat.S_IMODE(mode) & 0o755


def split(rel: str) -> list[str]:
    """The parts of a '/'-path relative to a tree; raises ``OSError`` for an empty part,
    ``.``, ``..`` or an absolute path."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise OSError(errno.EINVAL, f"not a plain relative path: {rel!r}")
    return parts


# --- removal ----------------------------------------------------------------------------------


def _enter_to_remove(parent: int, name: str) -> int | None:
    """A descriptor of the folder ``name`` in ``parent`` with its owner's rwx on (None: it is
    not a folder, or is gone). A folder its owner cannot list is opened as a path first and
    made listable through that descriptor's /proc link: the very inode, never a name."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except (NotADirectoryError, FileNotFoundError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        if exc.errno != errno.EACCES:
            raise
        path_fd = os.open(
            name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent
        )
        try:
            os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
            # The magic link is the opened inode itself: following it follows no name.
            fd = os.open(f"/proc/self/fd/{path_fd}", DIR_FLAGS & ~os.O_NOFOLLOW)
        finally:
            os.close(path_fd)
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o700)
    return fd


def _unlink(parent: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=parent)


def remove_at(parent: int, name: str) -> None:
    """Remove ``name`` in the folder ``parent`` (a descriptor) and all it holds, never
    following a link: a link is removed as a link, wherever it points, at any depth."""
    info = _lstat(parent, name)
    if info is None:
        return
    if not stat.S_ISDIR(info.st_mode):
        _unlink(parent, name)
        return
    # An explicit stack (each level's descriptor and what is left to remove in it), so
    # a deep tree is neither a RecursionError nor a name walked again from the top.
    top = _enter_to_remove(parent, name)
    if top is None:
        _unlink(parent, name)
        return
    stack: list[tuple[int, str, Iterator[os.DirEntry[str]]]] = [(top, name, _entries(top))]
    try:
        while stack:
            fd, folder, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                os.close(fd)
                above = stack[-1][0] if stack else parent
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(folder, dir_fd=above)
                continue
            if entry.is_dir(follow_symlinks=False):
                sub = _enter_to_remove(fd, entry.name)
                if sub is not None:
                    stack.append((sub, entry.name, _entries(sub)))
                    continue
            _unlink(fd, entry.name)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _entries(fd: int) -> Iterator[os.DirEntry[str]]:
    # Listed whole before any removal: removing while a directory stream is open may skip.
    with os.scandir(fd) as it:
        entries = list(it)
    return iter(entries)


def _lstat(parent: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


def remove_path(path: Path | str) -> None:
    """Remove ``path`` and all it holds without following a link below (or at) it; the
    folders above it are overnight's own and are walked as usual."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if not name:
        raise OSError(errno.EINVAL, f"refusing to remove {path!r}")
    try:
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        remove_at(pfd, name)
    finally:
        os.close(pfd)


# --- opening beneath a tree -------------------------------------------------------------------


def open_beneath(root: int, rel: str, flags: int = READ_FLAGS) -> int:
    """A descriptor of ``rel`` (a '/'-path) under the folder ``root``, every part entered
    without following a link; raises ``OSError`` (``ELOOP``, ``ENOTDIR``) where one is."""
    parts = split(rel)
    fd = os.dup(root)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)


def make_beneath(root: int, parts: list[str], mode: int) -> int:
    """A descriptor of the folder ``parts`` under ``root``, each missing folder made with
    ``mode`` (whatever the umask); a link or a file where a folder belongs is removed and
    replaced by a folder."""
    fd = os.dup(root)
    try:
        for part in parts:
            try:
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise
                remove_at(fd, part)
                os.mkdir(part, mode, dir_fd=fd)
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
                os.fchmod(nxt, mode)
            os.close(fd)
            fd = nxt
        return os.dup(fd)
    finally:
        os.close(fd)


# --- overnight's own files --------------------------------------------------------------------


def _walk_to(folder: str, own: int, euid: int) -> int:
    """A descriptor of ``folder``, walked from ``/``: a link followed only where
    :func:`follow_ok` allows and never as one of the last ``own`` levels, missing folders
    made (0711, the last ``own`` 0700), and the last ``own`` levels required to be
    ``euid``'s and closed to others' writes."""
    parts = [p for p in folder.split("/") if p]
    mine = len(parts) - own
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            mode = 0o700 if i >= mine else 0o711
            here = os.fstat(fd)
            with contextlib.suppress(FileExistsError):
                if _lstat(fd, part) is None:
                    os.mkdir(part, mode, dir_fd=fd)
                    made = os.open(part, DIR_FLAGS, dir_fd=fd)
                    os.fchmod(made, mode)
                    os.close(made)
            info = _lstat(fd, part)
            flags = DIR_FLAGS
            link = info is not None and stat.S_ISLNK(info.st_mode)
            if link and i < mine and follow_ok(here, euid):
                flags &= ~os.O_NOFOLLOW
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
            if i >= mine:
                now = os.fstat(fd)
                if now.st_uid != euid:
                    raise OSError(errno.EPERM, f"{part!r} of {folder} is not this user's")
                if now.st_mode & 0o022:
                    os.fchmod(fd, closed_mode(now.st_mode))
        return os.dup(fd)
    finally:
        os.close(fd)


def open_append(path: Path | str, *, own: int = 2, mode: int = 0o600) -> int:
    """A descriptor to append to overnight's own file ``path`` (made ``mode`` whatever the
    umask): its folders are walked from ``/`` as :func:`_walk_to` says (the last ``own`` are
    overnight's), and the file must be a plain file of this user's with one link, never one
    a link or a hard link someone planted leads to. Raises ``OSError`` otherwise."""
    full = os.path.abspath(path)
    folder, name = os.path.split(full)
    euid = os.geteuid()
    dfd = _walk_to(folder, own, euid)
    try:
        fd = os.open(name, APPEND_FLAGS, mode, dir_fd=dfd)
    finally:
        os.close(dfd)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != euid or info.st_nlink != 1:
        os.close(fd)
        raise OSError(errno.EPERM, f"{full} is not a plain file of this user's")
    if stat.S_IMODE(info.st_mode) != mode:
        os.fchmod(fd, mode)
    return fd


# --- copying a tree ---------------------------------------------------------------------------


def copy_tree(src: Path | str, dst: Path | str) -> None:
    """Copy the tree at ``src`` to the new folder ``dst`` as this user's: folders, plain
    files (their mode bits, others' write off) and links as links, each read through a
    descriptor reached without following a link; anything else (a FIFO, a device, a hard
    link to a file the tree's owner does not own) is left out."""
    top = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    owner = os.fstat(top).st_uid
    os.mkdir(dst, 0o700)
    out = os.open(dst, DIR_FLAGS)
    stack: list[tuple[int, int, Iterator[os.DirEntry[str]]]] = [(top, out, _entries(top))]
    try:
        while stack:
            sfd, dfd, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                os.fchmod(dfd, closed_mode(os.fstat(sfd).st_mode))
                os.close(sfd)
                os.close(dfd)
                continue
            pushed = _copy_entry(sfd, dfd, entry, owner)
            if pushed is not None:
                stack.append((*pushed, _entries(pushed[0])))
    finally:
        for sfd, dfd, _ in stack:
            os.close(sfd)
            os.close(dfd)


def _copy_entry(sfd: int, dfd: int, entry: os.DirEntry[str], owner: int) -> tuple[int, int] | None:
    """Copy one entry; a folder is made and returned (source, copy) to be filled."""
    name = entry.name
    try:
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
            return None
        if stat.S_ISDIR(info.st_mode):
            sub = os.open(name, DIR_FLAGS, dir_fd=sfd)
            try:
                os.mkdir(name, 0o700, dir_fd=dfd)
                return sub, os.open(name, DIR_FLAGS, dir_fd=dfd)
            except OSError:
                os.close(sub)
                raise
        if not stat.S_ISREG(info.st_mode):
            return None
        fd = os.open(name, READ_FLAGS, dir_fd=sfd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return None  # swapped or gone while the tree was read
        raise
    with os.fdopen(fd, "rb") as fh:
        now = os.fstat(fh.fileno())
        if not stat.S_ISREG(now.st_mode) or (now.st_nlink > 1 and now.st_uid != owner):
            return None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(name, flags, 0o600, dir_fd=dfd), "wb") as dest:
            while chunk := fh.read(1 << 20):
                dest.write(chunk)
            os.fchmod(dest.fileno(), closed_mode(now.st_mode))
    return None
