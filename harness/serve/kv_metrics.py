"""D's own count of the prompt tokens it got from P, read from its Prometheus `/metrics`.

Why not `usage.prompt_tokens_details.cached_tokens` alone: it is what ExampleConnector runs are
judged by, but under NixlConnector vLLM 0.32 reports `cached_tokens=0` on D although the whole
prompt's KV arrived (measured: 0 for 121-379-token prompts whose outputs matched the baseline,
while D's log showed successful NIXL transfers). D does count them in its Prometheus
counters: `vllm:prompt_tokens_cached_by_source{source="p2p"}` and
`vllm:prompt_tokens_by_source{source="external_kv_transfer"}` both grew by the whole prompt per
request (121, 187, 253, 379 tokens), `local_compute` by 0; NIXL adds its own transfer counters
(transfers, bytes, failures). The session
reads them just before and just after each request and keeps the difference, so the KV guard
has evidence for every connector. Requests sent concurrently to one D blur the difference: the
guard then sees the sum of all of them (never less than one request's share).

The same page counts the requests an instance finished (`vllm:request_success`, over every
finish reason): in attach mode (`harness.serve.attached`) that is the evidence an encoder
served during a request, since nobody records its answers there.
"""

from __future__ import annotations

import http.client
import re
from dataclasses import dataclass

from harness.serve.http_direct import DIRECT_OPENER

# A busy D is slow to render /metrics: under NIXL, 8 streamed requests in flight on a loaded
# 2-core host, 7 of 16 reads taken as their requests ended waited out a 5 s bound (each request
# then VACUOUS for want of evidence, though D's counters read fine around the round). A dead D
# refuses at once, so a longer bound costs only a hung one.
METRICS_TIMEOUT_S = 30.0
# metric sample name (with its labels) -> the short name the guard and the bundle use
COUNTERS = {
    'vllm:prompt_tokens_cached_by_source_total{source="p2p"}': "p2p_cached_tokens",
    'vllm:prompt_tokens_cached_by_source_total{source="external_unspecified"}': "external_cached_tokens",
    'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}': "external_kv_tokens",
    'vllm:prompt_tokens_by_source_total{source="local_compute"}': "local_compute_tokens",
    'vllm:prompt_tokens_by_source_total{source="local_cache_hit"}': "local_cache_hit_tokens",
    "vllm:nixl_xfer_time_seconds_count": "nixl_transfers",
    "vllm:nixl_bytes_transferred_sum": "nixl_bytes",
    "vllm:nixl_num_failed_transfers_total": "nixl_failed_transfers",
    "vllm:request_success_total": "finished_requests",
}
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)")


@dataclass(frozen=True)
class KvCounters:
    """D's counters at one moment (or the difference between two moments)."""

    values: dict[str, float]

    def minus(self, earlier: KvCounters) -> dict[str, float]:
        return {k: v - earlier.values.get(k, 0.0) for k, v in self.values.items()}


def parse_counters(text: str) -> KvCounters:
    """The COUNTERS found in a Prometheus text page (summed over engines and models)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = _keep_source_label(match["labels"] or "")
        short = COUNTERS.get(match["name"] + labels)
        if short is None:
            continue
        try:
            values[short] = values.get(short, 0.0) + float(match["value"])
        except ValueError:
            continue
    return KvCounters(values)


def _keep_source_label(labels: str) -> str:
    """`{engine="0",model_name="m",source="x"}` -> `{source="x"}`; other labels dropped."""
    source = re.search(r'source="([^"]*)"', labels)
    return f'{{source="{source[1]}"}}' if source else ""


def metrics_page(base_url: str) -> str | None:
    """An instance's /metrics page now, or None when it cannot be read."""
    try:
        with DIRECT_OPENER.open(f"{base_url}/metrics", timeout=METRICS_TIMEOUT_S) as reply:
            return reply.read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):  # a page cut short is no OSError (found in review)
        return None


def read_counters(base_url: str) -> KvCounters | None:
    """D's counters now, or None when its /metrics cannot be read (the guard then says so)."""
    page = metrics_page(base_url)
    return None if page is None else parse_counters(page)
