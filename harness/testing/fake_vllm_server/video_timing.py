"""The frames of a raw video part and the rate they stand for, as vLLM 0.32's loaders sample
them: what a video's grid and its temporal positions follow from (`media`), so an instance given
the media times a video as the processor does (the video-timing bug of docs/found-in-vllm.md).
The rules are the harness's own (harness/spec/video_sampling.py, written beside the executable);
what the fake reads itself is an mp4's header, without OpenCV (it must start fast, standard
library only), yet the two numbers OpenCV reports to vLLM's loader.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Iterator

if __package__:  # imported, by the tests of its pure functions
    from harness.spec import video_sampling
    from harness.testing.fake_vllm_server.failures import RequestFailed
else:  # the executable: harness.testing.fake_vllm wrote these modules beside it
    import video_sampling  # type: ignore[no-redef]
    from failures import RequestFailed  # type: ignore[no-redef]

JPEG_FRAMES_PREFIX = "data:video/jpeg;base64,"


def video_sampling_of(part: dict, video_io: dict) -> tuple[int, float]:
    """(frames the processor receives, the rate they stand for) of a raw video part, as vLLM
    0.32's loaders sample it: a `data:video/jpeg;base64,<f>,<f>,...` frame list, or an mp4."""
    source = part.get("video_url")
    url = source.get("url") if isinstance(source, dict) else source  # typeless: the URL itself
    if not isinstance(url, str):
        raise RequestFailed("a video_url part without a url")
    try:
        if url.lower().startswith(JPEG_FRAMES_PREFIX):
            return video_sampling.jpeg_sampling(len(url.split(",")) - 1, video_io)
        total, fps = mp4_timing(data_url_bytes(url))
        return video_sampling.container_sampling(total, fps, video_io, qwen2vl=True)
    except (ValueError, IndexError, struct.error) as exc:  # a bad clip, or header
        raise RequestFailed(f"cannot sample the video: {exc}") from None


def data_url_bytes(url: str) -> bytes:
    """The payload of a base64 `data:` URL (the fake fetches nothing)."""
    head, _, payload = url.partition(",")
    if not (head.startswith("data:") and head.endswith(";base64")):
        raise ValueError(f"the fake reads only base64 data: URLs, not {url[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"bad base64 in a data: URL ({exc})") from None


def iso_boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of each ISO BMFF box in data[start:end]."""
    while start + 8 <= end:
        size, kind = struct.unpack(">I4s", data[start : start + 8])
        header = 8
        if size == 1:  # a 64-bit size follows the type
            (size,) = struct.unpack(">Q", data[start + 8 : start + 16])
            header = 16
        elif size == 0:  # to the end of the enclosing box
            size = end - start
        if size < header or start + size > end:
            raise ValueError(f"a truncated {kind!r} box: not an mp4 the fake can read")
        yield kind, start + header, start + size
        start += size


def child_box(data: bytes, start: int, end: int, kind: bytes) -> tuple[int, int]:
    """(payload start, payload end) of the first `kind` box in data[start:end]."""
    for found, body, stop in iso_boxes(data, start, end):
        if found == kind:
            return body, stop
    raise ValueError(f"no {kind.decode()} box: not an mp4 the fake can read")


def mp4_timing(data: bytes) -> tuple[int, float]:
    """(frames, frames per second) of an mp4's first video track, from its header as OpenCV
    reports them to vLLM's loader: the frame count its time-to-sample table holds, and the
    average rate (those frames times the media timescale over their total duration)."""
    moov = child_box(data, 0, len(data), b"moov")
    for kind, trak, trak_end in iso_boxes(data, *moov):
        if kind != b"trak":
            continue
        mdia = child_box(data, trak, trak_end, b"mdia")
        hdlr, _ = child_box(data, *mdia, b"hdlr")
        if data[hdlr + 8 : hdlr + 12] != b"vide":  # after version, flags and pre_defined
            continue
        mdhd, _ = child_box(data, *mdia, b"mdhd")
        at = mdhd + (20 if data[mdhd] == 1 else 12)  # past version 1's 64-bit times, or 0's
        (timescale,) = struct.unpack(">I", data[at : at + 4])
        stbl = child_box(data, *child_box(data, *mdia, b"minf"), b"stbl")
        stts, _ = child_box(data, *stbl, b"stts")
        (entries,) = struct.unpack(">I", data[stts + 4 : stts + 8])
        runs = [
            struct.unpack(">II", data[stts + 8 + 8 * i : stts + 16 + 8 * i]) for i in range(entries)
        ]
        frames = sum(count for count, _ in runs)
        duration = sum(count * delta for count, delta in runs)
        if not (frames and duration and timescale):
            raise ValueError("the mp4's video track has no frames or no duration")
        return frames, frames * timescale / duration
    raise ValueError("no video track in the mp4")
