"""The unknown-uuid probe (`export --probe unknown-uuid`): the consumer alone, sent the case's
image as a metadata-only part under a uuid no encoder produced; it should refuse the request and
keep serving."""

from __future__ import annotations

import copy
import json
from typing import Any

from harness.errors import BadInput
from harness.run.export.expectation import REQUEST_TIMEOUT_S
from harness.run.export.servers import ExportedServer
from harness.run.repro import Bundle, ReproCase
from harness.spec.topology import Role

UNKNOWN_UUID_PROBE = "unknown-uuid"
PROBES = (UNKNOWN_UUID_PROBE,)

# The uuid of the unknown-uuid probe: the export's storage starts empty, so nothing has it.
NEVER_ENCODED_UUID = "epd-export-never-encoded-0000000000000000"


def probed_consumer(servers: tuple[ExportedServer, ...], case: ReproCase) -> ExportedServer:
    """The instance the unknown-uuid probe kills: D (a KV consumer) or the PD (EC consumer)."""
    for role in (Role.DECODE.value, Role.PREFILL_DECODE.value):
        for server in servers:
            if server.role == role:
                return server
    raise BadInput(f"--probe {UNKNOWN_UUID_PROBE}: {case.topology} has no D or PD to send it to")


def encoder_metadata(bundle: Bundle, label: str, prompt: str) -> dict[str, Any]:
    """The image's metadata as the encoder answered it (the taps' record of the case)."""
    responses = json.loads((bundle.path / "responses.json").read_text(encoding="utf-8"))
    key = f"matrix:{label.partition(':')[2]}" if ":" in label else label
    taps = ((responses.get(key) or {}).get(prompt) or {}).get("taps") or []
    # By item hash: a proxy that retried (vLLM's re-encodes after a failed decode) encoded
    # the same image twice.
    entries = {
        mm_hash: entry["metadata"]
        for record in taps
        if record.get("role") == Role.ENCODER.value
        for mm_hash, entry in (record.get("ec_transfer_params") or {}).items()
        if isinstance(entry, dict) and entry.get("metadata")
    }
    if len(entries) != 1:
        raise BadInput(
            f"--probe {UNKNOWN_UUID_PROBE} needs the encoder's answer for one image in "
            f"{label} / {prompt}; the bundle's taps hold {len(entries)}"
        )
    return next(iter(entries.values()))


def unknown_uuid_body(body: dict[str, Any], metadata: dict[str, Any], case: ReproCase) -> dict:
    """The request with its one image as a metadata-only `image_embeds` part under a uuid
    nothing was stored for, as a proxy's rewrite would send it to the consumer."""
    probe = copy.deepcopy(body)
    content = probe["messages"][0]["content"]
    images = [i for i, part in enumerate(content) if part.get("type") == "image_url"]
    if len(images) != 1:
        raise BadInput(
            f"--probe {UNKNOWN_UUID_PROBE} needs a case with exactly one image; "
            f"{case.prompt} has {len(images)}"
        )
    content[images[0]] = {
        "type": "image_embeds",
        "image_embeds": metadata,
        "uuid": NEVER_ENCODED_UUID,
    }
    return probe


def survival_expectation(consumer: ExportedServer) -> dict[str, Any]:
    """expected.json of the unknown-uuid probe: a refusal, and the consumer still serving."""
    return {
        "check": "refused-and-alive",
        "send_to": consumer.name,
        "what": f"{consumer.name} alone, sent the request with its image as a metadata-only "
        f"part under a uuid no encoder produced; expecting a 4xx and {consumer.name} still "
        "serving",
        "timeout_s": REQUEST_TIMEOUT_S,
        "recorded": {
            "verdict": "ERROR",
            "source": "the harness's negative check (scenarios/test_negative_checks.py)",
        },
    }
