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

from overnight.coordinator import workspace
from overnight.coordinator.workspace import Base, git, protected_of


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
        store.mkdir(parents=True, exist_ok=True, mode=0o700)
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
    into.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    shutil.copytree(base.root, into, symlinks=True)


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
    base: Base, globs: Sequence[str], scratch: Path, *, commit: str | None, frozen: Path | None
) -> Iterator[Checked]:
    """A fresh tree for one verifier run under ``scratch`` (removed afterwards): a checkout
    of ``commit`` (worktree mode) or a copy of ``frozen`` (in-place), protected paths put
    back from the base."""
    scratch.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder = Path(tempfile.mkdtemp(prefix="verify-", dir=scratch))
    tree = folder / "tree"
    try:
        if commit is not None:
            checked = _git_tree(base, globs, commit, tree, folder / "index")
        else:
            assert frozen is not None
            checked = _snapshot_tree(base, globs, frozen, tree)
        yield checked
    finally:
        remove_tree(folder)


def _git_tree(base: Base, globs: Sequence[str], commit: str, tree: Path, index: Path) -> Checked:
    assert base.sha is not None
    common = workspace.common_dir(base.root)
    tree.mkdir(mode=0o755)
    where = workspace.Where(common, str(tree), str(index))
    git("read-tree", commit, at=where)
    git("checkout-index", "--all", "--force", at=where)
    for rel in protected_of(workspace.tree_files(base.root, commit), globs, base.named):
        with contextlib.suppress(FileNotFoundError):
            (tree / rel).unlink()
    keep = protected_of(workspace.tree_files(base.root, base.sha), globs, base.named)
    digests: dict[str, str] = {}
    if keep:
        git("read-tree", base.sha, at=where)
        git("checkout-index", "--force", "--", *keep, at=where)
        listing = git("ls-tree", "-z", base.sha, "--", *keep, cwd=base.root)
        for row in filter(None, listing.split("\0")):
            meta, _, path = row.partition("\t")
            digests[path] = meta.split()[2]
    index.unlink(missing_ok=True)
    return Checked(str(tree), str(tree / base.subdir), commit=commit, protected=digests)


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
        dest = tree / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(store / digest, dest)
        os.chmod(dest, 0o644 | ((store / digest).stat().st_mode & 0o111))
        if sha256_file(dest) != digest:
            raise OSError(f"snapshot of {rel} does not match its recorded hash")
    return Checked(
        str(tree),
        str(tree / base.subdir),
        snapshot=manifest_digest(base.snapshot),
        protected=dict(base.snapshot),
    )


def remove_tree(path: Path) -> None:
    def retry(_func: object, name: str, _exc: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(name), 0o700)
            os.unlink(name)

    shutil.rmtree(path, onerror=retry)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def rewrite_argv(argv: Sequence[str], root: str, tree: str) -> list[str]:
    """An argv whose absolute paths into the task's tree point into the prepared tree."""
    prefix = root.rstrip("/") + "/"
    return [tree + "/" + a[len(prefix) :] if a.startswith(prefix) else a for a in argv]
