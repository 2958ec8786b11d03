"""The transforms the faults apply to a file's tensors: flipped, zeroed, seeded noise of a
given strength, one video frame zeroed. Each keeps shape and dtype, so the consumer still loads
the file and only the values are wrong."""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from harness.run.faults.planted import PlantedFault


def flip_away_from_zero(tensor: torch.Tensor) -> torch.Tensor:
    """Every element changes sign and lands at least 1 from zero: x >= 0 -> -x-1, x < 0 -> -x+1.

    Unlike plain negation (which keeps zeros) or small noise (which bf16 rounding may absorb),
    this changes every element, so a unit test can prove the file was really corrupted.
    """
    import torch

    return torch.where(tensor >= 0, -tensor - 1, -tensor + 1).to(tensor.dtype)


def zeros(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.zeros_like(tensor)


def file_seed(seed: int, key: str) -> int:
    """A per-file seed: the same for the same (seed, file key) on every run and machine."""
    return zlib.crc32(f"{seed}:{key}".encode())


def add_relative_noise(tensor: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`tensor` + N(0, (fraction * std(tensor))^2), computed in float32, cast back.

    The std is the tensor's own (all elements), so the strength means the same for an EC
    embedding and for a KV layer whatever their scale. Seeded: equal inputs give equal outputs.
    """
    import torch

    original = tensor.float()
    std = float(original.std()) if original.numel() > 1 else 0.0
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(original.shape, generator=generator, dtype=torch.float32)
    return (original + noise * (fraction * std)).to(tensor.dtype)


def relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """std(after - before) / std(before), in float32: the strength really planted."""
    b = before.float()
    std = float(b.std())
    return float((after.float() - b).std()) / std if std else math.inf


def noise_transform(
    fraction: float, seed: int, fault: PlantedFault
) -> Callable[[torch.Tensor], torch.Tensor]:
    def transform(tensor: torch.Tensor) -> torch.Tensor:
        noisy = add_relative_noise(tensor, fraction, seed)
        fault.effects.append(
            f"noise {fraction:g} of std asked, "
            f"{relative_change(tensor, noisy):.3g} planted ({tensor.dtype})"
        )
        return noisy

    return transform


def content_seeded_noise(
    fraction: float, seed: int, fault: PlantedFault
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`noise_transform` seeded by (`seed`, a digest of the tensor's values): the same tensor
    gets the same noise on every run, machine and protocol (`ec_noise`)."""

    def transform(tensor: torch.Tensor) -> torch.Tensor:
        digest = hashlib.sha256(tensor.detach().float().cpu().numpy().tobytes()).hexdigest()
        return noise_transform(fraction, file_seed(seed, digest[:32]), fault)(tensor)

    return transform


def zero_frame_rows(tensor: torch.Tensor, grid_t: int, frame: int) -> torch.Tensor:
    """`tensor` with the rows of temporal frame `frame` (of `grid_t`, frame-major) zeroed."""
    rows = tensor.shape[0]
    if grid_t <= 0 or rows % grid_t:
        raise ValueError(f"{rows} rows do not split into {grid_t} temporal frames")
    if not 0 <= frame < grid_t:
        raise ValueError(f"frame {frame} is outside the video's {grid_t} temporal frames")
    per_frame = rows // grid_t
    out = tensor.clone()
    out[frame * per_frame : (frame + 1) * per_frame] = 0
    return out


def zero_frame_transform(
    grid_t: int, frame: int, fault: PlantedFault
) -> Callable[[torch.Tensor], torch.Tensor]:
    def transform(tensor: torch.Tensor) -> torch.Tensor:
        zeroed = zero_frame_rows(tensor, grid_t, frame)
        per_frame = tensor.shape[0] // grid_t
        fault.effects.append(
            f"zeroed rows {frame * per_frame}-{(frame + 1) * per_frame - 1} "
            f"(frame {frame} of {grid_t}) of {tuple(tensor.shape)}"
        )
        return zeroed

    return transform
