"""The harness proxy's own account of one request: what it sent where, and what came back.

Read by the transfer guards of sessions without taps (older bundles' replays) and by the
report; every launched topology has taps since issue 9, which see the same for any proxy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EncoderCall:
    url: str
    positions: tuple[int, ...]
    status: int | None = None
    ec_transfer_params: dict[str, Any] | None = None
    seconds: float = 0.0
    # Media position -> mm_hash of each item the answer gave metadata for, as the served
    # release's protocol generation reads it (None: not read, e.g. the call failed).
    indexed: dict[int, str] | None = None


@dataclass
class RequestTrace:
    """What the proxy did for one request id; read by the transfer guards and the report."""

    request_id: str
    media_count: int = 0
    encoder_calls: list[EncoderCall] = field(default_factory=list)
    forwarded_part_types: list[str] = field(default_factory=list)
    metadata_only: list[bool] = field(default_factory=list)
    prefill_url: str | None = None
    prefill_status: int | None = None
    prefill_kv_transfer_params: dict[str, Any] | None = None
    prefill_seconds: float = 0.0
    decode_url: str | None = None
    decode_status: int | None = None
    decode_seconds: float = 0.0
    error: str | None = None
    fault_effects: list[str] = field(default_factory=list)  # what a planted fault did

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["encoder_calls"] = [dict(c.__dict__) for c in self.encoder_calls]
        return data
