"""Which model the instances serve, resolved to a local directory before anything starts.

Every instance runs with `HF_HUB_OFFLINE=1` (a run must never depend on a hub answering in the
middle of a comparison), so a model given by name has to be on disk before the first start-up
timeout begins. A name is looked up in the Hugging Face cache; when it is not there it is
fetched once with `huggingface_hub` (GPU hosts reach the hub), and when that fails too the run
stops with one line saying how to provide it. The tiny CPU model is built locally.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from harness.errors import BadInput
from harness.preflight.files import check_model_dir, one_line


def hf_hub_cache(environ: Mapping[str, str] = os.environ) -> Path:
    """Where huggingface_hub keeps models, as its constants.py reads it: $HF_HUB_CACHE, the
    legacy $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub or
    ~/.cache/huggingface/hub; a leading ~ and then $VARIABLES expanded. Read otherwise, an
    offline run refused a model the hub had put in its cache."""
    given = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
    if given:
        return Path(_expanded(given, environ))
    cache_home = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    home = environ.get("HF_HOME") or str(Path(cache_home) / "huggingface")
    return Path(_expanded(home, environ)) / "hub"


# `os.path.expandvars`'s pattern: $NAME or ${NAME}; a variable not set is left as written.
_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


def _expanded(path: str, environ: Mapping[str, str]) -> str:
    """`os.path.expandvars(os.path.expanduser(path))`, as huggingface_hub expands its
    directories, with the variables of `environ`."""

    def value(match: re.Match[str]) -> str:
        name = match[1][1:-1] if match[1].startswith("{") else match[1]
        return environ.get(name, match[0])

    return _VARIABLE.sub(value, os.path.expanduser(path))


# huggingface_hub's true values of a variable (constants.py `_is_true`, any case).
HUB_TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})


def hub_offline(environ: Mapping[str, str] = os.environ) -> str | None:
    """What makes huggingface_hub offline, as `NAME=value`; None when it may fetch. It reads
    HF_HUB_OFFLINE, or TRANSFORMERS_OFFLINE where that is unset or empty, as true for any of
    HUB_TRUE_VALUES: read as HF_HUB_OFFLINE=1 alone, HF_HUB_OFFLINE=true tried a fetch the hub
    refused, and the line named a failed download, not offline mode (found in review)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = environ.get(name)
        if value:
            return f"{name}={value}" if value.upper() in HUB_TRUE_VALUES else None
    return None


def cached_snapshot(name: str, cache: Path) -> Path | None:
    """The snapshot directory `refs/main` points at in the hub cache, if it holds a config."""
    repo = cache / f"models--{name.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / revision
    return snapshot if (snapshot / "config.json").is_file() else None


def fetch_snapshot(name: str) -> Path:
    """Download `name` into the hub cache (GPU hosts); BadInput naming how to fix a failure."""
    how = f"download it first (hf download {name}) or pass --model DIR with a local checkpoint"
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise BadInput(
            f"model {name} is not in the Hugging Face cache ({hf_hub_cache()}) and "
            f"huggingface_hub is not installed to fetch it: {how}"
        ) from None
    try:
        return Path(snapshot_download(name))
    except Exception as exc:  # noqa: BLE001 - any hub failure ends as the same one line
        raise BadInput(
            f"model {name} is not in the Hugging Face cache ({hf_hub_cache()}) and "
            f"could not be fetched ({type(exc).__name__}: {one_line(str(exc), 160)}): "
            f"{how}"
        ) from None


def resolve_named_model(name: str, fetch: bool = True) -> Path:
    """A model name (org/name) -> its local checkpoint directory, fetched if allowed."""
    snapshot = cached_snapshot(name, hf_hub_cache())
    if snapshot is None:
        offline = hub_offline()
        if not fetch or offline:
            raise BadInput(
                f"model {name} is not in the Hugging Face cache ({hf_hub_cache()}) "
                f"and {offline or 'HF_HUB_OFFLINE=1'} forbids fetching it: download it first "
                f"(hf download {name}) or pass --model DIR"
            )
        snapshot = fetch_snapshot(name)
    return check_model_dir(snapshot)


def resolve_model(model: str | None, default_name: str | None, cache_root: Path) -> Path:
    """The directory every instance serves: a given directory (checked), a model name
    (resolved through the hub cache), the platform's default name, or the tiny model built
    once into `cache_root`."""
    given = model or default_name
    if given is None:
        from fixtures.tiny_model import ensure_tiny_model

        return ensure_tiny_model(cache_root / "models")
    path = Path(given).expanduser()
    if path.exists() or given.startswith((".", "/", "~")) or given.count("/") != 1:
        return check_model_dir(path)
    return resolve_named_model(given)
