"""The run's one judging path: a request sent, its evidence read at once, judged.

The sweep, the scenario matrix, the self-test, detection, the NIXL scenarios, fuzzing and load
all send through `observe` and judge through `CaseJudge.judge`, which is the only caller of
`harness.judge.verdicts.judge_case`. What varies between them is said in the call (a label, an
exact reference, a declared upstream failure); how a verdict is decided, and which verdicts a
run accepts (the reference policy, the measured noise floor), is decided here once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.judge.guards import GuardResult, transfer_guards
from harness.judge.policy import ReferencePolicy, default_reference_policy
from harness.judge.records import CaseRecord, DeclaredFailure
from harness.judge.verdicts import (
    Declaration,
    JudgingRules,
    Reference,
    judge_case,
    not_applicable_case,
)
from harness.outcomes.outcome import Outcome, ServedTopology
from harness.outcomes.stream import EVENT_STREAM
from harness.run.baseline import BaselineAnswers
from harness.spec.generations import (
    KnownFailure,
    golden_declares_too,
    known_failure,
    not_applicable,
    set_aside_by_golden,
)
from harness.spec.prompts import PromptSpec, fresh_prefix_request, streaming_request
from harness.spec.settings import VLLM_PROXY, RunSettings
from harness.spec.topology import Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Observed:
    """One answered request and its transfer guards, read as soon as it was answered."""

    outcome: Outcome
    guards: tuple[GuardResult, ...]


class ServingSession:
    """What `observe` needs of a session: a TopologySession or an AttachedSession."""

    served: ServedTopology
    settings: RunSettings

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome: ...


def observe(
    session: ServingSession,
    prompt: str,
    body: dict[str, Any],
    stream: bool,
    *,
    fresh_prefix: bool,
) -> Observed:
    """Send one body and read its guards at once, while the storage is as the request left it
    (the next request, or a planted fault, may change it). Streamed (`streaming_request`) when
    `stream` says so; the answer is judged against the baseline's unstreamed one all the same.
    `fresh_prefix`: under a cache salt of its own (`fresh_prefix_request`), so the instances
    compute it, and move it, as if they had never seen the prompt; a load leaves it off, since
    real traffic repeats prompts into warm caches (its round is accounted as a whole).

    Neither has a default, on purpose: the session may be one a shared pool started for
    another scenario, so its own settings say how *that* scenario sends, not this one."""
    if fresh_prefix:
        body = fresh_prefix_request(body)
    if stream:
        body = streaming_request(body)
    outcome = session.send(prompt, body)
    return Observed(outcome, tuple(transfer_guards(session.served, outcome)))


# vLLM's toy P/D proxy (the served release's tests/v1/kv_connector/nixl_integration/
# toy_proxy_server.py; `--proxy vllm` runs it for topologies without an encoder) answers every
# request with StreamingResponse(media_type="application/json"), a stream too. Measured on
# 0.32.0: the events, ids and usage are right; the content type is not an event stream's.
# The evidence is the whole start of such a case's detail, the content type its only framing
# problem and the ids identical after it: any other framing problem, other ids, or a failed
# guard reads otherwise there and is not this failure (found in review: with the content
# type alone as evidence, a duplicated chunk and another request's ids passed as declared).
TOY_PROXY_JSON_STREAM = DeclaredFailure(
    "MISMATCH",
    f"stream framing broken: served as application/json, not {EVENT_STREAM}; identical: ",
    "vLLM's toy P/D proxy (toy_proxy_server.py in the release's sdist) streams with "
    "media_type='application/json', not text/event-stream, which event-stream clients refuse",
    "toy-proxy-json-stream",
)


def proxy_failure(
    settings: RunSettings, topology: Topology, outcome: Outcome
) -> Declaration | None:
    """A failure the proxy under test is declared to have for this answer (None: none)."""
    toy_proxy = settings.proxy.kind == VLLM_PROXY and not topology.encoders
    if toy_proxy and not topology.is_baseline and outcome.stream is not None:
        return TOY_PROXY_JSON_STREAM
    return None


def reference_policy_of(settings: RunSettings) -> ReferencePolicy:
    """The run's reference policy: as given (`--reference-policy`), else the platform's."""
    if settings.reference_policy:
        return ReferencePolicy(settings.reference_policy)
    return default_reference_policy(settings.platform)


class CaseJudge:
    """Judges observed answers against the baseline (and an exact reference, where a topology
    has one) under the run's reference policy and measured noise floor."""

    def __init__(self, settings: RunSettings, baseline: BaselineAnswers):
        self.settings = settings
        self.baseline = baseline
        self.reference_policy = reference_policy_of(settings)
        self._undeclared: set[str] = set()  # release declarations a golden set aside, said once

    @property
    def rules(self) -> JudgingRules:
        """The run's rules. A batched answer is held to the run's floor, which the baseline's
        batched pass measured, unless the caller measured its traffic's own (a load's
        calibration: `judge`'s `batched_noise_floor`). Found in review: the largest floor of
        every load's calibration stood in for all, so a matrix scenario's concurrent requests
        passed a drift another load's traffic had shown, by which loads the session ran."""
        return JudgingRules(self.reference_policy, self.baseline.noise_floor)

    def not_applicable(self, topology: Topology, spec: PromptSpec | None) -> str | None:
        """Why the served release cannot run this case meaningfully (None: it can, or the
        request has no spec to tell, e.g. a replayed body: it is sent)."""
        if spec is None:
            return None
        return not_applicable(self.settings.protocol, topology, spec)

    def release_declared(self, topology: Topology, spec: PromptSpec) -> KnownFailure | None:
        """The served release's declared failure for the case, as it holds against this run's
        reference (`golden_declares_too` against another release's golden)."""
        failure = known_failure(self.settings.protocol, topology, spec)
        if failure is None or (golden := self.baseline.golden_release) is None:
            return failure
        if golden_declares_too(failure, golden, topology, spec):
            return failure
        if failure.name not in self._undeclared:
            self._undeclared.add(failure.name)
            log.warning(
                "[judge] %s", set_aside_by_golden(self.settings.vllm.version, failure, golden)
            )
        return None

    def not_applicable_record(self, label: str, prompt: str, reason: str) -> CaseRecord:
        return not_applicable_case(label, prompt, self.baseline.label, reason)

    def judge(
        self,
        topology: Topology,
        observed: Observed,
        *,
        label: str | None = None,
        spec: PromptSpec | None = None,
        exact_reference: tuple[str, Outcome] | None = None,
        declared: Declaration | None = None,
        batched: bool = False,
        others: Sequence[tuple[str, Outcome]] = (),
        baseline: Reference | None = None,
        noise_floor: float | None = None,
        batched_noise_floor: float | None = None,
    ) -> list[CaseRecord]:
        """Records against the baseline's answer to the same request (and `exact_reference`:
        a topology's name and its answer). A failure the served release is declared to have
        for `spec` (`harness.spec.generations`) applies unless `declared` says otherwise.
        `batched`: the answer was computed with other requests in flight (a load); `others`:
        the answers those requests should have had (name, baseline outcome), so an answer
        that is another request's is named as such. `baseline` and `noise_floor` stand in
        for the run's baseline answers where the caller asks the baseline itself, request by
        request (fuzzing); `batched_noise_floor`: the noise the baseline showed under the
        answer's own traffic, where that was measured (a load's calibration)."""
        prompt = observed.outcome.prompt
        references = [baseline or self.baseline.reference(prompt)]
        if exact_reference is not None:
            name, outcome = exact_reference
            references.append(Reference(name, outcome, monolithic=False))
        if declared is None and spec is not None:
            declared = self.release_declared(topology, spec)
        if declared is None:
            declared = proxy_failure(self.settings, topology, observed.outcome)
        rules = self.rules
        if noise_floor is not None:
            rules = dataclasses.replace(rules, noise_floor_nats=noise_floor)
        if batched_noise_floor is not None:
            rules = dataclasses.replace(rules, batched_noise_floor_nats=batched_noise_floor)
        return judge_case(
            label or topology.name,
            topology,
            observed.outcome,
            observed.guards,
            references,
            rules,
            declared,
            batched=batched,
            others=others,
        )
