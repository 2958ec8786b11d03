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
