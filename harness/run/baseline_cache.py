"""A file-locked cache of baseline outcomes, shared by runs and by parallel pytest workers.

The monolithic baseline is the same for every EPD topology, so a warm rerun (or a second xdist
worker) need not start it again. An entry is valid only for exactly what produced it: the key
covers the served vLLM and torch versions and its preprocessing libraries (an editable install's
code too), the model's content digest, every numerics-relevant serving flag, the baseline's
rendered command line and environment with the numerics-relevant variables it inherits and the
device model (`harness.run.baseline_launch`), and the rendered request body (which carries the
sampling fields). Only outcomes whose baseline
passed the determinism control are stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.files import write_json_atomic
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.run.baseline_launch import NUMERICS_NEUTRAL_FIELDS, BaselineLaunch
from harness.spec.settings import ServedVllm
from harness.spec.topology import ServingConfig

CACHE_FORMAT = 5  # 2: keyed by the served vLLM and torch; 3: with the noise floor; 4: the
# floor includes the batched pass (harness.run.baseline); 5: the baseline's launch (argv, env,
# device) and the served libraries in the key
LOCK_FILE_NAME = ".lock"


class BaselineCacheError(HarnessError):
    """A cache entry exists but cannot be used (corrupt or of another format)."""


def baseline_key(
    served: ServedVllm,
    serving: ServingConfig,
    model_digest: str,
    body: dict[str, Any],
    *,
    launch: BaselineLaunch,
) -> str:
    """The cache key: the *served* vLLM and torch versions (never the harness's own), the
    model's content, every numerics-relevant flag, how the baseline is launched (its argv,
    the environment it gets and inherits, the device: `harness.run.baseline_launch`) and the
    request body."""
    if not served.known:
        raise ValueError("a baseline of an unknown vLLM version cannot be cached")
    if served.cache_refusal is not None:
        raise ValueError(served.cache_refusal)
    flags = {
        name: value
        for name, value in dataclasses.asdict(serving).items()
        if name not in NUMERICS_NEUTRAL_FIELDS and name != "model"
    }
    material = {
        "format": CACHE_FORMAT,
        "vllm": served.version,
        "torch": served.torch_version,
        # The processors and kernels besides torch (transformers' resize, tokenizers' ids),
        # and an editable install's code, which its version does not name.
        "libraries": dict(served.libraries),
        "vllm_source": served.source_state,
        "model_digest": model_digest,
        "serving": flags,
        "launch": launch.to_json(),
        "request": body,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class CachedBaseline:
    """A stored baseline answer and the noise its controls showed."""

    outcome: Outcome
    noise_floor_nats: float
    batch_detail: str  # what the batched pass saw (harness.judge.verdicts.batch_shape_noise)


class BaselineCache:
    """`refresh=True` ignores what was stored before this run (and overwrites it):
    `--refresh-baseline`. What this run stored is read like any entry, so one run refreshes
    each entry once: in this process by memory, across the processes of one pytest session (its
    xdist workers) by `refresh_ledger`, a directory only this session writes in, holding one
    file per entry refreshed, written under the cache's lock right after the entry. (Found in
    review: every GPU worker ignored what the first had just stored under the lock, and started
    a baseline of its own.)"""

    def __init__(self, directory: Path, refresh: bool = False, refresh_ledger: Path | None = None):
        self.directory = directory
        self.refresh = refresh
        self.refresh_ledger = refresh_ledger
        self._refreshed: set[str] = set()  # keys this process stored under `refresh`

    def refreshed_in_this_run(self, key: str) -> bool:
        """Whether this run (this process, or a worker of the same session) already stored a
        fresh entry under `key`."""
        if key in self._refreshed:
            return True
        return self.refresh_ledger is not None and (self.refresh_ledger / key).exists()

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

    def load(self, key: str, prompt: str) -> CachedBaseline | None:
        path = self._path(key)
        if (self.refresh and not self.refreshed_in_this_run(key)) or not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, found {type(data).__name__}")
            if data.get("format") != CACHE_FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {CACHE_FORMAT}")
            outcome = Outcome(prompt=prompt, result=ChatResult.from_json(data["result"]))
            return CachedBaseline(
                outcome, float(data["noise_floor_nats"]), str(data["batch_detail"])
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise BaselineCacheError(
                f"corrupt baseline cache entry {path}: {exc}; delete it or pass --refresh-baseline"
            ) from None

    def store(
        self, key: str, outcome: Outcome, noise_floor_nats: float = 0.0, batch_detail: str = ""
    ) -> None:
        if outcome.result is None:
            return
        entry = {
            "format": CACHE_FORMAT,
            "result": outcome.result.to_json(),
            "noise_floor_nats": noise_floor_nats,
            "batch_detail": batch_detail,
        }
        write_json_atomic(self._path(key), entry)
        if self.refresh:
            self._refreshed.add(key)
            if self.refresh_ledger is not None:
                self.refresh_ledger.mkdir(parents=True, exist_ok=True)
                (self.refresh_ledger / key).touch()
