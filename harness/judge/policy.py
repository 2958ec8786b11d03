"""Which policy each (topology, reference) comparison is held to: the reference policy of a run.

Upstream's own correctness script says P/D "may give slightly different results from a single
instance": with a P->D hop, D receives the prompt's KV and computes only the tail itself, so its
kernels run on other shapes than the monolithic baseline's full prefill. So upstream compares
1E+1PD with the monolithic baseline, and 1E+1P+1D with 1P+1D, and keeps 1P+1D as a reference
only. The harness holds the same pairs exact, and judges what upstream leaves unjudged (a P->D
topology against the monolithic baseline) under the calibrated drift rule
(`harness.judge.compare`): a near-tie on both sides after a prefix whose log-probs agreed, all
within the noise floor the run measured. A corrupted transfer does not look like that, so it
stays a MISMATCH.

An answer computed in flight with other requests (a load, a scenario's concurrent requests)
runs in other batch shapes than the baseline's single request did; whether that moves anything
on a platform is measured, never assumed: the baseline's batched pass sends each sweep request
together with another, a load has the baseline answer its requests at the load's concurrency
(`harness.run.baseline.BaselineAnswers.calibrate_batched`), and a batched answer is held to the
drift rule within the larger of the noise that showed batched and the noise its repeat showed
alone (`JudgingRules.tolerance`). Where neither moved anything (both floors 0) no drift can
pass, so the comparison stays exact in effect.

On CPU with the numerics pinned (one thread per instance, eager) every comparison is
bitwise repeatable, so everything is exact there. The policy is chosen by platform, recorded in
run.json, and can be overridden per run (`--reference-policy`); changing how a pair is judged is
a change here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.judge.records import EXACT, LOGPROB_CLOSE, Policy
from harness.spec.platforms import PlatformProfile
from harness.spec.topology import Topology

EXACT_EVERYWHERE = "exact"
PD_DRIFT = "pd-drift"
REFERENCE_POLICIES = (EXACT_EVERYWHERE, PD_DRIFT)


@dataclass(frozen=True)
class ReferencePolicy:
    """How a run judges each pair; `name` is one of REFERENCE_POLICIES."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in REFERENCE_POLICIES:
            raise ValueError(
                f"unknown reference policy {self.name!r} (known: {', '.join(REFERENCE_POLICIES)})"
            )

    def policy_for(
        self, topology: Topology, reference_is_monolithic: bool, batched: bool = False
    ) -> Policy:
        """EXACT, except a topology with a P->D hop against a monolithic reference under
        PD_DRIFT, where numeric drift within the measured floor passes too; and, under either
        policy, a batched answer (computed in flight with other requests: a load) against the
        monolithic single-request reference, which may drift within the noise the baseline
        itself showed when batched (or alone, whichever is larger). That floor is measured,
        never assumed: where neither moved a log-prob (both 0) no drift can pass and the
        comparison is exact in effect."""
        if self.name == PD_DRIFT and reference_is_monolithic and topology.has_kv_transfer:
            return LOGPROB_CLOSE
        if batched and reference_is_monolithic:
            return LOGPROB_CLOSE
        return EXACT

    def describe(self) -> str:
        if self.name == PD_DRIFT:
            return (
                "pd-drift: exact, except topologies with a P->D hop against the monolithic "
                "baseline, which may DRIFT within the measured noise floor"
            )
        return "exact: every comparison must MATCH"


def default_reference_policy(platform: PlatformProfile) -> ReferencePolicy:
    """GPUs and XPUs judge as upstream does; CPU stays exact everywhere."""
    return ReferencePolicy(EXACT_EVERYWHERE if platform.name == "cpu" else PD_DRIFT)
