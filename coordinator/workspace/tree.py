"""The tree object of what a task's worktree holds, read without following a link.

overnight commits after an agent step as root, in a tree the step's user may still write
(another task's step of the same user). So nothing here reads by name: each path is
reached from the worktree's descriptor (:mod:`overnight.worker.sandbox.nofollow`), a link
is recorded as a link (mode 120000, its text the blob), and a file is hashed by git through
the very descriptor overnight opened (``/proc/self/fd/N``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import stat

from overnight.coordinator.workspace.git import Where, git, git_bytes
from overnight.worker.sandbox import nofollow


def tree_of(where: Where) -> str:
    """The tree object of what the worktree holds: tracked and untracked files, ignored ones
    left out, every blob hashed raw (plumbing only: no filter, hook or attribute runs, so a
    repository config the agent wrote cannot run a program as overnight). Every path is
    reached from the worktree's descriptor without following a link: a link is recorded as
    a link (its text the blob), a path under a link is not there, and a file is hashed from
    the descriptor overnight opened, never read again by name."""
    out = git(
        "ls-files",
        "-z",
        "--cached",
        "--others",
        "--exclude-standard",
        cwd=where.work_tree,
        at=where,
    )
    rels = sorted(set(filter(None, out.split("\0"))))
    rows: list[str] = []
    chunk = _chunk()
    root = os.open(where.work_tree, nofollow.DIR_FLAGS)
    try:
        owner = os.fstat(root).st_uid
        files: list[tuple[str, int, bool]] = []
        try:
            for rel in rels:
                if rel.endswith("/"):
                    continue  # a nested repository
                got = _open_entry(root, rel, owner)
                if isinstance(got, bytes):
                    sha = git_bytes("hash-object", "-w", "--stdin", at=where, data=got).strip()
                    rows.append(f"120000 {sha.decode()}\t{rel}")
                elif got is not None:
                    files.append((rel, *got))
                if len(files) >= chunk:
                    rows += _hash_files(where, files)
            rows += _hash_files(where, files)
        finally:
            for _, fd, _ in files:
                os.close(fd)
    finally:
        os.close(root)
    index = os.path.join(where.git_dir, "overnight-index")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(index)
    scratch = Where(where.git_dir, where.work_tree, index=index)
    data = "".join(f"{row}\0" for row in sorted(rows, key=_row_path)).encode(
        "utf-8", "surrogateescape"
    )
    git_bytes("update-index", "--add", "-z", "--index-info", at=scratch, data=data)
    tree = git("write-tree", at=scratch).strip()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(index)
    return tree


def _chunk() -> int:
    """How many descriptors to hold open at once while their files are hashed: half what
    this process may open, within 64..4096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft // 2 if soft != resource.RLIM_INFINITY else 4096
    return max(64, min(4096, room))


def _row_path(row: str) -> str:
    return row.partition("\t")[2]


def _open_entry(root: int, rel: str, owner: int) -> bytes | tuple[int, bool] | None:
    """What ``rel`` is under the tree ``root``: a link's text, or an open plain file and
    whether it is executable; None where nothing committable is (gone, a folder, a FIFO,
    a path through a link, a hard link to a file the tree's owner does not own)."""
    try:
        fd = nofollow.open_beneath(root, rel, nofollow.READ_FLAGS)
    except OSError as exc:
        return _link_text(root, rel) if exc.errno == errno.ELOOP else None
    info = os.fstat(fd)
    foreign_link = info.st_nlink > 1 and info.st_uid != owner
    if not stat.S_ISREG(info.st_mode) or foreign_link:
        os.close(fd)
        return None
    return fd, bool(info.st_mode & 0o100)


def _link_text(root: int, rel: str) -> bytes | None:
    """The text of the link ``rel`` under ``root`` (None: no link is there)."""
    folder, _, name = rel.rpartition("/")
    try:
        fd = nofollow.open_beneath(root, folder, nofollow.DIR_FLAGS) if folder else os.dup(root)
    except OSError:
        return None  # the path goes through a link: not there
    try:
        return os.fsencode(os.readlink(name, dir_fd=fd))
    except OSError:
        return None
    finally:
        os.close(fd)


def _hash_files(where: Where, files: list[tuple[str, int, bool]]) -> list[str]:
    """Hash (and write) the open files, read by git through their descriptors; empties
    ``files`` and closes each."""
    if not files:
        return []
    fds = [fd for _, fd, _ in files]
    paths = "".join(f"/proc/self/fd/{fd}\n" for fd in fds).encode()
    try:
        shas = git_bytes(
            "hash-object", "-w", "--no-filters", "--stdin-paths", at=where, data=paths, pass_fds=fds
        ).split()
    finally:
        for fd in fds:
            os.close(fd)
        taken = list(files)
        files.clear()
    return [
        f"{'100755' if executable else '100644'} {sha.decode()}\t{rel}"
        for (rel, _, executable), sha in zip(taken, shas, strict=True)
    ]
