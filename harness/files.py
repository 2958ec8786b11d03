"""Writing artifacts so that a reader (a person, CI, a second run) never sees half a file."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ARTIFACT_MODE = 0o644  # mkstemp creates 0600; artifacts are for everyone who reads the run
# Every directory `fresh_run_dir` made in this process, in the order made: each run directory
# and, before it, the parents it made for it (`run_dirs_made`, `empty_run_dirs_removed`).
_MADE_RUN_DIRS: list[Path] = []


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same directory and a rename.

    A failed write() (a full disk) carries no file name; the error is given the target's.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, ARTIFACT_MODE)
        os.replace(tmp, path)
    except BaseException as exc:
        os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)
        raise


def write_json_atomic(path: Path, data: object) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def append_json_lines(path: Path, records: list[object]) -> None:
    """Append one JSON line per record, in one write: a log that only grows (a soak's every
    request) is appended to rather than rewritten whole, so each write costs what it adds. A
    reader may find the last line of a write still under way cut short."""
    if not records:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record, sort_keys=True) + "\n" for record in records)
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def fresh_run_dir(parent: Path, prefix: str = "") -> Path:
    """A new directory `parent/<prefix><time to the second>` that no other run holds: made here,
    with `-2`, `-3`, ... added when another run took the name first.

    Default run directories are named by the second a run begins, and two runs begun in the
    same second (two pytest sessions started together, a script's runs in a row) wrote into one
    directory, each summing the other's starts and one clearing the other's account (seen on
    this project's machine). Where the directory cannot be made, the plain name is returned
    unmade: the caller's write check names the cause.
    """
    stem = prefix + time.strftime("%Y%m%d-%H%M%S")
    missing = [p for p in (parent, *parent.parents) if not p.exists()]
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _MADE_RUN_DIRS.extend(reversed(missing))
        for n in itertools.count(1):
            path = parent / (stem if n == 1 else f"{stem}-{n}")
            try:
                path.mkdir()
                _MADE_RUN_DIRS.append(path)
                return path
            except FileExistsError:
                continue
    except OSError:
        pass
    return parent / stem


@contextmanager
def empty_run_dirs_removed() -> Iterator[None]:
    """Remove, when the block ends, each run directory `fresh_run_dir` made inside it that is
    still empty: nothing was written there (an input refused after the directory was made, a
    command that ended before its first artifact). Such directories piled up under runs/ (`fuzz
    --topology` with a bad flag, every unit-test session: found walking the CLI). The parents
    it made for them (runs/ itself, in a directory that had none) go too once empty, else a
    refused command in a fresh directory left an empty runs/ there. A directory with anything
    in it stays, as artifacts written so far always do, and so does one that was there before.
    Removed newest first: a run directory before the runs/ made for it."""
    made: list[Path] = []
    try:
        with run_dirs_made() as made:
            yield
    finally:
        remove_empty_run_dirs(made)


@contextmanager
def run_dirs_made() -> Iterator[list[Path]]:
    """The directories `fresh_run_dir` made inside the block (each run directory after the
    parents made for it), in a list filled as the block ends and left to the caller to remove
    (`remove_empty_run_dirs`) when it will: a pytest session makes its run root as it is
    configured and removes it, if still empty, as it is unconfigured
    (`harness.testing.session_account`). An enclosing block no longer counts them."""
    first = len(_MADE_RUN_DIRS)
    made: list[Path] = []
    try:
        yield made
    finally:
        made[:], _MADE_RUN_DIRS[first:] = _MADE_RUN_DIRS[first:], []


def remove_empty_run_dirs(made: list[Path]) -> None:
    """`run_dirs_made`'s directories, newest first, each removed only when empty (a run
    directory before the runs/ made for it)."""
    for path in reversed(made):
        remove_if_empty(path)


def remove_if_empty(path: Path) -> None:
    """rmdir: removes the directory only when it holds nothing."""
    try:
        path.rmdir()
    except OSError:
        pass


def open_lock_file(path: Path | str) -> int:
    """A read-only descriptor on the lock file `path`, created (mode 0666 less the umask) when
    missing: flock needs no write access, and a lock file in a shared directory is often
    another user's (flock(1)'s /tmp/epd-vllm.lock, a port lock another user's run made), which
    a user who is not its owner may not open for writing, nor, in a sticky world-writable
    directory under fs.protected_regular, open with O_CREAT at all. So an existing file is
    opened without O_CREAT, and a missing one is created exclusively (O_EXCL), retrying the
    plain open when another process made it first."""
    while True:
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            pass
        try:
            return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
