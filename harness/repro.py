"""`epd-harness repro BUNDLE`: rerun one failing case of a run with the identical configuration.

The bundle has everything needed: run.json (serving flags, platform, planted fault),
requests.json (the exact bodies that were sent) and summary.json (which case failed, with what
verdict). The case's topology is started afresh with those flags, the recorded body is sent
again, and the verdict is compared with the recorded one. `--keep-up` then leaves the topology
serving, and prints every instance's URL and exact launch command, for poking at it by hand.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.platforms import get_platform
from harness.report import CaseRecord
from harness.runner import RunSettings, TopologySession
from harness.sweep import Sweep, SweepPlan
from harness.topology import ServingConfig, get_topology

BUNDLE_FILES = ("run.json", "requests.json", "summary.json")


class BundleError(ValueError):
    """The bundle is missing a file, or has no case to reproduce."""


@dataclass(frozen=True)
class ReproCase:
    topology: str  # the topology name proper ("1E+1PD:scenario" labels are cut at ':')
    prompt: str
    verdict: str  # what the bundle recorded
    reference: str


@dataclass(frozen=True)
class Bundle:
    path: Path
    run: dict[str, Any]
    requests: dict[str, dict[str, Any]]
    cases: list[dict[str, Any]]

    @classmethod
    def load(cls, path: Path) -> Bundle:
        missing = [name for name in BUNDLE_FILES if not (path / name).is_file()]
        if missing:
            raise BundleError(f"{path} is not a run bundle: no {', '.join(missing)}")
        try:
            run, requests, summary = (json.loads((path / n).read_text()) for n in BUNDLE_FILES)
        except json.JSONDecodeError as exc:
            raise BundleError(f"{path}: a bundle file is not JSON: {exc}") from None
        return cls(path=path, run=run, requests=requests, cases=summary.get("cases", []))

    def serving(self) -> ServingConfig:
        fields = {f.name for f in dataclasses.fields(ServingConfig)}
        given = {k: v for k, v in self.run["serving"].items() if k in fields}
        given["extra_args"] = tuple(given.get("extra_args") or ())
        return ServingConfig(**given)

    def pick_case(self, wanted: str | None) -> ReproCase:
        """The named case (`TOPOLOGY:PROMPT`), else the first that failed its policy."""
        for case in self.cases:
            topology = case["topology"].split(":")[0]
            name = f"{topology}:{case['prompt']}"
            if (wanted is None and not case["policy_passed"]) or wanted == name:
                return ReproCase(topology, case["prompt"], case["verdict"], case["reference"])
        if wanted:
            raise BundleError(f"{self.path}: no case {wanted!r}")
        raise BundleError(f"{self.path}: every case passed; name one with --case TOPOLOGY:PROMPT")


def reproduce(
    bundle: Bundle,
    run_dir: Path,
    vllm_executable: str,
    wanted: str | None = None,
    log: Callable[[str], None] = print,
) -> tuple[ReproCase, list[CaseRecord], Sweep]:
    case = bundle.pick_case(wanted)
    if case.prompt not in bundle.requests:
        raise BundleError(f"{bundle.path}: requests.json has no body for {case.prompt!r}")
    settings = RunSettings(
        serving=bundle.serving(),
        run_dir=run_dir,
        vllm_executable=vllm_executable,
        platform=get_platform(bundle.run.get("platform_profile", "cpu")),
        devices=tuple(bundle.run.get("devices") or (0, 1)),
    )
    topology = get_topology(case.topology)
    plan = SweepPlan(topologies=(topology,), prompts=(), fault=bundle.run.get("fault"))
    sweep = Sweep(plan, settings, log=log, bodies={case.prompt: bundle.requests[case.prompt]})
    records = sweep.judge(topology.name, case.prompt)
    return case, records, sweep


def keep_up(sweep: Sweep, topology_name: str, log: Callable[[str], None] = print) -> None:
    """Serve the topology until Ctrl-C (or SIGTERM), showing how to reach and relaunch it."""
    with TopologySession(
        get_topology(topology_name), sweep.settings, label=f"{topology_name}-kept-up"
    ) as session:
        log(f"{topology_name} is up; entry point (proxy): {session.entry_url}")
        for spec in session.instances:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(spec.env().items()))
            log(f"  {spec.name} {spec.url}\n    {env} {shlex.join(spec.argv(sweep.settings.vllm_executable))}")
        log("Ctrl-C stops everything.")
        signal.pause()
