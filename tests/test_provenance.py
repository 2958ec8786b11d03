"""run.json names the harness commit that judged the run (harness.provenance), read from the
checkout's files: a loose or packed branch, a detached HEAD, a worktree, or none at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.provenance import UNSEEN, harness_source

pytestmark = pytest.mark.unit

A = "a" * 40
B = "b" * 40


def repo(tmp_path: Path, head: str = "ref: refs/heads/main\n") -> Path:
    root = tmp_path / "checkout"
    (root / ".git" / "refs" / "heads").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text(head)
    return root


def test_a_branch_is_read_loose_before_packed(tmp_path: Path) -> None:
    root = repo(tmp_path)
    (root / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{B} refs/heads/main\n")
    assert harness_source.__wrapped__(root)["commit"] == B
    (root / ".git" / "refs" / "heads" / "main").write_text(A + "\n")
    found = harness_source.__wrapped__(root)
    assert found == {"commit": A, "ref": "refs/heads/main", "root": str(root), "note": UNSEEN}


def test_a_detached_head_is_its_commit(tmp_path: Path) -> None:
    assert harness_source.__wrapped__(repo(tmp_path, head=B + "\n"))["commit"] == B


def worktree_of(tmp_path: Path, main: Path, gitdir: str | None = None) -> Path:
    """A worktree of `main` on branch review, its `.git` file pointing at `gitdir` (default:
    its own directory under main's .git, absolute)."""
    own = main / ".git" / "worktrees" / "wt"
    own.mkdir(parents=True)
    (own / "HEAD").write_text("ref: refs/heads/review\n")
    (own / "commondir").write_text("../..\n")
    worktree = tmp_path / "wt"
    worktree.mkdir()
    (worktree / ".git").write_text(f"gitdir: {gitdir or own}\n")
    return worktree


def test_a_worktree_reads_the_repository_it_points_to(tmp_path: Path) -> None:
    main = repo(tmp_path)
    (main / ".git" / "packed-refs").write_text(f"{A} refs/heads/review\n")
    assert harness_source.__wrapped__(worktree_of(tmp_path, main))["commit"] == A


def test_no_checkout_or_no_commit_says_why(tmp_path: Path) -> None:
    installed = harness_source.__wrapped__(tmp_path)
    assert installed["commit"] is None and "not a git checkout" in installed["why"]
    empty = harness_source.__wrapped__(repo(tmp_path))  # a branch with no commit yet
    assert empty["commit"] is None and "refs/heads/main names no commit" in empty["why"]


def test_this_checkout_is_read_as_git_reads_it() -> None:
    """The harness's own checkout (CI's clone, a developer's tree): HEAD resolves to a commit."""
    found = harness_source()
    if found["commit"] is None:  # an installed harness: the reason is what a user sees
        assert "not a git checkout" in found["why"], found
    else:
        assert len(found["commit"]) in (40, 64), found


def test_a_worktree_whose_git_file_points_relatively_reads_its_repository(tmp_path: Path) -> None:
    """`gitdir: ../checkout/.git/worktrees/wt` (git worktree add --relative-paths, and a
    submodule's checkout): read from the worktree, not from the process's directory."""
    main = repo(tmp_path)
    (main / ".git" / "refs" / "heads" / "review").write_text(A + "\n")
    worktree = worktree_of(tmp_path, main, gitdir="../checkout/.git/worktrees/wt")
    assert harness_source.__wrapped__(worktree)["commit"] == A


@pytest.mark.parametrize("packed", [False, True])
def test_a_ref_that_holds_no_object_name_is_no_commit(tmp_path: Path, packed: bool) -> None:
    """run.json's commit is an object name or None with why: a branch file holding anything
    else (a symbolic ref, a torn write) is never recorded as the commit."""
    root = repo(tmp_path)
    if packed:
        (root / ".git" / "packed-refs").write_text("not-a-sha refs/heads/main\n")
    else:
        (root / ".git" / "refs" / "heads" / "main").write_text("ref: refs/heads/other\n")
    found = harness_source.__wrapped__(root)
    assert found["commit"] is None and "names no commit" in found["why"], found
