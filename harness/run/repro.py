"""`epd-harness repro BUNDLE`: rerun one failing case of a run with the identical configuration.

The bundle has everything needed: run.json (serving flags, platform, planted fault),
requests.json (the exact bodies that were sent) and summary.json (which case failed, with what
verdict). The case's topology is started afresh with those flags, the recorded body is sent
again, and the verdict is compared with the recorded one. A later case of a sequential matrix
scenario is sent after the scenario's earlier requests, replayed first on the same servers as
the run sent them (`Bundle.how_sent`): its failure may need what they left (the KV an earlier
prompt stored, epd-kv-lookup-miss-kills-prefill), and alone it would not reproduce.
`--keep-up` then leaves the topology serving, and prints every instance's URL and exact launch
command, for poking at it by hand, and writes an attach file for it (`attach.json` in the
repro's run directory), so that `epd-harness run --attach FILE` can judge the very deployment
it keeps up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fixtures.checkpoint_digest import model_digest
from harness.environment import cache_dir
from harness.judge.policy import REFERENCE_POLICIES
from harness.judge.records import CaseRecord, Verdict
from harness.judge.verdicts import Declaration
from harness.redact import REDACTED
from harness.report.bundle import SENT_AFTER
from harness.run.fuzz.bundle import FAILURES_DIR
from harness.run.fuzz.signature import died_instance, signature_of
from harness.run.goldens import GoldenStore
from harness.run.pool import TopologyPool
from harness.run.scenarios import MATRIX, Scenario, SendMode
from harness.run.sweep import Stage, StageUnset, Sweep, SweepSpec
from harness.serve.attached import write_attach_file
from harness.serve.server_group import EventCallback
from harness.spec.attach import ATTACH_FILE_NAME
from harness.spec.generations import (
    GENERATIONS_BY_NAME,
    NEWEST,
    KnownFailure,
    ProtocolGeneration,
    generation_for,
    golden_declares_too,
    known_failure,
    set_aside_by_golden,
)
from harness.spec.platforms import get_platform
from harness.spec.prompt_codec import prompt_from_json
from harness.spec.prompts import PromptSpec
from harness.spec.settings import (
    HARNESS_PROXY,
    RAY_LAUNCHER,
    SPREAD_PLACEMENT,
    STATIC_REGISTRATION,
    LauncherChoice,
    ProxyChoice,
    RunSettings,
    ServedVllm,
)
from harness.spec.topology import ServingConfig, get_topology

log = logging.getLogger(__name__)

BUNDLE_FILES = ("run.json", "requests.json", "summary.json")
# What every summary.json record holds, read by picking and naming a case.
RECORD_FIELDS = ("topology", "prompt", "reference", "verdict")
# A load's case is labelled TOPOLOGY:load#N (harness.run.load.run); its account is load.json.
LOAD_LABEL = "load#"
LOAD_ACCOUNT = "load.json"
DIGEST_SHOWN = 12  # hex digits of a model digest a line names
KEEP_UP_POLL_S = 1.0  # how often a kept-up topology's instances are looked at


class BundleError(ValueError):
    """The bundle is missing a file, or has no case to reproduce."""


@dataclass(frozen=True)
class Sending:
    """How a case's request is sent again (`Bundle.how_sent`)."""

    streamed: bool
    # What of the original sending is not done again (a scenario's concurrency, ...), or None.
    unlike: str | None = None
    # The requests sent first, in order (empty: the case's request is sent alone, as it was
    # first or alone): a matrix scenario's earlier ones (`scenario` names it), or the run's
    # that left what the case needs (a fuzz run's run.json `sent_after`).
    scenario: str | None = None
    earlier: tuple[str, ...] = ()

    @property
    def after(self) -> str | None:
        """What the run sent before the case's request, said (None: nothing)."""
        if not self.earlier:
            return None
        requests = "request" if len(self.earlier) == 1 else "requests"
        return f"after {self.sender}'s earlier {requests} {', '.join(self.earlier)} on the same servers"

    @property
    def sender(self) -> str:
        """Who sent the earlier requests: the matrix scenario, or the run itself."""
        return f"scenario {self.scenario}" if self.scenario else "the run"

    @property
    def replayed(self) -> str | None:
        """What is sent again before the case's request, said (None: nothing is)."""
        if self.after is None:
            return None
        return (
            f"{self.after}, replayed first in that order, each as the run sent it (its "
            "recorded body, streamed if the run streamed, under its recorded cache salt or "
            "else one of its own)"
        )


@dataclass(frozen=True)
class ReproCase:
    topology: str  # the topology name proper ("1E+1PD:scenario" labels are cut at ':')
    prompt: str
    verdict: str  # what the bundle recorded
    reference: str
    label: str = ""  # the case's label in the bundle ("1E+1PD:ec-video-mp4"), scenario and all


def _scenario_of(case: ReproCase) -> Scenario | None:
    """The matrix scenario a case's label names ("1E+1PD:ec-video-mp4"), if any."""
    _, _, name = case.label.partition(":")
    return next((s for s in MATRIX if s.name == name), None)


@dataclass(frozen=True)
class Declared:
    """A failure a case is judged to have as declared, and who declares it: the verdict line
    names it, so a known failure does not read as a new one."""

    by: str  # "matrix scenario NAME", "protocol generation NAME (vLLM RANGE)"
    failure: Declaration


@dataclass(frozen=True)
class Bundle:
    path: Path
    run: dict[str, Any]
    requests: dict[str, dict[str, Any]]
    cases: list[dict[str, Any]]
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)  # summary.json, whole

    @classmethod
    def load(cls, path: Path) -> Bundle:
        missing = [name for name in BUNDLE_FILES if not (path / name).is_file()]
        if missing:
            raise BundleError(f"{path} is not a run bundle: no {', '.join(missing)}")
        try:
            run, requests, summary = (json.loads((path / n).read_text()) for n in BUNDLE_FILES)
        except json.JSONDecodeError as exc:
            raise BundleError(f"{path}: a bundle file is not JSON: {exc}") from None
        for name, document in zip(BUNDLE_FILES, (run, requests, summary)):
            if not isinstance(document, dict):
                raise BundleError(f"{path / name}: not a bundle's: a JSON object was expected")
        cases = summary.get("cases", [])
        if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases):
            raise BundleError(f"{path / 'summary.json'}: 'cases' is not a list of records")
        for number, record in enumerate(cases, start=1):
            for name in RECORD_FIELDS:
                if not isinstance(record.get(name), str):
                    raise BundleError(
                        f"{path / 'summary.json'}: case {number} has no {name!r} (a string)"
                    )
        return cls(path=path, run=run, requests=requests, cases=cases, summary=summary)

    def serving(self) -> ServingConfig:
        fields = {f.name for f in dataclasses.fields(ServingConfig)}
        recorded = self.run.get("serving")
        if not isinstance(recorded, dict):
            raise BundleError(
                f"{self.path / 'run.json'}: no 'serving' (the flags every instance was served with)"
            )
        given = {k: v for k, v in recorded.items() if k in fields}
        given["extra_args"] = tuple(given.get("extra_args") or ())
        try:
            return ServingConfig(**given)
        except TypeError as exc:  # a required field missing
            raise BundleError(
                f"{self.path / 'run.json'}: 'serving' is not a run's: {exc}"
            ) from None

    @property
    def proxy_kind(self) -> str:
        """The proxy under test of the bundle's run (bundles from before issue 9: harness)."""
        return (self.run.get("proxy") or {}).get("kind") or HARNESS_PROXY

    @property
    def launcher(self) -> LauncherChoice:
        """Where the bundle's instances ran: this host, or the same Ray cluster (the recorded
        address; a one-host rehearsal cluster when the run started one itself)."""
        recorded = self.run.get("launcher") or {}
        if recorded.get("kind") != RAY_LAUNCHER:
            return LauncherChoice()
        shared = recorded.get("shared_dir")
        return LauncherChoice(
            RAY_LAUNCHER,
            ray_address=recorded.get("ray_address"),
            placement=recorded.get("placement") or SPREAD_PLACEMENT,
            shared_dir=Path(shared) if shared else None,
            instance_env=tuple(
                (name, _unredacted(name, value))
                for name, value in (recorded.get("instance_env") or {}).items()
            ),
        )

    @property
    def vllm_source(self) -> str | None:
        """The vLLM source tree the bundle's run took vLLM's proxy from (--vllm-source), which
        a development build needs again; None for a release's sdist."""
        origin = (self.run.get("proxy") or {}).get("origin") or ""
        return origin.removeprefix("checkout ") if origin.startswith("checkout ") else None

    @property
    def proxy_registration(self) -> str:
        """How vLLM's proxy learned the instances in the bundle's run (before: static)."""
        return (self.run.get("proxy") or {}).get("registration") or STATIC_REGISTRATION

    def how_sent(self, label: str, prompt: str) -> Sending:
        """How the run sent the case labelled `label` (`TOPOLOGY[:SCENARIO]`) of `prompt`:
        streamed when the run streamed (`--stream`) or its matrix scenario does (requests.json
        holds the body before streaming was added); after which of the scenario's requests,
        sent again first; and what of the scenario's sending is not done again.

        A sequential scenario's later prompt was sent after its earlier ones on the same
        servers, and may fail only on the stage they set (the KV an earlier prompt stored under
        the key it looks up: epd-kv-lookup-miss-kills-prefill; the encoder cache an earlier
        one filled): those are replayed first (`earlier`), in the scenario's order, and its
        first prompt replays nothing. Concurrency, idle gaps and a rerun on kept storage are
        not redone: the request is sent alone, and `unlike` says what it was not."""
        _, _, name = label.partition(":")
        scenario = next((s for s in MATRIX if s.name == name), None)
        streamed = bool(self.run.get("stream")) or bool(scenario and scenario.stream)
        if name.startswith(LOAD_LABEL):
            return Sending(streamed, self._load_unlike())
        if scenario is None:
            return Sending(streamed, earlier=tuple(self.run.get(SENT_AFTER, {}).get(prompt, ())))
        ways = []
        if scenario.mode is SendMode.CONCURRENT:
            ways.append("in flight together with its other requests")
        elif scenario.mode is SendMode.IDLE_GAPS:
            ways.append("with idle gaps longer than the servers' keep-alive between requests")
        if scenario.rerun_on_kept_storage:
            ways.append("again on the storage a first session left")
        names = [p.name for p in scenario.prompts]
        if len(names) > 1 and not ways:
            if prompt in names:  # sequential: what came before it is sent again first
                earlier = tuple(names[: names.index(prompt)])
                return Sending(streamed, scenario=scenario.name, earlier=earlier)
            # Not one of the scenario's prompts (a hand-made bundle): which came before it
            # cannot be told.
            ways.append("after the scenario's earlier requests on the same servers")
        unlike = (
            f"scenario {scenario.name} sent it {'; '.join(ways)}; this sends it alone to "
            "servers started for it"
            if ways
            else None
        )
        return Sending(streamed, unlike)

    def _load_unlike(self) -> str:
        """What a `load` case's rerun does not redo: the load's concurrency (its load.json
        says how much), the other requests in flight, and the batched judging they got."""
        try:
            spec = json.loads((self.path / LOAD_ACCOUNT).read_text()).get("spec") or {}
        except (OSError, ValueError, AttributeError):
            spec = {}
        concurrency = spec.get("concurrency") if isinstance(spec, dict) else None
        at = f", {concurrency} at a time" if isinstance(concurrency, int) else ""
        return (
            f"the load sent it among its other requests{at} (or alone after them, one declared "
            "to end an instance); this sends it alone to servers started for it"
        )

    def recorded(self, label: str, prompt: str, reference: str) -> dict[str, Any] | None:
        """The summary.json record of `prompt` under `label` against `reference`, if any."""
        return next(
            (
                record
                for record in self.cases
                if (record["topology"], record["prompt"], record["reference"])
                == (label, prompt, reference)
            ),
            None,
        )

    def earlier_bodies(self, sending: Sending) -> tuple[tuple[str, dict[str, Any]], ...]:
        """The bodies of `sending.earlier`, as requests.json holds them, in order; BundleError
        naming the first it lacks (the stage cannot be set without it)."""
        for name in sending.earlier:
            if not isinstance(self.requests.get(name), dict):
                raise BundleError(
                    f"{self.path}: requests.json has no body for {name!r}, which "
                    f"{sending.sender} sent before the case on the same servers: the stage "
                    "the case was sent on cannot be set again"
                )
        return tuple((name, self.requests[name]) for name in sending.earlier)

    def declared(self, case: ReproCase, protocol: ProtocolGeneration | None) -> Declared | None:
        """The failure `case` is judged to have as declared: its matrix scenario's (as under
        the bundle's KV connector), else the one `protocol` (a release's generation) declares
        for the case's prompt (the scenario's spec, else the one run.json keeps), as it holds
        against the bundle's golden where the run judged against one (`golden_declares_too`);
        None for a case neither declares.

        The rerun is judged under it, as the bundle's run was: judged without it, a declared
        MISMATCH "reproduced" as policy FAILED while the bundle had passed it (real vLLM
        0.32.0, ec-video-jpeg-frames-default-fps; and a 0.30.0 run's video through an
        encoder, whose replayed body carries no spec the release's declaration is found by).
        Judged with a declaration the bundle's golden sets aside, a 0.30.0 video case that
        MATCHed golden-0.31.0 was rerun as "NOT as protocol generation by-hash declares"
        (real vLLM)."""
        scenario = _scenario_of(case)
        if scenario is not None:
            failure = scenario.for_kv_connector(self.serving().kv_connector).declared_of(
                case.prompt
            )
            if failure is not None:
                return Declared(f"matrix scenario {scenario.name}", failure)
        failure = self._release_failure(case, protocol)
        if failure is None or self.golden_sets_aside(case, protocol) is not None:
            return None
        assert protocol is not None  # a failure is only ever found under a protocol
        return Declared(
            f"protocol generation {protocol.name} (vLLM {protocol.version_range})", failure
        )

    def golden_sets_aside(
        self, case: ReproCase, protocol: ProtocolGeneration | None
    ) -> KnownFailure | None:
        """The failure `protocol` declares for `case` that the golden the bundle's run judged
        against does not declare (`golden_declares_too`), so it is not held; None when there
        is no such failure or golden."""
        failure = self._release_failure(case, protocol)
        golden = self.run.get("golden_release")
        spec = self._case_spec(case)
        if failure is None or not golden or spec is None:
            return None
        if golden_declares_too(failure, str(golden), get_topology(case.topology), spec):
            return None
        return failure

    def _release_failure(
        self, case: ReproCase, protocol: ProtocolGeneration | None
    ) -> KnownFailure | None:
        spec = self._case_spec(case)
        if protocol is None or spec is None:
            return None
        return known_failure(protocol, get_topology(case.topology), spec)

    def _case_spec(self, case: ReproCase) -> PromptSpec | None:
        """The prompt spec a release's declaration is read from: a matrix scenario's own (the
        matrix judges a scenario expected to MATCH under the release's declared failures too;
        run.json keeps only the sweep's prompts), else the one run.json keeps."""
        scenario = _scenario_of(case)
        if scenario is not None:
            return next((p for p in scenario.prompts if p.name == case.prompt), None)
        return self.prompt_spec(case.prompt)

    @property
    def protocol(self) -> ProtocolGeneration | None:
        """The protocol generation the bundle's run spoke, as run.json records it (None: not
        recorded, or one this harness no longer knows)."""
        return GENERATIONS_BY_NAME.get((self.run.get("protocol") or {}).get("name") or "")

    def prompt_spec(self, name: str) -> PromptSpec | None:
        """The spec run.json keeps of the prompt `name`; None when it keeps none (a matrix
        scenario's prompt, a bundle from before prompts were recorded): what a release declares
        a failure of is read from it, since the replayed body alone does not name its media."""
        for entry in self.run.get("prompts") or ():
            if isinstance(entry, dict) and entry.get("name") == name:
                try:
                    return prompt_from_json(entry)
                except (KeyError, TypeError, ValueError) as exc:
                    why = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
                    raise BundleError(
                        f"{self.path / 'run.json'}: prompt {name!r} is not a prompt's spec: {why}"
                    ) from None
        return None

    @property
    def platform(self) -> str:
        """The platform profile the bundle's run served (cpu, cuda, xpu)."""
        return str(self.run.get("platform_profile") or "cpu")

    @property
    def devices(self) -> tuple[int, ...]:
        """The devices the bundle's run was given (CPU cores on cpu)."""
        return tuple(self.run.get("devices") or (0, 1))

    @property
    def colocate(self) -> bool:
        """Whether the bundle's run let a topology's instances share devices (bundles from
        before it was recorded: no)."""
        return bool(self.run.get("colocate"))

    def goldens(self, prompt: str) -> tuple[GoldenStore, str] | None:
        """The goldens the bundle's run judged `prompt` against instead of a baseline (`run
        --golden RELEASE`), where it read them, and the release; None: it served a baseline.
        The rerun is judged against the same: a fresh baseline of the vLLM serving now is
        another reference, whose verdict said "reproduced" of another comparison (found in
        review)."""
        release = self.run.get("golden_release")
        if not release:
            return None
        source = (self.run.get("baseline_sources") or {}).get(prompt) or {}
        directory = source.get("goldens_dir") if isinstance(source, dict) else None
        return GoldenStore(Path(directory) if directory else cache_dir() / "goldens"), str(release)

    @property
    def reference_policy(self) -> str:
        """The reference policy the bundle's run judged with (summary.json's `run`; a fuzz
        run's settings in run.json); "": not recorded, the platform's default. Judged under
        the default instead, a CPU run's pd-drift DRIFT was rerun as a failed policy."""
        run = self.summary.get("run")
        name = (run if isinstance(run, dict) else {}).get("reference_policy") or (
            self.run.get("fuzz") or {}
        ).get("reference_policy")
        return name if name in REFERENCE_POLICIES else ""

    def other_model_files(self) -> str | None:
        """How the model files at the bundle's model directory differ from the ones its run
        served, by the digest run.json recorded (a tiny model built on another CPU differs in
        a few bfloat16 steps under the same name); None: the same, or nothing recorded."""
        model = self.run.get("model")
        recorded = model.get("digest") if isinstance(model, dict) else None
        path = Path(self.serving().model)
        if not recorded or not path.is_dir():
            return None
        here = model_digest(path)
        if here == recorded:
            return None
        return (
            f"the bundle served model files of digest {recorded[:DIGEST_SHOWN]}, "
            f"this run {here[:DIGEST_SHOWN]}"
        )

    @property
    def served_version(self) -> str | None:
        """The vLLM version the bundle's run served, as recorded."""
        return (self.run.get("served_vllm") or {}).get("version")

    def fuzz_group_bundles(self) -> list[Path]:
        """A fuzz run's failure groups' bundles (`failures/NN-...`), in report order; none for
        any other run. The run's own bundle passes a known failure as declared, as its exit
        code does; the group's bundle keeps the case failing (`harness.run.fuzz.bundle`)."""
        if not self.run.get("fuzz"):
            return []
        groups = sorted((self.path / FAILURES_DIR).glob("*/summary.json"))
        return [summary.parent for summary in groups]

    def pick_case(self, wanted: str | None, declared_too: bool = False) -> ReproCase:
        """The case `pick_record` picks."""
        return case_of(self.pick_record(wanted, declared_too))

    def pick_record(self, wanted: str | None, declared_too: bool = False) -> dict[str, Any]:
        """The record of the named case, `TOPOLOGY:PROMPT[@REFERENCE]` (or a one-prompt
        scenario's `TOPOLOGY:SCENARIO`, as the verdict table names it), else of the first that
        failed its policy; `declared_too`: else the first failure the harness declares (a
        verdict no policy passes, passed only as declared), else the first that is not a
        MATCH (a DRIFT its policy passed: chosen only when nothing else is left).

        A case judged against several references (under pd-drift a P->D topology against the
        monolithic baseline and against its exact reference) named without one is the record
        that failed its policy when only one reference failed; else naming it is refused as
        ambiguous, listing the references."""
        if wanted is None:
            if not self.cases:  # it was said that every case passed
                raise BundleError(
                    f"{self.path}: the run judged no case (it ended before its first verdict; "
                    "its logs say why): nothing to export or reproduce"
                )
            for record in self.cases:
                if not passed_policy(record):
                    return record
            for passed in (Verdict.MATCH.value, Verdict.DRIFT.value), (Verdict.MATCH.value,):
                for record in self.cases if declared_too else ():
                    if record["verdict"] not in passed:
                        return record
            names = dict.fromkeys(case_name(record) for record in self.cases)
            # A green run of a scenario declared to fail holds that failure: say which case
            # it is, since rerunning it is what a developer handed the bundle came for.
            declared = [
                record
                for record in self.cases
                if record["verdict"] not in (Verdict.MATCH.value, Verdict.DRIFT.value)
            ]
            known = (
                f"; {case_name(declared[0])} failed as declared, a known vLLM failure: "
                f"--case {case_name(declared[0]).split(' ')[0]} reruns it"
                if declared
                else ""
            )
            if groups := self.fuzz_group_bundles():
                known += (
                    "; this fuzz run's failures are all known ones, passes here as declared: "
                    "each group's own bundle keeps its case failing, to reproduce: "
                    + " or ".join(f"epd-harness repro {group}" for group in groups)
                )
            raise BundleError(
                f"{self.path}: every case passed; name one with --case TOPOLOGY:PROMPT "
                f"(its cases: {', '.join(names)}){known}"
            )
        name, _, reference = wanted.partition(CASE_REFERENCE_SEPARATOR)
        matches = [
            record
            for record in self.cases
            if f"{record['topology'].split(':')[0]}:{record['prompt']}" == name
            and reference in ("", record["reference"])
        ]
        if not matches:
            # The verdict table's TOPOLOGY column names a scenario (`1E+1PD:SCENARIO`): taken
            # as the case's name when the scenario has one prompt (real vLLM: a user copied
            # the cell and was refused).
            matches = [
                record
                for record in self.cases
                if record["topology"] == name and reference in ("", record["reference"])
            ]
            prompts = dict.fromkeys(case_name(record) for record in matches)
            if len(prompts) > 1:
                raise BundleError(
                    f"{self.path}: scenario {name!r} has {len(prompts)} cases; name one with "
                    f"--case: {', '.join(prompts)}"
                )
        if not matches:
            # Say how each case is named: TOPOLOGY:PROMPT, a scenario's said apart.
            names = dict.fromkeys(case_name(record) for record in self.cases)
            raise BundleError(
                f"{self.path}: no case {wanted!r}; its cases: {', '.join(names) or 'none'}"
            )
        by_reference: dict[str, dict[str, Any]] = {}
        for record in matches:
            by_reference.setdefault(record["reference"], record)
        if len(by_reference) == 1:
            return matches[0]
        failing = [record for record in matches if not passed_policy(record)]
        if len({record["reference"] for record in failing}) == 1:
            return failing[0]
        verdicts = ", ".join(f"{r['verdict']} vs {ref}" for ref, r in by_reference.items())
        raise BundleError(
            f"{self.path}: case {wanted!r} was judged against {len(by_reference)} references "
            f"({verdicts}); name one: --case {wanted}{CASE_REFERENCE_SEPARATOR}REFERENCE"
        )


def case_name(record: dict[str, Any]) -> str:
    """How `--case` names a summary.json record: `TOPOLOGY:PROMPT`, and its scenario said
    apart (`1E+1PD:m-video-jpeg-frames (scenario ec-video-jpeg-frames-default-fps)`)."""
    topology, _, scenario = record["topology"].partition(":")
    name = f"{topology}:{record['prompt']}"
    return f"{name} (scenario {scenario})" if scenario else name


def case_of(record: dict[str, Any]) -> ReproCase:
    """A summary.json record as the case it judged (a scenario's label cut at ':')."""
    return ReproCase(
        record["topology"].split(":")[0],
        record["prompt"],
        record["verdict"],
        record["reference"],
        record["topology"],
    )


# `--case TOPOLOGY:PROMPT@REFERENCE`: which of a case's comparisons (references) is meant.
CASE_REFERENCE_SEPARATOR = "@"


def passed_policy(record: dict[str, Any]) -> bool:
    """Whether a summary.json record passed its policy (older records without the field:
    whether it MATCHed)."""
    passed = record.get("policy_passed")
    return record.get("verdict") == Verdict.MATCH.value if passed is None else bool(passed)


def another_failure(recorded: dict[str, Any] | None, now: CaseRecord) -> str | None:
    """How the rerun's failure differs from the bundle's record of it, though of the same
    verdict: where it showed (the instance that died, an HTTP status, the guard that failed,
    which ids differ: `harness.run.fuzz.signature`); None when it does not, or when the record
    says too little to tell (another verdict is said by the verdicts). The verdict alone read
    "reproduced" for prompt ids parting where generated ids had, and for the ERROR of another
    instance's death (found in review). Where the ids part is `parted_elsewhere`'s."""
    if recorded is None or recorded["verdict"] != now.verdict.value or "detail" not in recorded:
        return None
    then = CaseRecord(
        topology=recorded["topology"],
        prompt=recorded["prompt"],
        reference=recorded["reference"],
        verdict=now.verdict,
        policy_passed=passed_policy(recorded),
        detail=str(recorded["detail"]),
        divergence=_object(recorded.get("divergence")),
        guards=_object(recorded.get("guards")) or {},
        timings={},
        error=recorded.get("error"),
    )
    where_then, where_now = signature_of(then).where, signature_of(now).where
    if where_then != where_now:
        return f"{where_now} now, {where_then} in the bundle"
    if now.verdict is Verdict.ERROR:
        died_then = died_instance(then.error or then.detail)
        died_now = died_instance(now.error or now.detail)
        if died_then != died_now:
            return f"{died_now} died now, {died_then} in the bundle"
    return None


def parted_elsewhere(recorded: dict[str, Any] | None, now: CaseRecord) -> str | None:
    """Where the rerun's ids part, when the bundle recorded them parting elsewhere: said beside
    "reproduced", never instead of it. The same fault can part another token (a GPU's noise,
    a scheduler's other batch), and "NOT reproduced" (exit 1) would read as fixed to a
    cherry-pick's check of a failure that is still there."""
    if recorded is None or recorded.get("verdict") != now.verdict.value:
        return None
    index_then = (_object(recorded.get("divergence")) or {}).get("index")
    index_now = (now.divergence or {}).get("index")
    if index_then is None or index_now is None or index_then == index_now:
        return None
    return f"the ids part at position {index_now} now, at position {index_then} in the bundle"


def _object(value: Any) -> dict[str, Any] | None:
    """A record's field that must be a JSON object, else None (a damaged or older record)."""
    return value if isinstance(value, dict) else None


def _unredacted(name: str, value: str) -> str:
    """A recorded instance variable; a credential run.json kept out comes from this
    environment, which must have it."""
    if value != REDACTED:
        return value
    if name not in os.environ:
        raise BundleError(
            f"the bundle's run gave its Ray instances {name}, a credential run.json does not "
            f"keep: set {name} in this environment to rerun it"
        )
    return os.environ[name]


def repro_line(
    case: ReproCase,
    verdict_now: str,
    bundle: Bundle,
    served: ServedVllm,
    held: bool = True,
    stage_unset: StageUnset | None = None,
    another: str | None = None,
) -> str:
    """`1E+1PD / image vs baseline: MISMATCH now, MISMATCH in the bundle: reproduced`. On a vLLM
    other than the bundle's, reproduced (or not) is another claim, so the line names both. A
    bundle's planted fault is planted again (`reproduce`), and the line says so: "reproduced"
    alone read as a vLLM failure to whoever was handed the bundle. A failure a matrix scenario
    or the release serving now declares is named as such (`held`: whether the rerun passed
    its policy, as declared where declared), so a known failure does not read as a new one;
    one only the bundle's release declared (0.30.0's video timing rerun on 0.32.0) says that
    the release now serving does not, and whether the rerun passes there: fixed upstream.

    `stage_unset`: why the scenario's earlier requests, replayed first, did not set the stage
    (one got no answer; `Sweep.stage_unset`). The case's own request was then not sent, so
    nothing is reproduced, whatever the verdicts say (an unsent ERROR against a recorded
    ERROR), and no declaration is judged. Where the bundle recorded that earlier request as
    failing too, it was the run's stage all the same, and its first failure is the case to
    rerun: the line names it.

    `another`: how the rerun's failure of the same verdict is another than the bundle's
    (`another_failure`): nothing is reproduced then either."""
    same = verdict_now == case.verdict and stage_unset is None and another is None
    recorded = bundle.served_version
    versions = (
        f" (the bundle served vLLM {recorded}, this run {served.version})"
        if recorded and recorded != served.version
        else ""
    )
    other_files = bundle.other_model_files()
    if other_files:
        versions += f" ({other_files})"
    fault = bundle.run.get("fault")
    planted = (
        f"; red on purpose: the bundle's planted fault {fault} was planted again, "
        "not a failure of vLLM"
        if fault
        else ""
    )
    declared = bundle.declared(case, serving_protocol(bundle, served))
    then = bundle.declared(case, bundle.protocol)
    known = ""
    if stage_unset is not None:
        known = f": the stage was not set: {stage_unset}, so the case's own request was not sent"
        earlier = bundle.recorded(case.label, stage_unset.prompt, case.reference)
        if earlier is not None and not passed_policy(earlier):
            known += (
                f"; the bundle recorded {stage_unset.prompt} {earlier['verdict']} too: "
                f"--case {case.topology}:{stage_unset.prompt} reruns that earlier failure"
            )
    elif another is not None:
        known = f": another failure than the bundle's: {another}"
    elif declared is not None:
        expects = f"(expects {declared.failure.verdict})"
        known = (
            f"; a known vLLM failure, declared by {declared.by} {expects}"
            if held
            else f"; NOT as {declared.by} declares {expects}"
        )
    elif then is not None:
        # The bundle's release declared it; the one serving now does not.
        known = (
            f"; declared by {then.by} for the bundle's vLLM {recorded}, not for vLLM "
            f"{served.version}: "
            + ("it passes now, fixed upstream" if held else "it still fails, judged undeclared")
        )
    return (
        f"{case.topology} / {case.prompt} vs {case.reference}: {verdict_now} now, "
        f"{case.verdict} in the bundle: {'reproduced' if same else 'NOT reproduced'}"
        f"{versions}{planted}{known}"
    )


def reproduce(
    bundle: Bundle,
    run_dir: Path,
    served: ServedVllm,
    wanted: str | None = None,
    proxy: ProxyChoice | None = None,
    on_event: EventCallback | None = None,
    devices: tuple[int, ...] | None = None,
    colocate: bool = False,
    argv_check: dict[str, Any] | None = None,
) -> tuple[ReproCase, list[CaseRecord], Sweep]:
    """`proxy`: the proxy under test the bundle was run with (see `Bundle.proxy_kind`);
    `on_event`: told each server's state, as `run`'s are (what an interruption cut short).
    `devices`: this host's, to rerun on (default: the bundle's; a developer's one-GPU box
    has not the night's eight); `colocate`: share devices within the topology, as the
    bundle's run may already have done. `argv_check`: how the served vLLM's own parser judged
    the rerun's command lines beforehand, for its run.json, as `run` records it (None: not
    judged).

    A later case of a sequential scenario is sent after the scenario's earlier requests, to
    the same servers (the returned sweep's `staged` holds their answers, and `stage_unset`
    why they did not set the stage, when one got none)."""
    case = bundle.pick_case(wanted)
    if case.prompt not in bundle.requests:
        raise BundleError(f"{bundle.path}: requests.json has no body for {case.prompt!r}")
    sending = bundle.how_sent(case.label, case.prompt)
    if sending.unlike:
        log.warning("repro: %s", sending.unlike)
    stage = None
    if sending.earlier:
        stage = Stage(case.topology, bundle.earlier_bodies(sending))
        log.info("repro: the case is sent %s; it alone is judged", sending.replayed)
    recorded = bundle.served_version
    settings = RunSettings(
        serving=bundle.serving(),
        run_dir=run_dir,
        vllm=served,
        platform=get_platform(bundle.platform),
        devices=devices or bundle.devices,
        colocate=colocate or bundle.colocate,
        proxy=proxy or ProxyChoice(),
        stream=sending.streamed,
        protocol=protocol_for(bundle, served),
        reference_policy=bundle.reference_policy,
        launcher=bundle.launcher,
        argv_check=argv_check,
    )
    topology = get_topology(case.topology)
    if recorded and recorded != served.version:
        log.warning(
            "repro: the bundle was served by vLLM %s, this run serves %s", recorded, served.version
        )
    other_files = bundle.other_model_files()
    if other_files:
        log.warning("repro: %s: its verdict may differ for that alone", other_files)
    fault = bundle.run.get("fault")
    if fault:  # said before the rerun's minutes, not only in its last line
        log.warning("repro: the bundle's run planted the fault %s; it is planted again", fault)
    declared = bundle.declared(case, settings.protocol)
    if declared is not None:
        log.info("repro: judged as %s declares it (%s)", declared.by, declared.failure.verdict)
    elif (set_aside := bundle.golden_sets_aside(case, settings.protocol)) is not None:
        golden = bundle.run["golden_release"]
        log.warning("repro: %s", set_aside_by_golden(served.version, set_aside, golden))
    elif (then := bundle.declared(case, bundle.protocol)) is not None:
        log.warning(
            "repro: the bundle's vLLM %s passed this case as %s declares it (%s); vLLM %s "
            "serving now declares no such failure, so it is judged as any case is",
            recorded,
            then.by,
            then.failure.verdict,
            served.version,
        )
    spec = SweepSpec(topologies=(topology,), prompts=(), fault=fault)
    # A pool of its own, kept until the caller closes it: `keep_up` serves on the very
    # session the case was reproduced on.
    pool = TopologyPool(settings, on_event)
    goldens, golden_release = bundle.goldens(case.prompt) or (None, None)
    if golden_release is not None:
        log.info("repro: judged against the goldens of vLLM %s, as the bundle was", golden_release)
    sweep = Sweep(
        spec,
        settings,
        bodies={case.prompt: bundle.requests[case.prompt]},
        pool=pool,
        stage=stage,
        goldens=goldens,
        golden_release=golden_release,
    )
    # Judged against the reference the case names, the baseline served in any case: a fuzz
    # judges against the baseline alone, and its repro started 1P+1D beside 1E+1P+1D for a
    # comparison the bundle never made (real vLLM: 55 s more, a verdict line more); so did a
    # sweep's case named `@baseline`.
    try:
        records = sweep.judge(
            topology.name,
            case.prompt,
            declared=declared.failure if declared else None,
            exact_reference=case.reference == topology.exact_reference,
        )
    except BaseException:
        pool.close()
        raise
    return case, records, sweep


def killed_by_the_load(bundle: Bundle) -> str | None:
    """Why a bundle's failures cannot be redone by one request, when a `load --kill ROLE` made
    them: the harness SIGKILLed that instance with every request in flight, so each ERROR
    names a death vLLM did not cause (an export of it drafted "[Bug]: ... D dies", real vLLM
    1P+1D). None for any other bundle."""
    killed = bundle.run.get("killed")
    if not killed:
        return None
    return (
        f"{bundle.path}: its failures are red on purpose: the load killed {killed} (--kill) "
        "with its requests in flight, which one request to vLLM alone does not redo; rerun "
        "'epd-harness load ... --kill ROLE' to see it again"
    )


def protocol_for(bundle: Bundle, served: ServedVllm) -> ProtocolGeneration:
    """The protocol generation the bundle's run spoke (`--protocol` may have chosen it) when
    the same vLLM serves now; else the one the release serving now speaks, said aloud when it
    is another."""
    speaks = serving_protocol(bundle, served)
    spoke = (bundle.run.get("protocol") or {}).get("name")
    if spoke and spoke != speaks.name:
        log.warning(
            "repro: the bundle's run spoke protocol %s (vLLM %s); vLLM %s serving now speaks %s",
            spoke,
            bundle.served_version,
            served.version,
            speaks.name,
        )
    return speaks


def serving_protocol(bundle: Bundle, served: ServedVllm) -> ProtocolGeneration:
    """`protocol_for`, unsaid: what the verdict line reads the rerun's declaration from."""
    spoke = (bundle.run.get("protocol") or {}).get("name")
    if spoke in GENERATIONS_BY_NAME and bundle.served_version == served.version:
        return GENERATIONS_BY_NAME[spoke]
    return generation_for(served.version).generation if served.known else NEWEST


def keep_up(
    sweep: Sweep, topology_name: str, settled: Callable[[], None] | None = None
) -> str | None:
    """Serve the topology the case was reproduced on until Ctrl-C (or SIGTERM), showing how
    to reach and relaunch it (started again only if an instance died in the case).

    A planted fault (the bundle's, planted again for the case) is no longer planted, but
    what it altered stays: real vLLM 0.32.0 kept answering `run --attach` with the noised
    embeddings after 1E+1PD ec-noise:0.05, from the EC file and, that file removed, from the
    encoder's and the consumer's caches. Neither vLLM's answers nor the fault's, so the
    topology is started again, on fresh storage, and what stays up is vLLM's alone."""
    fault = sweep.spec.fault
    if fault:
        log.warning(
            "repro: %s is started again without the planted fault %s: its storage and its "
            "instances' caches hold what the fault altered; what stays up serves as vLLM does, "
            "so the case is not red there",
            topology_name,
            fault,
        )
        sweep.pool.release(topology_name)
    # The baseline (and any reference) the case was judged against would serve on, unlisted.
    for key in sweep.pool.running():
        if key.topology != topology_name:
            sweep.pool.release(key.topology)
    session = sweep.pool.session(get_topology(topology_name))
    log.info("%s is up; entry point (proxy): %s", topology_name, session.entry_url)
    for spec in session.instances:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(spec.env().items()))
        argv = shlex.join(spec.argv(sweep.settings.vllm_executable))
        log.info("  %s %s\n    %s %s", spec.name, spec.url, env, argv)
    attach_file = sweep.settings.run_dir / ATTACH_FILE_NAME
    write_attach_file(session, attach_file)
    log.info("attach file: %s (judge it: epd-harness run --attach %s)", attach_file, attach_file)
    if settled is not None:  # what stopped before now was keep-up's doing, not Ctrl-C's
        settled()
    log.info("Ctrl-C stops everything.")
    return serve_until_death(session)


def serve_until_death(session: Any) -> str | None:
    """Block while the kept-up topology serves: until Ctrl-C or SIGTERM (raised through the
    harness's signal handlers), or until one of its instances dies, whose report (name, exit
    and log tail) is returned at once. Found on real vLLM: a kept-up D that a fuzz of the
    attached deployment crashed went unsaid for as long as `signal.pause()` waited."""
    while True:
        dead = session.dead_instance_report()
        if dead is not None:
            return dead
        time.sleep(KEEP_UP_POLL_S)
