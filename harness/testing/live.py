"""A running topology of the session's pool, with the sweep whose baseline judges its answers.

What every scenario does with a topology — send a request, read its guards at once, perhaps
with a planted fault, and judge the answer against the baseline — written once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from harness.judge.records import CaseRecord, DeclaredFailure
from harness.run.faults.planted import PlantedFault, plant
from harness.run.judging import Observed, observe
from harness.run.sweep import Sweep
from harness.serve.launch import ManagedServer
from harness.serve.session import TopologySession
from harness.spec.topology import Role


@dataclass
class LiveTopology:
    session: TopologySession
    sweep: Sweep  # its baseline answers every scenario prompt; its judge is the run's

    @property
    def name(self) -> str:
        return self.session.topology.name

    def server(self, role: Role, index: int = 0) -> ManagedServer:
        return self.session.server(role, index)

    def url(self, role: Role) -> str:
        return next(spec.url for spec in self.session.instances if spec.role is role)

    def send(self, prompt: str) -> Observed:
        """One request (the prompt's rendered body) and its guards, read at once."""
        started = time.monotonic()
        observed = observe(
            self.session,
            prompt,
            self.sweep.bodies[prompt],
            self.sweep.settings.stream,
            fresh_prefix=True,
        )
        print(f"[{self.name}] {prompt}: {time.monotonic() - started:.1f}s")
        return observed

    def send_with_fault(self, fault: PlantedFault, prompt: str) -> Observed:
        """One request with `fault` planted; the session is clean again afterwards, whatever
        happened, so the next request starts from a clean proxy."""
        plant(self.session.faults, fault)
        try:
            return self.send(prompt)
        finally:
            plant(self.session.faults, None)

    def judge(self, observed: Observed, declared: DeclaredFailure | None = None) -> CaseRecord:
        """The case against the baseline, on the run's one judging path."""
        [record] = self.sweep.judging.judge(
            self.session.topology,
            observed,
            spec=self.sweep.specs.get(observed.outcome.prompt),
            declared=declared,
        )
        return record
