"""A file-locked cache of baseline outcomes, shared by runs and by parallel pytest workers.

The monolithic baseline is the same for every EPD topology, so a warm rerun (or a second xdist
worker) need not start it again. An entry is valid only for exactly what produced it: the key
covers the served vLLM and torch versions and its preprocessing libraries (an editable install's
code too), the model's content digest, every numerics-relevant serving flag, the baseline's
rendered command line and environment with the numerics-relevant variables it inherits and the
device model (`harness.run.baseline_launch`), and the rendered request body (which carries the
sampling fields), and the answer parser's code. Only outcomes whose baseline
passed the determinism control are stored. Each entry says whether the batched pass measured
it (`harness.run.baseline` takes one without it as a miss where the run batches that prompt)
and who computed it, where and when (`CacheProvenance`): a warm run records that per prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import functools
import hashlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.files import write_json_atomic
from harness.judge.compare import is_measured_floor
from harness.outcomes import chat
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.run.baseline_launch import NUMERICS_NEUTRAL_FIELDS, BaselineLaunch
from harness.serve import client
from harness.spec.file_media import file_media_digests
from harness.spec.settings import ServedVllm
from harness.spec.topology import ServingConfig

# The code that turns a baseline's HTTP answer into the stored form (ChatResult): a change to
# how ids, log-probs or prompt ids are read changes what a fresh baseline would hold, so the
# entries stored by the code before must not stand in (their hash is in every key).
ANSWER_PARSERS = (chat, client)

CACHE_FORMAT = 8  # 2: keyed by the served vLLM and torch; 3: with the noise floor; 4: the
# floor includes the batched pass (harness.run.baseline); 5: the baseline's launch (argv, env,
# device) and the served libraries in the key; 6: each entry says whether it had the batched
# pass and who computed it when (its provenance), and the answer parser's code is in the key;
# 7: ATEN_CPU_CAPABILITY in the launch's env (an entry before may have been served under it);
# 8: FBGEMM_* in it too (likewise)
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
    request body, with the bytes of each file:// medium it names."""
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
        "answer_parser": answer_parser_digest(),
        "request": body,
    }
    media_files = file_media_digests(body)
    if media_files:  # the file's bytes, not only its name (a key without files stays as it was)
        material["media_files"] = media_files
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def answer_parser_digest() -> str:
    """sha256 of the source of `ANSWER_PARSERS`, the code that makes a cached answer."""
    digest = hashlib.sha256()
    for module in ANSWER_PARSERS:
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class CacheProvenance:
    """Who computed a cache entry, where and when: what a warm run records for the baseline
    it did not serve, so a MISMATCH's reference can be traced (weeks old, another host)."""

    vllm: str
    torch: str
    vllm_source: str  # an editable install's code state; "" for an installed release
    host: str
    created: str  # UTC, ISO 8601, seconds
    cache_format: int = CACHE_FORMAT

    @classmethod
    def now(cls, served: ServedVllm) -> CacheProvenance:
        return cls(
            vllm=served.version,
            torch=served.torch_version,
            vllm_source=served.source_state,
            host=socket.gethostname(),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CacheProvenance:
        return cls(
            vllm=str(data["vllm"]),
            torch=str(data["torch"]),
            vllm_source=str(data.get("vllm_source", "")),
            host=str(data["host"]),
            created=str(data["created"]),
            cache_format=int(data["format"]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "vllm": self.vllm,
            "torch": self.torch,
            "vllm_source": self.vllm_source,
            "host": self.host,
            "created": self.created,
            "format": self.cache_format,
        }

    def describe(self) -> str:
        source = f" ({self.vllm_source})" if self.vllm_source else ""
        return f"vLLM {self.vllm}{source}, torch {self.torch}, on {self.host} at {self.created}"


@dataclasses.dataclass(frozen=True)
class CachedBaseline:
    """A stored baseline answer, the noise its controls showed, and where it came from."""

    outcome: Outcome
    noise_floor_nats: float
    batch_detail: str  # what the batched pass saw (harness.judge.verdicts.batch_shape_noise)
    # Whether the batched pass measured this answer: one that only had the control must not
    # stand in where the run measures its noise floor on it (harness.run.baseline).
    batched: bool
    provenance: CacheProvenance
    path: Path


def _measured_floor(value: Any) -> float:
    """A stored noise floor as the baseline measured it: a finite number of nats, 0 or more;
    anything else is ValueError (a corrupt entry)."""
    if not is_measured_floor(value):
        raise ValueError(
            f"noise_floor_nats is {value!r}, not a measured floor (a finite number >= 0)"
        )
    return float(value)


def _stored_flag(value: Any) -> bool:
    """The stored `batched`: a JSON boolean; anything else is ValueError (a corrupt entry:
    bool() read a stored "false" as True, an answer that only had the control as batched)."""
    if not isinstance(value, bool):
        raise ValueError(f"batched is {value!r}, not a boolean")
    return value


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

    def _holds_batched(self, key: str) -> bool:
        """Whether `key`'s entry is a batched answer this run may read, which an unbatched
        one must not replace: two prompt names can share a body (the sweep's `text` and a
        matrix scenario's stage-setting request), one batched and one not, and the last stored
        won, so the next worker found the batched one a miss and started the baseline again
        (seen on the fake GPU night: 3 baseline starts for 2)."""
        if self.refresh and not self.refreshed_in_this_run(key):
            return False
        try:
            data = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return False
        return (
            isinstance(data, dict)
            and data.get("format") == CACHE_FORMAT
            and data.get("batched") is True
        )

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str, prompt: str) -> CachedBaseline | None:
        path = self.path(key)
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
                outcome,
                _measured_floor(data["noise_floor_nats"]),
                str(data["batch_detail"]),
                _stored_flag(data["batched"]),
                CacheProvenance.from_json(data),
                path,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise BaselineCacheError(
                f"corrupt baseline cache entry {path}: {exc}; delete it or pass --refresh-baseline"
            ) from None

    def store(
        self,
        key: str,
        outcome: Outcome,
        noise_floor_nats: float = 0.0,
        batch_detail: str = "",
        *,
        batched: bool = False,
        served: ServedVllm | None = None,
    ) -> None:
        """Store a stable answer; `batched`: whether the batched pass measured it; `served`:
        the vLLM that computed it (its versions are the entry's provenance)."""
        if outcome.result is None:
            return
        if not batched and self._holds_batched(key):
            return
        provenance = CacheProvenance.now(served or ServedVllm("unknown", "unknown"))
        entry = {
            **provenance.to_json(),
            "format": CACHE_FORMAT,
            "result": outcome.result.to_json(),
            "noise_floor_nats": noise_floor_nats,
            "batch_detail": batch_detail,
            "batched": batched,
        }
        write_json_atomic(self.path(key), entry)
        if self.refresh:
            self._refreshed.add(key)
            if self.refresh_ledger is not None:
                self.refresh_ledger.mkdir(parents=True, exist_ok=True)
                (self.refresh_ledger / key).touch()
