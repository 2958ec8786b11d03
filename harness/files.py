"""Writing artifacts so that a reader (a person, CI, a second run) never sees half a file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

ARTIFACT_MODE = 0o644  # mkstemp creates 0600; artifacts are for everyone who reads the run


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
