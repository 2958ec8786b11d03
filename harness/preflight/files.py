"""Files and directories a run depends on: the model, the run directory, the media.

A real write probe, not `os.access`: root passes every permission test, and neither tells about
a read-only mount, a full disk or a path under a regular file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from harness.errors import BadInput
from harness.serve.proxy_protocol import MEDIA_URL_PART_TYPES

WRITE_PROBE_BYTES = 4096


def check_model_dir(model: str | os.PathLike[str]) -> Path:
    """A directory with a config.json that is a JSON object: the least a checkpoint has.

    vLLM would say the same thing after importing torch for ten seconds, in a log nobody reads
    because the baseline "died during startup".
    """
    path = Path(model).expanduser().resolve()
    if not path.exists():
        raise BadInput(f"model directory {path} does not exist")
    if not path.is_dir():
        raise BadInput(f"model {path} is not a directory (pass a checkpoint directory)")
    config = path / "config.json"
    if not config.is_file():
        raise BadInput(
            f"model directory {path} has no config.json (is it a Hugging Face checkpoint?)"
        )
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadInput(f"model directory {path}: config.json: {describe_os_error(exc)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = (
            f"line {exc.lineno} column {exc.colno}: {exc.msg}"
            if isinstance(exc, json.JSONDecodeError)
            else "not UTF-8"
        )
        raise BadInput(
            f"model directory {path}: config.json is not valid JSON ({detail})"
        ) from None
    if not isinstance(data, dict):
        raise BadInput(f"model directory {path}: config.json is {kind_of(data)}, not an object")
    return path


def max_position_tokens(model_dir: Path) -> int | None:
    """The model's context limit from config.json (text_config first: Qwen2.5-VL nests it)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    for section in (config.get("text_config") or {}, config):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_run_dir(run_dir: Path) -> Path:
    """Create the run directory and write (then remove) a probe file in it.

    A real write, not `os.access`: root passes every permission test, and neither tells about a
    read-only mount, a full disk or a path under a regular file. Every artifact, log and the EC
    and KV storage the instances share live under this directory.
    """
    probe = run_dir / f".epd-harness-write-probe-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"\0" * WRITE_PROBE_BYTES)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        # A failed write() carries no file name (only open() does): name the probe then.
        cause = describe_os_error(exc) if exc.filename else f"{describe_os_error(exc)}: {probe}"
        raise BadInput(
            f"run directory {run_dir} (logs, EC and KV storage) is not writable: {cause}"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return run_dir


def check_media_dir(media_dir: str | os.PathLike[str]) -> Path:
    path = Path(media_dir).expanduser().resolve()
    if not path.is_dir():
        state = "is not a directory" if path.exists() else "does not exist"
        raise BadInput(f"media directory {path} {state}")
    return path


def check_media_references(bodies: Mapping[str, dict[str, Any]], media_dir: Path | None) -> None:
    """Every file:// URL a request carries must exist and lie under the media directory.

    vLLM refuses files outside --allowed-local-media-path with an HTTP 400 per request, which a
    run would record as an ERROR verdict on every topology: a user error, reported as one. A
    media directory no request reads is refused too: it only added that flag to every instance,
    and the run went on as if the user's media had been sent (found in review).
    """
    named_files = False
    for prompt, body in bodies.items():
        for url in _media_urls(body):
            if not url.startswith("file://"):
                continue
            named_files = True
            path = Path(url[len("file://") :])
            if media_dir is None:
                raise BadInput(f"prompt {prompt!r} references {url} but no --media-dir was given")
            if not path.resolve().is_relative_to(media_dir):
                raise BadInput(
                    f"prompt {prompt!r} references {path}, outside --media-dir {media_dir}"
                )
            if not path.is_file():
                raise BadInput(f"prompt {prompt!r}: media file {path} does not exist")
    if media_dir is not None and not named_files:
        raise BadInput(
            f"--media-dir {media_dir}: no prompt of this run names a file:// medium (the "
            "harness's prompts carry their media inline, as data: URLs), so no server would "
            "read it: drop --media-dir"
        )


def _media_urls(body: dict[str, Any]) -> Iterable[str]:
    """Every media URL of the body: each kind vLLM reads by URL (audio too: found in review,
    a run whose only file:// medium was a clip was refused), in either form it accepts,
    `{"url": ...}` or the URL itself (its typeless parts)."""
    for message in body.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            for key in MEDIA_URL_PART_TYPES:
                media = part.get(key) if isinstance(part, dict) else None
                url = media.get("url") if isinstance(media, dict) else media
                if isinstance(url, str):
                    yield url


# OSErrors that mean "this environment cannot hold the run", not "the harness has a bug".
ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}
)


def describe_os_error(exc: OSError) -> str:
    """'[Errno 28] No space left on device: 'x'' -> 'no space left on device: x' (one line)."""
    reason = (exc.strerror or str(exc)).lower()
    names = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    return f"{reason}: {' -> '.join(names)}" if names else reason


def one_line(text: str, width: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def kind_of(value: object) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def load_json_or_yaml(source: Path, where: str) -> Any:
    """A JSON file's data, or a YAML file's when the name ends in .yaml / .yml (PyYAML must
    be installed); `where` starts every error ("cases file x: not valid JSON: ...")."""
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"{where}: {describe_os_error(exc)}") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if source.suffix in (".yaml", ".yml"):
        return _parse_yaml(text, where)
    return _parse_json(text, where)


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        position = f"line {exc.lineno} column {exc.colno}"
        raise BadInput(f"{where}: not valid JSON: {position}: {exc.msg}") from None


def _parse_yaml(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise BadInput(f"{where}: reading YAML needs PyYAML; or write JSON") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        position = f"line {mark.line + 1} column {mark.column + 1}: " if mark else ""
        raise BadInput(f"{where}: not valid YAML: {position}{exc.problem}") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"{where}: not valid YAML: {one_line(str(exc))}") from None
