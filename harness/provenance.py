"""Which harness judged a run: the commit of the checkout it ran from.

Why: a verdict is evidence only together with the code that reached it. The package's version
(`harness_packages`) stays 0.1.0 from commit to commit, so a nightly's run.json, a cherry-pick
validation's and a developer's repro could come from different harness code and not say so.

Read from the checkout's files, not by running git: run.json is written by code that unit
tests drive, and they start no process. So local changes to tracked files are not seen (that
takes git's index and the files' contents); the record says so.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

HARNESS_ROOT = Path(__file__).resolve().parents[1]
_SHA = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")  # SHA-1 or SHA-256 object names
UNSEEN = "local changes are not read (that takes git itself)"


@functools.cache
def harness_source(root: Path = HARNESS_ROOT) -> dict[str, Any]:
    """{"commit", "ref", "root", "note"} of the git checkout at `root` (a worktree's too);
    {"commit": None, "why"} where there is none (an installed harness) or its HEAD cannot be
    resolved. Read once per process: a test session writes hundreds of run.json files."""
    try:
        git_dir = _git_dir(root)
        if git_dir is None:
            return {"commit": None, "why": f"{root} is not a git checkout (an installed harness)"}
        head = (git_dir / "HEAD").read_text(encoding="ascii").strip()
        if _SHA.fullmatch(head):
            return {"commit": head, "ref": None, "root": str(root), "note": UNSEEN}
        ref = head.removeprefix("ref: ").strip()
        commit = _resolve(git_dir, ref)
    except (OSError, UnicodeDecodeError) as exc:
        return {"commit": None, "why": f"cannot read the git checkout at {root}: {exc}"}
    if commit is None:
        return {"commit": None, "why": f"{root}: {ref} names no commit (a branch with none yet)"}
    return {"commit": commit, "ref": ref, "root": str(root), "note": UNSEEN}


def _git_dir(root: Path) -> Path | None:
    """The checkout's git directory: `.git` itself, or where a worktree's `.git` file points."""
    dot_git = root / ".git"
    if dot_git.is_dir():
        return dot_git
    if dot_git.is_file():
        pointer = dot_git.read_text(encoding="utf-8").strip()
        if pointer.startswith("gitdir:"):
            target = Path(pointer.removeprefix("gitdir:").strip())
            return target if target.is_absolute() else (root / target).resolve()
    return None


def _resolve(git_dir: Path, ref: str) -> str | None:
    """A ref's commit: its loose file, else its line in packed-refs, looked up in the git
    directory and, for a worktree, in the repository's common directory."""
    places = [git_dir]
    common = git_dir / "commondir"
    if common.is_file():
        shared = Path(common.read_text(encoding="utf-8").strip())
        places.append(shared if shared.is_absolute() else (git_dir / shared).resolve())
    for place in places:
        loose = place / ref
        if loose.is_file():
            value = loose.read_text(encoding="ascii").strip()
            return value if _SHA.fullmatch(value) else None
    for place in places:
        packed = place / "packed-refs"
        if packed.is_file():
            for line in packed.read_text(encoding="ascii").splitlines():
                sha, _, name = line.partition(" ")
                if name == ref and _SHA.fullmatch(sha):
                    return sha
    return None
