"""The checkpoint digest as it was computed before it streamed: every file read whole.

Kept for the tests that pin the digest's value (the baseline cache and the goldens key on it,
so a faster computation must give the same hex for the same checkpoint). Memory-hungry on
purpose: use it on small checkpoints only."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

COMPLETE_MARKER = ".complete"
VERSION_FIELDS = frozenset({"transformers_version"})


def _drop_version_fields(value: object) -> object:
    if isinstance(value, dict):
        return {
            key: _drop_version_fields(item)
            for key, item in value.items()
            if key not in VERSION_FIELDS
        }
    if isinstance(value, list):
        return [_drop_version_fields(item) for item in value]
    return value


def _content_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix != ".json":
        return data
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return data
    canonical = json.dumps(
        _drop_version_fields(parsed), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return canonical.encode()


def whole_file_digest(model_dir: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)
    for path in files:
        data = _content_bytes(path)
        name = path.relative_to(model_dir).as_posix().encode()
        digest.update(b"%d:%s:%d:" % (len(name), name, len(data)))
        digest.update(data)
    return digest.hexdigest()
