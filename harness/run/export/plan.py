"""`epd-harness export RUN_DIR`: one case of a run bundle as a directory that reproduces it with
vLLM alone, for a vLLM issue.

The harness is what found the failure; it must not be what a vLLM developer needs to see it.
So the export holds only what vLLM itself runs: every instance's recorded `vllm serve` command
and environment (ports, host, model and connector storage turned into shell variables), the
served release's own proxy (`disagg_epd_proxy.py`, or for 1P+1D the toy proxy of vLLM's NIXL
tests) pointed straight at the instances, the request body exactly as the harness sent it (and,
for a later case of a sequential matrix scenario, the scenario's earlier requests, which
check.py sends first to the same servers: the case's failure may need what they left), the
case's reference's token ids to expect (with the policy and noise floor it was judged by), a
`check.py` on the standard library alone, the model (the tiny model's files, or a hub model's
name and revision) and an `ISSUE.md` drafting the report. Devices become positions that
serve.sh maps onto `DEVICES` (a Ray run's nodes onto this one host), never the recording
host's indices.
This module decides what goes in, from the package's parts (servers, proxy, reference,
request, expectation, probe); `harness.run.export.files` writes it.

Refused, in one line: a case whose failure the harness planted (a self-test fault: no vLLM
plugin can carry it, so vLLM alone would not fail), and a run of an attached deployment (the
harness never launched it, so it has no commands to export, nor can repro start it: rerun
the case with `epd-harness run --proxy vllm` on its model and flags, and export that run),
and a run judged against another release's golden (`--golden`), whose reference vLLM alone
cannot serve.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fixtures.tiny_model import CACHE_DIR_PREFIX as TINY_MODEL_DIR_PREFIX
from harness.errors import BadInput
from harness.judge.records import Verdict
from harness.judge.verdicts import DECLARED_UPSTREAM
from harness.run.export.devices import RecordedDevice
from harness.run.export.expectation import tokens_expectation
from harness.run.export.probe import (
    PROBES,
    UNKNOWN_UUID_PROBE,
    encoder_metadata,
    probed_consumer,
    survival_expectation,
    unknown_uuid_body,
)
from harness.run.export.proxy import ProxyFile, UpstreamProxy, proxy_server
from harness.run.export.reference import ReferenceServing, reference_serving
from harness.run.export.request import (
    CASE_SALT,
    EarlierRequest,
    asks_for_logprobs,
    earlier_request,
    inline_local_media,
    own_salt,
)
from harness.run.export.servers import (
    ExportedServer,
    compacted,
    dropped_env,
    inherited_env,
    instance_servers,
)
from harness.run.repro import (
    Bundle,
    BundleError,
    ReproCase,
    Sending,
    case_of,
    killed_by_the_load,
)
from harness.run.scenarios import MATRIX
from harness.serve.session import safe_name
from harness.spec.prompts import DEFAULT_TOP_LOGPROBS, streaming_request
from harness.spec.settings import ATTACH_PROXY
from harness.spec.topology import BASELINE, get_topology

# A model directory at most this large is copied into the export (the tiny model is ~3 MB).
MAX_COPIED_MODEL_BYTES = 64 * 1024 * 1024
HF_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[0-9a-f]+)")


@dataclass(frozen=True)
class ModelSource:
    """The tiny model's files are copied; a hub model is named with its revision."""

    directory: Path | None  # copied into model/ when set
    hub_name: str | None = None
    hub_revision: str | None = None
    size_bytes: int = 0
    digest: str | None = None
    # A copied directory's `architectures` (config.json), and whether it is the harness's tiny
    # model (its cache directory): any small local model is copied, a user's own too.
    architecture: str | None = None
    harness_tiny: bool = False


@dataclass(frozen=True)
class ExportPlan:
    name: str  # the export directory's name
    bundle: Path
    case: ReproCase
    label: str  # the case's topology label in the bundle ("1E+1P+1D:epd-media-in-decode-tail")
    record: dict[str, Any]  # the case's record from summary.json
    servers: tuple[ExportedServer, ...]  # instances, in start order
    proxy: ExportedServer | None  # vLLM's proxy; None: requests go to one instance directly
    proxy_file: ProxyFile | None
    request: dict[str, Any]
    expected: dict[str, Any]
    model: ModelSource
    probe: str | None
    declared: str | None  # how the harness declares this failure, None if it does not
    run: dict[str, Any]  # the bundle's run.json
    # The case's reference (`serve.sh reference`; the monolithic one also `serve.sh
    # baseline`), to produce the expected answer on another machine; None for a probe, which
    # the baseline would refuse by design.
    reference: ReferenceServing | None = None
    # What of the original sending the export does not do (`Bundle.how_sent`), or None.
    sent_unlike: str | None = None
    # A sequential scenario's earlier requests, which check.py sends first (`before/`), and
    # what the run sent before the case, said (`Sending.after`); none for a case its scenario
    # sent first or alone, or a probe.
    before: tuple[EarlierRequest, ...] = ()
    sent_after: str | None = None
    # The recorded devices of the case's instances, by position in serve.sh's DEVICES (the
    # distinct devices in first-use order).
    devices: tuple[RecordedDevice, ...] = ()
    # The nodes a `--launcher ray` run spread the case's instances over (one host here), and
    # the cluster's network settings the export leaves out (`CLUSTER_ENV_PREFIXES`).
    nodes: tuple[str, ...] = ()
    dropped_env: tuple[tuple[str, str], ...] = ()
    # What the case's instances inherited from the run's environment that can change what they
    # compute (`.cmd.json`'s `inherited_env`), which serve.sh sets; a secret's value redacted.
    inherited_env: tuple[tuple[str, str], ...] = ()

    @property
    def entry(self) -> ExportedServer:
        return self.proxy or self.servers[0]

    @property
    def baseline(self) -> ExportedServer | None:
        """The monolithic reference, when it is the case's (`run.sh baseline`)."""
        reference = self.reference
        if reference is None or reference.name != BASELINE.name:
            return None
        return reference.servers[0]

    @property
    def proxy_files(self) -> tuple[ProxyFile, ...]:
        """vLLM's proxy files the export ships: the case's, and its reference's (1P+1D's toy
        proxy beside 1E+1P+1D's EPD proxy)."""
        files = (self.proxy_file, self.reference.proxy_file if self.reference else None)
        shipped = {f.relative: f for f in files if f is not None}
        return tuple(shipped.values())

    @property
    def send_to(self) -> ExportedServer:
        """Where check.py sends the request: the proxy, or the probed instance."""
        name = self.expected.get("send_to")
        return next((s for s in self.servers if s.name == name), self.entry)


def plan_export(
    bundle: Bundle,
    wanted: str | None = None,
    upstream: Callable[[], UpstreamProxy] | None = None,
    probe: str | None = None,
) -> ExportPlan:
    """What the export of one case holds; BadInput (one line) for what cannot be exported.

    `upstream` gives vLLM's proxy files; it is called only when the export needs the proxy
    (a probe goes to one instance directly), since it may fetch them.
    """
    refuse_unexportable(bundle)
    if probe is not None and probe not in PROBES:
        raise BadInput(f"unknown probe {probe!r} (known: {', '.join(PROBES)})")
    case, record = pick_case(bundle, wanted)
    label = record["topology"]
    body = bundle.requests.get(case.prompt)
    if body is None:
        raise BadInput(f"{bundle.path}: requests.json has no body for {case.prompt!r}")
    body = inline_local_media(body)
    sending = bundle.how_sent(label, case.prompt)
    if sending.streamed:  # sent as the run sent it: requests.json holds it before streaming
        body = streaming_request(body)
    sent_unlike = sending.unlike
    # A probe sends one crafted request to one instance: no scenario's stage is its question.
    before = earlier_requests(bundle, sending) if probe is None else ()
    if before:
        body = own_salt(body, CASE_SALT)
    if probe is None and not asks_for_logprobs(body):
        body = {**body, "logprobs": True, "top_logprobs": DEFAULT_TOP_LOGPROBS}
        added = "it asks for the top-5 log-probs (check.py's drift rule needs them)"
        sent_unlike = f"{sent_unlike}; {added}" if sent_unlike else added
    servers, devices = instance_servers(bundle, label, get_topology(case.topology).roles)
    proxy: ExportedServer | None = None
    proxy_file: ProxyFile | None = None
    reference: ReferenceServing | None = None
    if probe == UNKNOWN_UUID_PROBE:
        consumer = probed_consumer(servers, case)
        body = unknown_uuid_body(body, encoder_metadata(bundle, label, case.prompt), case)
        servers, devices = compacted((consumer,), devices)
        expected = survival_expectation(consumer)
    else:
        if upstream is None:
            raise ValueError("an export through vLLM's proxy needs its files")
        files = upstream()
        proxy, proxy_file = proxy_server(servers, files)
        expected = tokens_expectation(bundle, case, record, body)
        reference = reference_serving(bundle, case, files, dict(inherited_env(bundle, label)))
    return ExportPlan(
        name=export_name(bundle, case, probe),
        bundle=bundle.path,
        case=case,
        label=label,
        record=record,
        servers=servers,
        proxy=proxy,
        proxy_file=proxy_file,
        request=body,
        expected=expected,
        model=model_source(bundle),
        probe=probe,
        declared=declared_failure(bundle, label, case, record),
        run=bundle.run,
        reference=reference,
        sent_unlike=sent_unlike,
        before=before,
        sent_after=sending.after if before else None,
        devices=devices,
        # From the instances, not their devices: a CPU run on Ray pins none (real vLLM: the
        # export of a run spread over three nodes said nothing of them).
        nodes=tuple(dict.fromkeys(s.node for s in servers if s.node)),
        dropped_env=dropped_env(bundle, label),
        inherited_env=inherited_env(bundle, label),
    )


def earlier_requests(bundle: Bundle, sending: Sending) -> tuple[EarlierRequest, ...]:
    """The scenario's earlier requests as the run sent them before the case's: requests.json's
    bodies in the scenario's order, media inlined, streamed when the case is (the run streamed
    the scenario's every request alike), each under a cache salt of its own (`own_salt`).
    BadInput naming a body requests.json lacks."""
    try:
        bodies = bundle.earlier_bodies(sending)
    except BundleError as exc:
        raise BadInput(str(exc)) from None
    requests = []
    for number, (prompt, recorded) in enumerate(bodies, start=1):
        body = inline_local_media(recorded)
        if sending.streamed:
            body = streaming_request(body)
        requests.append(earlier_request(number, prompt, body))
    return tuple(requests)


def refuse_unexportable(bundle: Bundle) -> None:
    if bundle.proxy_kind == ATTACH_PROXY:
        raise BadInput(
            f"{bundle.path} judged an attached deployment: the harness never launched it, so "
            "there are no commands to export (nor can repro start it); rerun the case with "
            "'epd-harness run --proxy vllm' on the deployment's model and flags, and export "
            "that run"
        )
    killed = killed_by_the_load(bundle)
    if killed:
        raise BadInput(killed)
    golden = bundle.run.get("golden_release")
    if golden:
        raise BadInput(
            f"{bundle.path} was judged against the golden of vLLM {golden} (--golden): a "
            "release's recorded answer, which the export's vLLM alone cannot serve as the "
            "reference (its serve.sh starts the served release's own baseline, another "
            "comparison); rerun the case without --golden and export a run judged against its "
            "own baseline"
        )
    fault = bundle.run.get("fault")
    if fault or (bundle.path / "detection.json").is_file():
        raise BadInput(
            f"{bundle.path}: its failures were planted by the harness's self-test "
            f"({fault or 'graded faults'}), which no vLLM plugin in the export can carry: "
            "vLLM alone would not fail; export a run without --plant-fault"
        )


def pick_case(bundle: Bundle, wanted: str | None) -> tuple[ReproCase, dict[str, Any]]:
    """The named case (`TOPOLOGY:PROMPT[@REFERENCE]`), else the first that failed its policy,
    else the first failure the harness declares (a matrix scenario's expected failure passes
    its policy and is still a vLLM bug), else the first that is not a MATCH, as
    `Bundle.pick_record` decides (repro picks the same way, without the last two): a DRIFT its
    policy passed, which under pd-drift can precede the real failure, only when nothing failed.
    With its record from summary.json, whose topology label may name a scenario."""
    try:
        record = bundle.pick_record(wanted, declared_too=True)
    except BundleError as exc:
        raise BadInput(str(exc)) from None
    return case_of(record), record


def model_source(bundle: Bundle) -> ModelSource:
    """Copy a small local model; name a hub snapshot with its revision; refuse anything else."""
    model = bundle.serving().model
    digest = (bundle.run.get("model") or {}).get("digest")
    path = Path(model)
    snapshot = HF_SNAPSHOT.search(model)
    if path.is_dir():
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if size <= MAX_COPIED_MODEL_BYTES:
            return ModelSource(
                path,
                size_bytes=size,
                digest=digest,
                architecture=architecture_of(path),
                harness_tiny=path.name.startswith(TINY_MODEL_DIR_PREFIX),
            )
    if snapshot is not None:
        name = f"{snapshot['org']}/{snapshot['name']}"
        return ModelSource(None, name, snapshot["rev"], digest=digest)
    if not path.is_absolute() and model.count("/") == 1:
        return ModelSource(None, model, None, digest=digest)
    if not path.is_dir():
        raise BadInput(
            f"the bundle's model directory {model} is gone: rebuild it there (the tiny "
            "model: python -m fixtures.tiny_model DIR) or export on the machine "
            "that ran"
        )
    raise BadInput(
        f"the model {model} is larger than {MAX_COPIED_MODEL_BYTES >> 20} MiB and not a "
        "Hugging Face snapshot: an export cannot carry or name it"
    )


def architecture_of(model_dir: Path) -> str | None:
    """The model class config.json names (`Qwen2_5_VLForConditionalGeneration`), else its
    model_type, else None."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        return ", ".join(str(a) for a in architectures)
    model_type = config.get("model_type")
    return str(model_type) if model_type else None


def declared_failure(
    bundle: Bundle, label: str, case: ReproCase, record: dict[str, Any]
) -> str | None:
    """How the harness declares this failure: a matrix scenario's expectation, the rule a fuzz
    group was known by, or the release's declared failure (`docs/versions.md`, the record's
    `declared_failure`, found in review: read from a detail phrase the judge no longer wrote,
    every release-declared failure was exported as 'not declared'); None when it is not
    declared."""
    if case.verdict == Verdict.MATCH.value:
        return None
    scenario_name = label.partition(":")[2]
    scenarios = {s.name: s for s in MATRIX}
    if scenario_name in scenarios:
        connector = bundle.serving().kv_connector
        scenario = scenarios[scenario_name].for_kv_connector(connector)
        declared = scenario.declared_of(case.prompt)
        if declared is not None and case.verdict == declared.verdict:
            return f"matrix scenario {scenario.name} expects {case.verdict}: {scenario.reason}"
    detail = str(record.get("detail", ""))
    name = record.get("declared_failure")
    if name and record.get("policy_passed"):  # failed as the release's KnownFailure declares
        reason = detail.partition(DECLARED_UPSTREAM)[2]
        return f"declared for this release as {name}" + (f": {reason}" if reason else "")
    if "declared for this release:" in detail:  # a bundle judged before records named it
        return "declared for this release: " + detail.split("declared for this release:", 1)[1]
    # A fuzz group's bundle keeps its cases failing, so that repro and export pick them; the
    # rule the fuzz knew the group by is in summary.json (seen on real vLLM: a known group
    # exported as "not declared").
    known = ((bundle.summary.get("run") or {}).get("fuzz_group") or {}).get("known") or {}
    if known.get("verdict") == case.verdict:
        name, reason = known.get("name"), known.get("reason", "")
        return f"the fuzz's known failure {name} expects {case.verdict}: {reason}"
    return None


def export_name(bundle: Bundle, case: ReproCase, probe: str | None) -> str:
    """`vllm-0.32.0-1E-1P-1D-m-image-short-text-error`: release, case and what it showed."""
    version = str((bundle.run.get("served_vllm") or {}).get("version", "unknown"))
    release = version.split("+", 1)[0]
    outcome = probe or case.verdict.lower().replace("_", "-")
    return safe_name(f"vllm-{release}-{case.topology}-{case.prompt}-{outcome}")
