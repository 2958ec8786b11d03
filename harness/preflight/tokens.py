"""The context length, checked before any server sees a request: prompt tokens are counted
with the model's own processor, so a video that cannot fit `--max-model-len` costs one line, not
an ERROR per topology after minutes of start-up.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.metadata
import io
import json
import os
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from harness.errors import BadInput
from harness.preflight.files import one_line
from harness.spec.prompts import PromptSpec

# A video sent as its frames: `data:video/jpeg;base64,<frame>,<frame>,...` (VideoFramesPart).
JPEG_FRAMES_MEDIA_TYPE = "video/jpeg"
# In every count's cache key: a change to how media are read changes counts the cache holds.
# 2: a JPEG frame list counts every frame (1 counted one), file:// media keyed by their bytes.
COUNT_FORMAT = 2


def check_model_limit(max_model_len: int, model_limit: int | None) -> None:
    """--max-model-len must be positive and within the model's own context (vLLM refuses more)."""
    if max_model_len < 1:
        raise BadInput(f"--max-model-len {max_model_len}: must be a positive number of tokens")
    if model_limit is not None and max_model_len > model_limit:
        raise BadInput(
            f"--max-model-len {max_model_len} exceeds the model's own limit of "
            f"{model_limit} tokens (max_position_embeddings)"
        )


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
        raise BadInput(
            f"--max-model-len {max_model_len} is too small for prompt "
            f"{name!r}{others}: it has {needed} prompt tokens (counted with the "
            f"model's processor) + {generated} to generate = "
            f"{needed + generated}"
        )


def estimate_prompt_tokens(
    model_dir: Path, bodies: Mapping[str, dict[str, Any]], cache_dir: Path | None = None
) -> dict[str, int]:
    """Prompt tokens of each rendered request, counted with the model's own processor.

    The chat template and the image/video processors are what vLLM runs too, so for the tiny
    model this is exact (image 187, video 379 tokens, as the servers report). For a video,
    frames are decoded with OpenCV as vLLM does; vLLM may sample fewer frames of a long video,
    so the estimate errs on the large side.

    Loading transformers takes seconds, so counts are cached in `cache_dir` under a digest of
    the request, the bytes of every file:// media it names, the model's processor files and
    the transformers version: a rerun of the same prompts imports nothing.
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


def _count_with_processor(model_dir: Path, bodies: Mapping[str, dict[str, Any]]) -> dict[str, int]:
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
            raise BadInput(
                f"cannot count prompt tokens with the processor of {model_dir}: "
                f"{type(exc).__name__}: {one_line(str(exc))}"
            ) from None
        finally:
            transformers_logging.set_verbosity(verbosity)


# Weights do not change a token count; everything else in a checkpoint (configs, tokenizer,
# chat template) may.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def _transformers_version() -> str:
    """The counting library's version, for the key; without transformers the key is still
    computed (a cached count cannot match it) and counting fails on its own."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _token_count_key(model_dir: Path, body: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    digest.update(f"count-format {COUNT_FORMAT}\0".encode())
    digest.update(_transformers_version().encode())
    for path in sorted(model_dir.rglob("*")):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(path.relative_to(model_dir).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    digest.update(json.dumps(body, sort_keys=True).encode())
    # A file:// URL names media, it is not the media: the file may be replaced in place (a
    # --media-dir of the same names, another video), so its bytes enter the key, not its URL.
    for url in sorted(_file_urls(body)):
        digest.update(url.encode() + b"\0")
        try:
            digest.update(hashlib.sha256(Path(url[len("file://") :]).read_bytes()).digest())
        except OSError:
            digest.update(b"unreadable")  # counting it fails with its own clear line
    return digest.hexdigest()


def _file_urls(value: Any) -> set[str]:
    """Every file:// URL anywhere in a request body (media parts, at any depth)."""
    if isinstance(value, str):
        return {value} if value.startswith("file://") else set()
    if isinstance(value, Mapping):
        return {url for item in value.values() for url in _file_urls(item)}
    if isinstance(value, list | tuple):
        return {url for item in value for url in _file_urls(item)}
    return set()


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
    """The video's frames as vLLM decodes them: a `data:video/jpeg` URL is a list of JPEG
    frames joined by ',' (vLLM splits it so, `VideoMediaIO.load_base64`), every other video
    a container OpenCV reads frame by frame. Decoding a frame list as one blob read 1 frame of
    8, and the count let through a request every server then rejected."""
    import numpy as np

    if _media_type(url) == JPEG_FRAMES_MEDIA_TYPE:
        frames = [_decode_jpeg_frame(frame) for frame in url.partition(",")[2].split(",")]
        return np.stack(frames)
    import cv2

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


def _media_type(url: str) -> str | None:
    """'data:video/jpeg;base64,...' -> 'video/jpeg'; None for a URL that is not data:."""
    if not url.startswith("data:"):
        return None
    return url[len("data:") :].partition(",")[0].partition(";")[0].strip().lower()


def _decode_jpeg_frame(encoded: str) -> Any:
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(encoded))).convert("RGB"))
