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
from harness.spec import video_sampling
from harness.spec.file_media import file_urls
from harness.spec.prompts import PromptSpec, requested_tokens

# A video sent as its frames: `data:video/jpeg;base64,<frame>,<frame>,...` (VideoFramesPart).
JPEG_FRAMES_MEDIA_TYPE = "video/jpeg"
# In every count's cache key: a change to how media are read changes counts the cache holds.
# 2: a JPEG frame list counts every frame (1 counted one), file:// media keyed by their bytes.
# 3: the request's mm_processor_kwargs reach the processor (2 counted without them, and its
# counts of such requests sit in caches under the same body), videos sampled as vLLM does.
# 4: an mp4 keeps the frame the Qwen2-VL loader's float step adds past n (3 counted one
# temporal step short for such videos).
COUNT_FORMAT = 4


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
    """Each request must fit: its prompt tokens plus the tokens it asks for within
    --max-model-len.

    vLLM 0.27-0.31 reject a request that does not with a 400 (prompt + max_tokens over the
    context); 0.32 rejects a prompt of the whole context and otherwise cuts max_tokens down
    to what is left, so every topology would answer shorter than asked and the comparison
    cover fewer tokens than the run says. Either way it is a one-number mistake, refused here
    rather than after minutes of start-up. What a request asks for is what its body says
    (`requested_tokens`): a prompt's extra fields may set max_tokens or max_completion_tokens.
    """
    too_long = [
        (p.name, prompt_tokens[p.name], generated)
        for p in prompts
        if prompt_tokens[p.name] + (generated := requested_tokens(p)) > max_model_len
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
    model this is exact (image 187, video 379 tokens, as the servers report). The request's
    mm_processor_kwargs reach the processor call as vLLM passes them (an image capped with
    max_pixels: 139 and 159, as vLLM 0.32 reported), and a video's frames are those vLLM's
    loader keeps (harness/spec/video_sampling.py; media_io_kwargs' video fps / num_frames).

    Loading transformers takes seconds, so counts are cached in `cache_dir` under a digest of
    the request (its mm_processor_kwargs and media_io_kwargs with it), the bytes of every
    file:// media it names, the model's processor files and the counting libraries' versions: a
    rerun of the same prompts imports nothing.
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
            counts = {}
            for name, body in bodies.items():
                try:
                    counts[name] = _count_tokens(processor, body)
                except BadInput as exc:  # the request's own mistake: name the prompt
                    raise BadInput(f"prompt {name!r}: {exc}") from None
            return counts
        except BadInput:
            raise
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


# The distributions whose code the count runs: the processor (transformers; torchvision, by
# which it picks its fast image and video processors), the tokenizer (tokenizers), the media
# decoders (Pillow; OpenCV, which reads a container's frames and fps, as whichever of its
# distributions provides cv2) and torch (the kept frames' indices). Keyed by the transformers
# version alone, a count taken under other versions of the rest was read back (found in review).
COUNTING_DISTRIBUTIONS = (
    "transformers",
    "tokenizers",
    "torch",
    "torchvision",
    "pillow",
    "opencv-python",
    "opencv-python-headless",
    "opencv-contrib-python",
    "opencv-contrib-python-headless",
)


def _counting_versions() -> str:
    """The counting libraries' versions, for the key; without one the key is still computed
    (a cached count cannot match it) and counting fails on its own."""
    versions = []
    for name in COUNTING_DISTRIBUTIONS:
        try:
            versions.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    return "\0".join(versions)


def _token_count_key(model_dir: Path, body: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    digest.update(f"count-format {COUNT_FORMAT}\0".encode())
    digest.update(_counting_versions().encode())
    for path in sorted(model_dir.rglob("*")):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(path.relative_to(model_dir).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    # The whole body: mm_processor_kwargs and media_io_kwargs change the count as the media do.
    digest.update(json.dumps(body, sort_keys=True).encode())
    # A file:// URL names media, it is not the media: the file may be replaced in place (a
    # --media-dir of the same names, another video), so its bytes enter the key, not its URL.
    for url in sorted(file_urls(body)):
        digest.update(url.encode() + b"\0")
        try:
            digest.update(hashlib.sha256(Path(url[len("file://") :]).read_bytes()).digest())
        except OSError:
            digest.update(b"unreadable")  # counting it fails with its own clear line
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
    """The request's prompt tokens as vLLM's renderer makes them: the chat template, then the
    processor on the media as vLLM's loaders hand them over, with the request's
    mm_processor_kwargs passed to the processor call (`InputProcessingContext.
    call_hf_processor` passes them all; a cap of max_pixels halves an image's tokens)."""
    kwargs = _processor_kwargs(processor, body)
    video_io = _video_io_kwargs(body)
    images: list[Any] = []
    videos: list[Any] = []
    metadata: list[Any] = []
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
                frames, meta = _load_video(
                    part["video_url"]["url"], video_io, _qwen2vl_loader(processor, video_io)
                )
                videos.append(frames)
                metadata.append(meta)
                parts.append({"type": "video"})
            else:
                raise ValueError(f"cannot estimate tokens of a {part['type']!r} part")
        messages.append({"role": message["role"], "content": parts})
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    media: dict[str, Any] = {}
    if images:
        media["images"] = images
    if videos:
        from transformers.video_utils import VideoMetadata

        media["videos"] = videos
        media["video_metadata"] = [VideoMetadata(**meta) for meta in metadata]
    encoded = processor(text=[text], **media, **kwargs, return_tensors="np")
    return int(encoded["input_ids"].shape[-1])


# The nested scopes a processor call takes besides its flat keywords (transformers'
# ProcessingKwargs), as vLLM routes mm_processor_kwargs.
_KWARG_SCOPES = {
    "text_kwargs": "tokenizer",
    "images_kwargs": "image_processor",
    "videos_kwargs": "video_processor",
    "audio_kwargs": "feature_extractor",
}


def _processor_kwargs(processor: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The request's mm_processor_kwargs, each one a keyword the processor takes.

    vLLM hands every one to the processor, which drops a keyword it does not know with a log
    line (`... is not a valid argument for this processor and will be ignored`): the request
    then runs without it, and the count would too. So such a kwarg is refused here, by name.
    """
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise BadInput(f"mm_processor_kwargs must be a JSON object, not {kwargs!r}")
    accepted = _accepted_kwargs(processor)
    every = set().union(*accepted.values())
    for key, value in kwargs.items():
        if key in _KWARG_SCOPES and key in accepted:
            if not isinstance(value, Mapping):
                raise BadInput(f"mm_processor_kwargs {key!r} must be a JSON object, not {value!r}")
            unknown = sorted(set(value) - accepted[key])
            if unknown:
                raise _refused(processor, f"{key}.{unknown[0]}", accepted[key])
        elif key not in every:
            raise _refused(processor, key, every)
    return dict(kwargs)


def _refused(processor: Any, key: str, accepted: set[str]) -> BadInput:
    return BadInput(
        f"mm_processor_kwargs {key!r}: {type(processor).__name__} takes no such keyword "
        f"(vLLM would drop it and serve the request without it); it takes: "
        f"{', '.join(sorted(accepted))}"
    )


def _accepted_kwargs(processor: Any) -> dict[str, set[str]]:
    """Per scope, the keywords the processor's call takes: its ProcessingKwargs' and its
    sub-processors' `valid_kwargs`, as transformers' `ProcessorMixin._merge_kwargs` reads them."""
    from typing import get_type_hints

    scopes = get_type_hints(processor.valid_processor_kwargs)
    accepted: dict[str, set[str]] = {}
    for scope, attribute in _KWARG_SCOPES.items():
        if scope not in scopes:
            continue
        keys = set(_annotations(scopes[scope]))
        valid = getattr(getattr(processor, attribute, None), "valid_kwargs", None)
        if valid is not None:
            keys |= set(_annotations(valid))
        accepted[scope] = keys
    return accepted


def _annotations(typed_dict: Any) -> dict[str, Any]:
    names: dict[str, Any] = {}
    for base in reversed(getattr(typed_dict, "__mro__", (typed_dict,))):
        names.update(getattr(base, "__annotations__", {}))
    return names


def _video_io_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """media_io_kwargs.video: fps and num_frames change which frames vLLM's loader keeps."""
    media_io = body.get("media_io_kwargs") or {}
    video = media_io.get("video") if isinstance(media_io, Mapping) else None
    if video is None:
        return {}
    if not isinstance(video, Mapping):
        raise BadInput(f"media_io_kwargs 'video' must be a JSON object, not {video!r}")
    return dict(video)


def _qwen2vl_loader(processor: Any, video_io: Mapping[str, Any]) -> bool:
    """Whether vLLM loads the request's videos with its Qwen2-VL loader: media_io_kwargs'
    video.video_backend names the loader when given (`MediaConnector.fetch_video` picks one
    by the video processor's class name only when it is not), and one the count does not
    model is refused by name rather than counted as another."""
    backend = video_io.get("video_backend")
    if backend is None:
        video_processor = getattr(processor, "video_processor", None)
        return type(video_processor).__name__ == video_sampling.QWEN2VL_VIDEO_PROCESSOR
    if backend not in video_sampling.LOADERS:
        raise BadInput(
            f"media_io_kwargs video.video_backend {backend!r}: the prompt-token count models "
            f"vLLM's {' and '.join(map(repr, video_sampling.LOADERS))} video loaders only"
        )
    return backend == video_sampling.QWEN2VL_LOADER


def _media_bytes(url: str) -> bytes:
    if url.startswith("data:"):
        return base64.b64decode(url.partition(",")[2])
    if url.startswith("file://"):
        return Path(url[len("file://") :]).read_bytes()
    raise ValueError(f"cannot count tokens of media at {url[:80]} (only data: and file://)")


def _load_image(url: str) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(_media_bytes(url))).convert("RGB")


def _load_video(url: str, video_io: Mapping[str, Any], qwen2vl: bool) -> tuple[Any, dict]:
    """The frames vLLM's loader hands the processor, and the metadata it passes with them.

    A `data:video/jpeg` URL is a list of JPEG frames joined by ',' (vLLM splits it so,
    `VideoMediaIO.load_base64`), of which it reads the first `num_frames` (32); decoding it as
    one blob read 1 frame of 8, and the count let through a request every server then
    rejected. Every other video is a container OpenCV reads; vLLM samples it down before the
    processor sees it (Qwen2VLVideoBackend: to 2 fps), and counting every frame refused a
    16-frame 4 fps clip that takes as many tokens as an 8-frame 2 fps one.
    """
    import numpy as np

    if _media_type(url) == JPEG_FRAMES_MEDIA_TYPE:
        encoded = url.partition(",")[2].split(",")
        kept, fps = video_sampling.jpeg_sampling(len(encoded), video_io)
        frames = np.stack([_decode_jpeg_frame(frame) for frame in encoded[:kept]])
        return frames, _video_metadata(frames, list(range(kept)), kept, fps, "jpeg_sequence")
    all_frames, original_fps = _decode_container(_media_bytes(url))
    total = len(all_frames)
    kept = video_sampling.container_frames(total, original_fps, video_io, qwen2vl)
    indices = _spread(total, kept)
    frames = np.stack([all_frames[i] for i in indices])
    return frames, _video_metadata(frames, indices, total, original_fps, "opencv")


def _spread(total: int, kept: int) -> list[int]:
    """`kept` indices spread over `total` frames as vLLM's loaders pick them (float32 steps,
    clamped: the same `torch.arange` as transformers' sampler)."""
    if kept == total:
        return list(range(total))
    import torch

    indices = torch.arange(0, total, total / kept).int()
    return torch.clamp(indices, max=total - 1).tolist()[:kept]


def _video_metadata(
    frames: Any, indices: list[int], total: int, fps: float, backend: str
) -> dict[str, Any]:
    return {
        "total_num_frames": total,
        "fps": fps,
        "duration": total / fps if fps > 0 else 0.0,
        "video_backend": backend,
        "frames_indices": indices,
        "height": int(frames.shape[1]),
        "width": int(frames.shape[2]),
    }


def _decode_container(data: bytes) -> tuple[list[Any], float]:
    import cv2

    with tempfile.NamedTemporaryFile(suffix=".mp4") as file:
        file.write(data)
        file.flush()
        capture = cv2.VideoCapture(file.name)
        fps = float(capture.get(cv2.CAP_PROP_FPS))
        frames = []
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        capture.release()
    if not frames:
        raise ValueError("the video has no decodable frame")
    return frames, fps


def _media_type(url: str) -> str | None:
    """'data:video/jpeg;base64,...' -> 'video/jpeg'; None for a URL that is not data:."""
    if not url.startswith("data:"):
        return None
    return url[len("data:") :].partition(",")[0].partition(";")[0].strip().lower()


def _decode_jpeg_frame(encoded: str) -> Any:
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(encoded))).convert("RGB"))
