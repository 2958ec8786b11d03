"""Two runs of the same cases side by side: what differs between two proxies under test.

`--proxy harness` and `--proxy vllm` on the same cases should give the same tokens, and the
instances should be sent the same calls; where they are not, the difference is what a reader
has to explain (vLLM 0.32's proxy, for one, retries decode after a 500). Both runs' evidence
comes from the taps in front of the instances, so it is the same kind of evidence whichever
proxy served. Request ids and uuids differ by design and are left out; so is the order in which
calls of requests in flight together reached an instance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

BASELINE_GROUP = "baseline"


@dataclass(frozen=True)
class InstanceCall:
    """One chat call an instance received, as far as it can differ between proxies."""

    instance: str  # the instance's name within its topology, e.g. "encoder0"
    part_types: tuple[str, ...]
    metadata_only: tuple[bool, ...]
    sent_ec_params: bool
    sent_kv_params: bool
    status: int | None
    ec_entries_answered: int
    prompt_tokens: int | None

    @classmethod
    def from_tap(cls, tap: dict[str, Any]) -> InstanceCall:
        return cls(
            instance=str(tap.get("instance", "?")).rsplit("/", 1)[-1],
            part_types=tuple(tap.get("part_types") or ()),
            metadata_only=tuple(tap.get("metadata_only") or ()),
            sent_ec_params=bool(tap.get("sent_ec_transfer_params")),
            sent_kv_params=bool(tap.get("sent_kv_transfer_params")),
            status=tap.get("status"),
            ec_entries_answered=len(tap.get("ec_transfer_params") or {}),
            prompt_tokens=(tap.get("usage") or {}).get("prompt_tokens"),
        )

    def describe(self) -> str:
        parts = ",".join(
            f"{kind}{'(meta)' if meta else ''}"
            for kind, meta in zip(self.part_types, self.metadata_only + (False,) * 99)
        )
        sent = "+".join(
            name for name, on in (("ec", self.sent_ec_params), ("kv", self.sent_kv_params)) if on
        )
        return (
            f"{self.instance}[{parts or 'text'}{' ' + sent if sent else ''}]"
            f"->{self.status if self.status is not None else 'no answer'}"
        )


@dataclass(frozen=True)
class CaseDiff:
    group: str  # the responses.json group: a topology, or "matrix:<scenario>"
    prompt: str
    tokens: str  # "equal", "differ at N", or why they cannot be compared
    only_first: tuple[InstanceCall, ...]
    only_second: tuple[InstanceCall, ...]
    # How each run's stream reached the client (harness.outcomes.stream), when streamed:
    # STREAMS_ALIKE, NOT_STREAMED, or both framings side by side.
    stream: str = "not streamed"

    @property
    def same(self) -> bool:
        return (
            self.tokens == "equal"
            and not self.only_first
            and not self.only_second
            and self.stream in (NOT_STREAMED, STREAMS_ALIKE)
        )


def calls_of(outcome: dict[str, Any]) -> Counter[InstanceCall]:
    return Counter(InstanceCall.from_tap(tap) for tap in outcome.get("taps") or ())


def compare_tokens(first: dict[str, Any], second: dict[str, Any]) -> str:
    """The prompt ids, then the generated ids: another prompt is a difference, as the judge
    makes it a MISMATCH, whatever was generated from it."""
    a = (first.get("result") or {}).get("token_ids")
    b = (second.get("result") or {}).get("token_ids")
    if a is None or b is None:
        sides = [name for name, ids in (("first", a), ("second", b)) if ids is None]
        return f"no tokens on the {' and '.join(sides)} run"
    prompt_a = (first.get("result") or {}).get("prompt_token_ids")
    prompt_b = (second.get("result") or {}).get("prompt_token_ids")
    if isinstance(prompt_a, list) and isinstance(prompt_b, list) and prompt_a != prompt_b:
        return f"prompt ids differ at {_first_difference(prompt_a, prompt_b)}"
    if a == b:
        return "equal"
    return f"differ at {_first_difference(a, b)}"


def _first_difference(a: list[Any], b: list[Any]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


NOT_STREAMED = "not streamed"
STREAMS_ALIKE = "framed alike"


def stream_framing(outcome: dict[str, Any]) -> str | None:
    """What a client saw of a streamed answer's framing, as far as two proxies may differ in
    it: the media type, role chunks, [DONE], usage against the ids, and the problems found
    (None: not streamed). How many events carried the tokens is left out: vLLM puts every
    token ready since the last event into the next one, so that count follows the timing
    (measured: 9 to 35 events for the same 32 tokens), not the proxy."""
    stream = outcome.get("stream")
    if not stream:
        return None
    done = "[DONE] last" if stream.get("done_last") else "no [DONE] last"
    media_type = (stream.get("content_type") or "").split(";")[0].strip()
    text = (
        f"{media_type or 'no content-type'}, {stream.get('role_chunks')} role chunk(s), {done}, "
        f"usage {stream.get('usage_completion_tokens')}/{stream.get('ids_counted')} ids"
    )
    problems = stream.get("problems") or []
    return text + (f"; broken: {'; '.join(problems)}" if problems else "")


def compare_streams(first: dict[str, Any], second: dict[str, Any]) -> str:
    a, b = stream_framing(first), stream_framing(second)
    if a is None and b is None:
        return NOT_STREAMED
    if a == b:
        return STREAMS_ALIKE
    return f"{a or NOT_STREAMED} / {b or NOT_STREAMED}"


def diff_runs(first: dict[str, Any], second: dict[str, Any]) -> list[CaseDiff]:
    """Every case both runs' responses.json hold ({group: {prompt: outcome}}), baseline aside."""
    diffs = []
    for group in sorted(set(first) & set(second) - {BASELINE_GROUP}):
        for prompt in sorted(set(first[group]) & set(second[group])):
            a, b = first[group][prompt], second[group][prompt]
            calls_a, calls_b = calls_of(a), calls_of(b)
            diffs.append(
                CaseDiff(
                    group,
                    prompt,
                    compare_tokens(a, b),
                    tuple(sorted((calls_a - calls_b).elements(), key=repr)),
                    tuple(sorted((calls_b - calls_a).elements(), key=repr)),
                    compare_streams(a, b),
                )
            )
    return diffs


def unpaired_cases(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """Cases only one run holds: a comparison that silently skipped them would look complete."""
    names = []
    for run, other, label in ((first, second, "first"), (second, first, "second")):
        for group, cases in run.items():
            if group == BASELINE_GROUP:
                continue
            for prompt in cases:
                if prompt not in other.get(group, {}):
                    names.append(f"{group} / {prompt}: only in the {label} run")
    return names


def format_diff(diffs: list[CaseDiff], first: str, second: str) -> str:
    streamed = any(diff.stream != NOT_STREAMED for diff in diffs)
    lines = [
        f"| case | tokens | calls only with {first} | calls only with {second} |"
        + (" stream |" if streamed else ""),
        "|---|---|---|---|" + ("---|" if streamed else ""),
    ]
    for diff in diffs:
        lines.append(
            f"| {diff.group} / {diff.prompt} | {diff.tokens} | "
            f"{'; '.join(c.describe() for c in diff.only_first) or '-'} | "
            f"{'; '.join(c.describe() for c in diff.only_second) or '-'} |"
            + (f" {diff.stream} |" if streamed else "")
        )
    same = sum(diff.same for diff in diffs)
    lines.append("")
    lines.append(
        f"{same}/{len(diffs)} cases: equal tokens and the same calls at every instance "
        f"(part types, metadata-only, EC/KV params sent, status, EC entries answered, "
        f"prompt tokens)" + (", streams framed alike" if streamed else "")
    )
    return "\n".join(lines)
