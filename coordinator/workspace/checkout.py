"""The tree a verifier rule runs in: never the agent's live tree.

In a git worktree task, a fresh checkout of the step's commit; outside git, a fresh copy of
the tree as the agent step left it (frozen once that step's processes were gone). Either way
the protected paths are then put back as they were at the base (the base commit, or the
snapshot taken at submit): a protected file the agent added is removed, one it changed or
deleted is restored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from overnight.config.folders import make_folders
from overnight.coordinator.workspace import worktree as workspace
from overnight.coordinator.workspace.worktree import Base, protected_of
from overnight.worker.sandbox import nofollow


@dataclass(frozen=True)
class Checked:
    """A prepared tree: where the rule runs (``cwd``), what it holds (``commit``, or
    ``snapshot`` digest), and the digest of each protected file put back."""

    root: str
    cwd: str
    commit: str | None = None
    snapshot: str | None = None
    protected: dict[str, str] = field(default_factory=dict)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


def walk_files(root: Path) -> Iterator[str]:
    """Every file (and symlink) under ``root`` as a '/'-path relative to it; .git skipped."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != ".git" or os.path.islink(os.path.join(folder, d)))
        rel = os.path.relpath(folder, root)
        for name in sorted(files):
            yield name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                yield name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")


def manifest_digest(manifest: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


# --- submit: the snapshot outside git ---------------------------------------------------------


def take_snapshot(
    root: Path, globs: Sequence[str], named: Sequence[str], store: Path
) -> dict[str, str]:
    """Hash every protected file under ``root`` and keep its bytes in ``store`` (by hash)."""
    out: dict[str, str] = {}
    for rel in protected_of(walk_files(root), globs, named):
        src = root / rel
        if src.is_symlink() or not src.is_file():
            continue
        make_folders(store, 0o700, above=0o711)
        digest = sha256_file(src)
        dest = store / digest
        if not dest.exists():
            tmp = store / f".{digest}.{os.getpid()}"
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o400 | (src.stat().st_mode & 0o111))
            os.replace(tmp, dest)
        out[rel] = digest
    return out


# --- after the agent step ---------------------------------------------------------------------


def freeze(base: Base, into: Path) -> None:
    """Copy the tree as the agent step left it to ``into`` (replacing an older copy)."""
    if into.exists():
        remove_tree(into)
    make_folders(into.parent, 0o700, above=0o711)
    nofollow.copy_tree(base.root, into)


def snapshot_changes(base: Base, globs: Sequence[str], tree: Path) -> list[str]:
    """The protected files of ``tree`` that differ from the snapshot (added, changed, gone)."""
    now = {}
    for rel in protected_of(walk_files(tree), globs, base.named):
        path = tree / rel
        now[rel] = "link" if path.is_symlink() or not path.is_file() else sha256_file(path)
    names = set(now) | set(base.snapshot)
    return sorted(n for n in names if now.get(n) != base.snapshot.get(n))


def commit_changes(base: Base, globs: Sequence[str], commit: str) -> list[str]:
    """The protected paths ``commit`` changed against the base commit."""
    assert base.sha is not None
    return protected_of(workspace.changed(base.root, base.sha, commit), globs, base.named)


# --- a verifier run ---------------------------------------------------------------------------


@contextlib.contextmanager
def prepared(
    base: Base,
    globs: Sequence[str],
    scratch: Path,
    *,
    commit: str | None,
    frozen: Path | None,
    owner: tuple[int, int] | None = None,
) -> Iterator[Checked]:
    """A fresh tree for one verifier run under ``scratch`` (removed afterwards): a checkout
    of ``commit`` (worktree mode) or a copy of ``frozen`` (in-place), protected paths put
    back from the base. Built as this process's user, then, with ``owner`` (the uid and gid
    the rule runs as), handed to it: the folders above stay overnight's, so the rule can
    write its tree and nothing around it."""
    make_folders(scratch, 0o711, above=0o711)
    folder = Path(tempfile.mkdtemp(prefix="verify-", dir=scratch))
    tree = folder / "tree"
    try:
        if commit is not None:
            checked = _git_tree(base, globs, commit, tree)
        else:
            assert frozen is not None
            checked = _snapshot_tree(base, globs, frozen, tree)
        if owner is not None:
            os.chmod(scratch, 0o711)  # a folder made before rules ran as their own user
            os.chmod(folder, 0o711)
            give_tree(tree, *owner)
        yield checked
    finally:
        remove_tree(folder)


def give_tree(root: Path, uid: int, gid: int) -> None:
    """Hand the tree at ``root`` to ``uid``: every entry by its folder's descriptor, a link
    itself and never where it leads, no folder entered through a link."""
    for _top, dirs, files, fd in os.fwalk(root, follow_symlinks=False):
        for name in [*dirs, *files]:
            os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
    os.chown(root, uid, gid, follow_symlinks=False)


def _git_tree(base: Base, globs: Sequence[str], commit: str, tree: Path) -> Checked:
    assert base.sha is not None
    tree.mkdir(mode=0o755)
    entries = workspace.tree_entries(base.root, commit)
    shown = [e for e in entries if not workspace.is_protected(e.path, globs, base.named)]
    kept = [
        e
        for e in workspace.tree_entries(base.root, base.sha)
        if workspace.is_protected(e.path, globs, base.named)
    ]
    for chunk in range(0, len(shown) + len(kept), CHUNK):
        part = [*shown, *kept][chunk : chunk + CHUNK]
        blobs = workspace.read_blobs(base.root, [e.sha for e in part])
        for e in part:
            write_entry(tree, e.path, e.mode, blobs[e.sha])
    digests = {e.path: e.sha for e in kept}
    return Checked(str(tree), str(tree / base.subdir), commit=commit, protected=digests)


CHUNK = 256


def write_entry(tree: Path, rel: str, mode: str, data: bytes) -> None:
    """Write one file of a prepared tree at ``rel`` (a '/'-path) without ever following a
    link the agent left: a link or a file where a folder belongs is replaced by the folder,
    every part reached from the tree's descriptor."""
    parts = nofollow.split(rel)
    if parts[0] == ".git":
        raise OSError(f"refusing to write {rel!r}")
    top = os.open(tree, nofollow.DIR_FLAGS)
    try:
        folder = nofollow.make_beneath(top, parts[:-1], 0o755)
    finally:
        os.close(top)
    try:
        nofollow.remove_at(folder, parts[-1])
        if mode == "120000":
            os.symlink(data, parts[-1], dir_fd=folder)
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(parts[-1], flags, 0o600, dir_fd=folder)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), 0o755 if mode == "100755" else 0o644)
    finally:
        os.close(folder)


def _snapshot_tree(base: Base, globs: Sequence[str], frozen: Path, tree: Path) -> Checked:
    assert base.snapshot_dir is not None
    shutil.copytree(frozen, tree, symlinks=True)
    for rel in protected_of(walk_files(tree), globs, base.named):
        path = tree / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    store = Path(base.snapshot_dir)
    for rel, digest in base.snapshot.items():
        data = (store / digest).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise OSError(f"the snapshot of {rel} does not match its recorded hash")
        executable = (store / digest).stat().st_mode & 0o111
        write_entry(tree, rel, "100755" if executable else "100644", data)
    return Checked(
        str(tree),
        str(tree / base.subdir),
        snapshot=manifest_digest(base.snapshot),
        protected=dict(base.snapshot),
    )


def remove_tree(path: Path) -> None:
    """Remove ``path`` and all it holds, never following a link in it; what cannot be
    removed (a step still writing there) is left, as a scratch folder may be."""
    for _ in range(2):
        try:
            nofollow.remove_path(path)
            return
        except OSError:
            continue


def rewrite_argv(argv: Sequence[str], root: str, tree: str) -> list[str]:
    """An argv whose absolute paths into the task's tree point into the prepared tree."""
    prefix = root.rstrip("/") + "/"
    return [tree + "/" + a[len(prefix) :] if a.startswith(prefix) else a for a in argv]
