"""What one instance was sent and answered for one chat request, as its recording tap saw it.

The taps (`harness.serve.tap`) stand between whichever proxy is under test and every instance,
so these records are the guards' evidence for any proxy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TapRecord:
    """What one instance was sent and answered for one chat request."""

    seq: int
    instance: str
    role: str
    path: str
    request_id: str | None = None  # the x-request-id the proxy under test sent, if any
    part_types: list[str] = field(default_factory=list)  # non-text content parts, in order
    metadata_only: list[bool] = field(default_factory=list)  # per part in part_types
    uuids: list[str | None] = field(default_factory=list)  # per part in part_types
    sent_ec_transfer_params: dict[str, Any] | None = None
    sent_kv_transfer_params: dict[str, Any] | None = None
    status: int | None = None
    ec_transfer_params: dict[str, Any] | None = None  # answered
    kv_transfer_params: dict[str, Any] | None = None  # answered
    usage: dict[str, Any] | None = None
    streamed: bool = False
    error: str | None = None
    seconds: float = 0.0
    rewritten_by_fault: bool = False

    @property
    def ended(self) -> bool:
        """Whether the instance is done with this call: the tap sets `seconds` once it has
        relayed the answer whole (a stream to its end), `error` when the call failed."""
        return self.seconds > 0 or self.error is not None

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return value if isinstance(value, int) else None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def records_of(records: list[TapRecord], request_id: str) -> list[TapRecord]:
    """The records the proxy made for client request `request_id`, among `records`.

    Requests in flight together (the matrix's concurrency scenario) share a time window, so the
    window alone would hand each request the others' encoder calls. Both EPD proxies pass the
    client's `x-request-id` on: as is to P, D and PD, as `<id>:<item>:<suffix>` to encoders.
    A proxy that sets ids of its own (vLLM's toy P/D proxy) leaves nothing to match; then the
    window is all there is, which is exact for requests sent one at a time (under load it holds
    its neighbours' calls too, and the kv guard says it cannot tell D's answers apart).
    """
    mine = [
        r
        for r in records
        if r.request_id == request_id or (r.request_id or "").startswith(f"{request_id}:")
    ]
    return mine or records
