"""One place that turns a user's inputs into a checked, typed run configuration.

A vLLM topology costs tens of seconds to start and gigabytes to run. A typo in a topology name,
a model directory without `config.json`, a video that cannot fit `--max-model-len`, a port range
somebody else holds, or a flag that the chosen path would silently ignore should cost the user
one second and one line, not a baseline run followed by a traceback. Checks run cheapest first
(names and flag combinations, then files, then the vLLM version: a subprocess; then ports; then
the token count, which loads the model's processor unless cached; last every `vllm serve`
command line through the served vLLM's own parser, a subprocess unless cached). The first
problem raises `BadInput`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from harness.devices import host_cpuinfo, smi_gpu_indices
from harness.environment import cache_dir, port_range
from harness.errors import BadInput
from harness.files import fresh_run_dir
from harness.judge.policy import REFERENCE_POLICIES
from harness.judge.records import DeclaredFailure
from harness.preflight import dtype, files, names, resources, tokens, upstream_proxy
from harness.preflight.attach import load_attach_file
from harness.preflight.connectors import (
    check_kv_connector,
    ec_connector_for,
    kv_connector_for,
    platform_kv_connector,
)
from harness.preflight.launcher import (
    check_launcher_here,
    launcher_choice,
    refuse_ray_flags_without_ray,
    sized_for,
)
from harness.preflight.model import resolve_model
from harness.preflight.vllm import (
    check_cpu_build,
    check_vllm,
    default_vllm_executable,
    served_generation,
)
from harness.preflight.vllm_args import check_served_argvs, serve_argvs
from harness.run.baseline_cache import BaselineCache
from harness.run.faults.spec import (
    KV_FAULTS,
    STREAM_FAULTS,
    fault_reaches,
    faulted_reference,
    parse_fault,
    refuse_unreached_prompts,
)
from harness.run.goldens import GoldenStore, golden_release_argument
from harness.run.scenarios import (
    MATRIX,
    Scenario,
    attached_prompt,
    get_scenario,
    matrix_prompts,
)
from harness.spec.attach import AttachSpec
from harness.spec.connectors import EcConnector, KvConnector, get_kv_connector
from harness.spec.placement import TooFewDevices
from harness.spec.platforms import (
    DEFAULT_CPU_CORES,
    DevicePlanError,
    PlatformProfile,
    check_host_devices,
    check_inherited_devices,
    get_platform,
    parse_devices,
)
from harness.spec.prompts import SKELETON_PROMPTS, PromptSpec, render_request
from harness.spec.settings import (
    ATTACH_PROXY,
    DYNAMIC_REGISTRATION,
    HARNESS_PROXY,
    LOCAL_LAUNCHER,
    PROXY_KINDS,
    RAY_LAUNCHER,
    REGISTRATION_MODES,
    STATIC_REGISTRATION,
    VLLM_PROXY,
    LauncherChoice,
    ProxyChoice,
    RunSettings,
    ServedVllm,
)
from harness.spec.topology import (
    EPD_TOPOLOGY_NAMES,
    TOPOLOGIES,
    Topology,
    serving_for,
)

DEFAULT_MAX_MODEL_LEN = 4096
# Under RunRequest.session_dir: the entries a `--refresh-baseline` session has refreshed, and
# the baseline cache of a `--baseline-cache off` session whose workers share devices.
BASELINE_REFRESHED_DIR = "baseline-refreshed"
SESSION_BASELINE_DIR = "baseline"
# On cpu vLLM captures no graphs (it empties the capture sizes) and would only trade eager for
# an inductor compile at every start; every CPU figure of this project is eager.
NO_ENFORCE_EAGER_ON_CPU = (
    "--no-enforce-eager lets vLLM capture GPU graphs; on cpu there are none to capture and "
    "the harness's CPU runs are eager by design: drop --no-enforce-eager"
)
COLOCATE_ON_CPU = (
    "--colocate shares GPUs within a topology; on cpu instances always share the cores: "
    "drop --colocate"
)
# Ray puts each instance in a placement-group bundle of one GPU of its own (on a node Ray
# chooses), so nothing shares a device there, whatever the harness's device plan says.
COLOCATE_ON_RAY = (
    "--colocate lets a topology's instances share this host's GPUs; --launcher ray gives "
    "each instance a GPU of its own on the node Ray places it on: drop --colocate"
)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRequest:
    """What a user asked for, as given (names and paths, unchecked)."""

    topologies: tuple[str, ...] = ()  # empty: every EPD topology
    # A pytest session's: the topologies its selected items run (the baseline among them).
    # Only the instances' plan (devices, argv) follows them; the flags are the session's and are
    # checked against `topologies`. Empty: the plan is `topologies`'.
    served_topologies: tuple[str, ...] = ()
    prompts: tuple[str, ...] = ()  # empty: the sweep's prompts
    cases_file: str | None = None
    scenarios: tuple[str, ...] = ()  # matrix scenarios, or ("all",)
    model: str | None = None  # directory or hub name; None: the platform's default
    run_dir: str | None = None
    vllm: str | None = None
    allow_untested_vllm: bool = False
    protocol: str | None = None  # a protocol generation's name; None: by the served version
    golden: str | None = None  # a release (e.g. 0.31.0) whose stored baseline stands in
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    devices: str | None = None
    media_dir: str | None = None
    baseline_cache: str | None = None  # a directory, "off", or None for the default
    refresh_baseline: bool = False
    platform: str = "cpu"
    colocate: bool = False
    plant_fault: str | None = None
    workers: int = 1  # parallel pytest-xdist workers sharing the devices
    worker_id: str | None = None  # an xdist worker's ("gw0"...): its run directory's own
    # A directory every process of this session (pytest's xdist workers) shares and no earlier
    # session left anything in: where a baseline refresh is recorded once done, and where the
    # baseline of `--baseline-cache off` is shared while workers share devices. None: one process.
    session_dir: str | None = None
    count_tokens: bool = True  # check that every prompt fits (loads the processor once)
    kv_connector: str | None = None  # "example" or "nixl"; None: the platform's default
    ec_connector: str | None = None  # "example" (the only one that runs); None: example
    proxy: str = HARNESS_PROXY  # the EPD proxy under test: "harness", "vllm" or "attach"
    vllm_source: str | None = None  # a vLLM checkout holding its proxy files (--proxy vllm)
    # How vLLM's proxy learns the instances; None: not given (static, with --proxy vllm).
    proxy_registration: str | None = None
    attach: str | None = None  # the attach file of a running deployment (--proxy attach)
    launcher: str = LOCAL_LAUNCHER  # where instances run: "local" (this host) or "ray"
    ray_address: str | None = None  # a Ray cluster's GCS; None: a one-host rehearsal cluster
    ray_placement: str | None = None  # "spread" (default) or "pack"
    ray_shared_dir: str | None = None  # a directory every node sees (ExampleConnector storage)
    ray_instance_env: tuple[str, ...] = ()  # KEY=VALUE given to every instance on the cluster
    # How each (topology, reference) pair is judged; None: the platform's default.
    reference_policy: str | None = None
    # EPD topologies are sent streamed requests (--stream).
    stream: bool = False
    # Prompts given as specs, not names (a load's mix): checked like named ones.
    prompt_specs: tuple[PromptSpec, ...] = ()
    # The command sends requests it draws itself (fuzz), never `prompts`: a planted fault is
    # judged against what it may draw (harness.run.fuzz.space.fault_refusal), not the prompts.
    draws_own_requests: bool = False
    # The baseline stays up beside the topology (fuzz sends every example to both): a
    # rehearsal Ray cluster needs a node for it too (`harness.preflight.launcher.sized_for`).
    baseline_beside: bool = False
    # GPU platforms: drop --enforce-eager, so vLLM compiles and captures graphs (upstream's
    # correctness script, and the harness by default, serve eager).
    no_enforce_eager: bool = False
    # The dtype every instance computes in (harness.preflight.dtype says what is refused);
    # None: not given, DEFAULT_DTYPE (`dtype.dtype_or_default`), which a refusal calls the
    # default, and only then.
    dtype: str | None = None


@dataclass(frozen=True)
class RunConfig:
    """A run, checked: what to start, what to send, where to write, what to compare with."""

    topologies: tuple[Topology, ...]
    prompts: tuple[PromptSpec, ...]
    cases: tuple[names.RequestedCase, ...]  # from a cases file: only these are judged
    matrix: tuple[Scenario, ...]  # matrix scenarios, judged as declared
    settings: RunSettings
    baseline_cache: BaselineCache | None
    fault: str | None
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    # With --attach: the failures matrix scenarios declare for the prompts named (prompt ->
    # failure), judged as declared on the attached topology (`attached_prompt`).
    declared: tuple[tuple[str, DeclaredFailure], ...] = ()
    # Where every baseline answer is kept per release (None with --baseline-cache off), and
    # the release whose goldens replace the baseline (--golden).
    goldens: GoldenStore | None = None
    golden_release: str | None = None


@dataclass(frozen=True)
class CheckedArguments:
    """A request's names, values and flag combinations, checked from the arguments alone."""

    platform: PlatformProfile
    launcher: LauncherChoice
    attach: AttachSpec | None  # the --attach file as read; None where it was not read
    matrix: tuple[Scenario, ...]
    cases: tuple[names.RequestedCase, ...]  # the --cases-file's; () where it was not read
    topologies: tuple[Topology, ...]
    prompts: tuple[PromptSpec, ...]
    kv_connector: KvConnector
    ec_connector: EcConnector
    devices: tuple[int, ...]  # as given, or the default; () where nothing starts here
    golden_release: str | None
    declared: tuple[tuple[str, DeclaredFailure], ...] = ()  # RunConfig.declared


def check_arguments(request: RunRequest, *, read_files: bool = True) -> CheckedArguments:
    """The first checks of `prepare_run`: names, values and flags that contradict each other,
    needing no subprocess and nothing of this machine. With `read_files=False` the --attach and
    --cases-file files are named but not read, for a command line that is only shown, with
    placeholders for its files (the documentation's, tests/test_docs_commands.py); the
    topologies are then the ones the flags name."""
    _refuse_ignored_flags(request)
    dtype.check_dtype_name(dtype.dtype_or_default(request.dtype))
    platform = get_platform(request.platform)
    launcher = launcher_choice(request)
    refusal = launcher.refusal_on(platform)
    if refusal is not None:
        raise BadInput(refusal)
    attach = _attach(request, platform) if read_files else None
    matrix = _scenarios(request.scenarios)
    cases = names.load_cases_file(request.cases_file) if request.cases_file and read_files else ()
    if attach is not None:
        topology_names = [attach.topology.name]
        prompt_names: list[str] = list(request.prompts)
    elif matrix:
        topology_names = list(dict.fromkeys(s.topology for s in matrix))
        prompt_names = []
    elif cases:
        topology_names = list(dict.fromkeys(c.topology for c in cases))
        prompt_names = list(dict.fromkeys(c.prompt for c in cases))
    else:
        topology_names = list(request.topologies) or list(EPD_TOPOLOGY_NAMES)
        prompt_names = list(request.prompts)
    topologies = names.check_topologies(topology_names)
    launcher = sized_for(launcher, topologies, request.baseline_beside)
    if any(t.is_baseline for t in topologies):  # found in review: it ran, and judged nothing
        raise BadInput(
            "--topology baseline: 'baseline' is the reference every case is compared with; "
            "name an EPD topology"
        )
    if request.proxy_registration == DYNAMIC_REGISTRATION and not any(
        t.has_ec_transfer for t in topologies
    ):
        raise BadInput(
            f"--proxy-registration dynamic registers instances with vLLM's EPD proxy, and "
            f"none of {', '.join(t.name for t in topologies)} has an encoder (1P+1D runs the "
            f"toy P/D proxy, which takes only static URLs); add 1E+1PD or 1E+1P+1D"
        )
    if request.reference_policy and not any(t.has_kv_transfer for t in topologies):
        # `ReferencePolicy.policy_for`: the policies part only there (found in review).
        raise BadInput(
            f"--reference-policy {request.reference_policy} chooses how a topology with a P->D "
            "hop is judged against the monolithic baseline (every other comparison is judged "
            f"alike under either), and none of {', '.join(t.name for t in topologies)} has "
            "one; drop it or add a P->D topology (1P+1D, 1E+1P+1D)"
        )
    requested_kv = kv_connector_for(request.kv_connector, topologies, platform)
    ec_connector = ec_connector_for(request.ec_connector, topologies)
    # An attached deployment's is its own, as its attach file says.
    kv_connector = get_kv_connector(attach.kv_connector) if attach is not None else requested_kv
    declared: list[tuple[str, DeclaredFailure]] = []
    if matrix:
        prompts = matrix_prompts(matrix)
    elif request.prompt_specs:
        prompts = request.prompt_specs
    elif attach is not None and prompt_names:
        prompts, declared = _attached_prompts(prompt_names, attach, kv_connector, request.stream)
    else:
        prompts = names.check_prompts(prompt_names) if prompt_names else SKELETON_PROMPTS
    golden = golden_release(request.golden, request.baseline_cache, request.refresh_baseline)
    # Attached with --golden nothing starts on this host: no device of it is the run's.
    devices = _parse_devices(request.devices, platform, starts_here=not (request.attach and golden))
    if launcher.shared_dir is not None and not any(
        t.has_ec_transfer or (t.has_kv_transfer and kv_connector.uses_shared_storage)
        for t in topologies
    ):
        raise BadInput(
            f"--ray-shared-dir holds the connectors' files (ExampleConnector's), and none of "
            f"{', '.join(t.name for t in topologies)} writes any (no encoder; KV by "
            f"{kv_connector.name}): drop --ray-shared-dir"
        )
    if request.plant_fault is not None:
        fault = parse_fault(request.plant_fault)  # a plain or graded fault: BadInput
        if fault.kind in STREAM_FAULTS and not request.stream:
            raise BadInput(
                f"--plant-fault {fault.kind} acts on streamed answers only: add --stream"
            )
        if fault.kind == "kv-noise" and kv_connector.name == "nixl":
            raise BadInput(
                "--plant-fault kv-noise rewrites ExampleConnector's KV files; with "
                "--kv-connector nixl the KV never leaves P's memory (zero-kv "
                "misroutes NIXL's block ids instead)"
            )
        unreached = [t.name for t in topologies if not fault_reaches(fault.kind, t)]
        if unreached:
            part = "P->D hop" if fault.kind in KV_FAULTS else "encoder"
            raise BadInput(
                f"--plant-fault {request.plant_fault}: {', '.join(unreached)} "
                f"{'has' if len(unreached) == 1 else 'have'} no {part} for it to act on; "
                f"leave {'it' if len(unreached) == 1 else 'them'} out with --topology"
            )
        # The taps run `after_encode` per encoder answer, and vLLM's proxy sends each encoder
        # its own items (round-robin): two items of a request never reach one hook together.
        split = [t.name for t in topologies if t.encoders > 1]
        if fault.kind == "ec-swap-items" and request.proxy == VLLM_PROXY and split:
            where = ", ".join(split)
            raise BadInput(
                f"--plant-fault ec-swap-items: vLLM's proxy sends each of {where}'s encoders "
                "its own items, and each encoder's answer (where the fault acts) holds one of a "
                f"request's two: nothing to swap; leave {where} out with --topology (or use "
                "--proxy harness)"
            )
        if not request.draws_own_requests:
            refuse_unreached_prompts(request.plant_fault, prompts)
        conflict = faulted_reference(request.plant_fault, topologies)
        if conflict is not None:
            raise BadInput(conflict)
    return CheckedArguments(
        platform=platform,
        launcher=launcher,
        attach=attach,
        matrix=matrix,
        cases=cases,
        topologies=topologies,
        prompts=prompts,
        kv_connector=kv_connector,
        ec_connector=ec_connector,
        devices=devices,
        golden_release=golden,
        declared=tuple(declared),
    )


def _attached_prompts(
    prompt_names: list[str], attach: AttachSpec, kv_connector: KvConnector, stream: bool
) -> tuple[tuple[PromptSpec, ...], list[tuple[str, DeclaredFailure]]]:
    """--prompt on an attached deployment: a skeleton prompt, or a matrix scenario's (the
    deployment `repro --keep-up` leaves serves a scenario's case, whose prompt --scenario,
    which launches its topology, cannot send there), with the failure it is declared to have."""
    skeleton = {p.name for p in SKELETON_PROMPTS}
    prompts: list[PromptSpec] = []
    declared: list[tuple[str, DeclaredFailure]] = []
    for name in prompt_names:
        found = (
            None
            if name in skeleton
            else attached_prompt(name, attach.topology.name, kv_connector.vllm_class, stream)
        )
        if found is None:
            try:
                prompts.extend(names.check_prompts([name]))
            except BadInput as exc:  # said that only the skeleton's are known
                raise BadInput(f"{exc}, or a matrix scenario's, such as m-one-image") from None
            continue
        prompts.append(found[0])
        if found[1] is not None:
            declared.append((name, found[1]))
    return tuple(prompts), declared


def prepare_run(request: RunRequest) -> RunConfig:
    arguments = check_arguments(request)
    platform, attach, topologies = arguments.platform, arguments.attach, arguments.topologies
    kv_connector, ec_connector = arguments.kv_connector, arguments.ec_connector
    check_launcher_here(arguments.launcher)
    launched = () if attach is not None else topologies
    if attach is None and request.served_topologies:
        launched = names.check_topologies(request.served_topologies)
    # --golden stands a release's stored answers in for the baseline: it never starts
    # (`BaselineAnswers.load_stored`), so nothing of it is checked here. Attached as well,
    # nothing starts at all: no core, GPU, CPU feature or port of this host is the run's.
    starts_baseline = arguments.golden_release is None
    starts_any = starts_baseline or bool(launched)
    # Attached, the harness still launches the baseline here (unless --golden), on the first
    # of --devices.
    places_here = arguments.launcher.kind != RAY_LAUNCHER and starts_any
    served_dtype = dtype.dtype_or_default(request.dtype)
    source = "--devices" if request.devices is not None else "the default devices"
    devices = (
        devices_here(arguments.devices, platform, source, places_here)
        if starts_any
        else arguments.devices
    )
    if platform.name == "cuda" and places_here:
        # Here run the instances (or, attached, the baseline): their GPUs can be read.
        dtype.check_bf16_here(request.dtype, devices)
    ports = port_range()

    model_dir = resolve_model(request.model, platform.default_model, cache_dir())
    tokens.check_model_limit(request.max_model_len, files.max_position_tokens(model_dir))
    media_dir = files.check_media_dir(request.media_dir) if request.media_dir else None
    run_dir = _run_dir(request)
    files.check_run_dir(run_dir)
    baseline_cache = _baseline_cache(request)
    # Where --golden reads: beside the cache asked for, whatever the served version (which
    # may drop the cache below): a golden is another release's answer (found in review).
    goldens_beside = baseline_cache

    served = check_vllm(request.vllm or default_vllm_executable(), request.allow_untested_vllm)
    if attach is not None:
        proxy = ProxyChoice(ATTACH_PROXY, origin=str(attach.source), attach=attach)
    else:
        proxy = upstream_proxy.proxy_choice(
            request.proxy,
            request.vllm_source,
            served,
            cache_dir(),
            request.proxy_registration or STATIC_REGISTRATION,
        )
    protocol = served_generation(served, request.protocol)
    if protocol.warning:
        log.warning("epd-harness: %s", protocol.warning)
    if not served.known:
        _refuse_cache_flags_of_an_unknown_version(request, served)
        baseline_cache = None  # an unknown version must never match another's baseline
    if attach is None:  # an attached deployment brings its own build and connector
        check_cpu_build(served, platform.name)
        check_kv_connector(served, kv_connector, platform)
    if platform.name == "cpu" and places_here:
        dtype.check_cpu_dtype(served_dtype, dict(served.libraries), host_cpuinfo())
    serving = serving_for(
        platform,
        str(model_dir),
        max_model_len=request.max_model_len,
        allowed_local_media_path=str(media_dir) if media_dir else None,
        kv_connector=kv_connector.vllm_class,
        ec_connector=ec_connector.vllm_class,
        enforce_eager=platform.enforce_eager and not request.no_enforce_eager,
        dtype=served_dtype,
    )
    started = (*((TOPOLOGIES["baseline"],) if starts_baseline else ()), *launched)
    if started:
        resources.check_free_ports(max(resources.ports_held(t, serving) for t in started), ports)
    prompts = arguments.prompts
    bodies = {p.name: render_request(p, serving.served_model_name) for p in prompts}
    files.check_media_references(bodies, media_dir)
    prompt_tokens: dict[str, int] = {}
    if request.count_tokens:
        prompt_tokens = tokens.estimate_prompt_tokens(
            model_dir, bodies, cache_dir() / "prompt-tokens"
        )
        tokens.check_prompts_fit(request.max_model_len, prompts, prompt_tokens)
    try:
        argvs = serve_argvs(
            launched,
            serving,
            platform,
            devices,
            request.colocate,
            protocol.generation,
            baseline_starts=starts_baseline,
        )
    except TooFewDevices as exc:
        raise resources.too_few_devices(exc, launched) from None
    # Attached with --golden nothing starts: no line to judge, and run.json says so (None).
    argv_check = check_served_argvs(argvs, served) if argvs else None
    settings = RunSettings(
        serving=serving,
        run_dir=run_dir,
        vllm=served,
        platform=platform,
        devices=devices,
        colocate=request.colocate,
        workers=request.workers,
        proxy=proxy,
        protocol=protocol.generation,
        launcher=arguments.launcher,
        reference_policy=request.reference_policy or "",
        stream=request.stream,
        argv_check=argv_check.to_json() if argv_check is not None else None,
    )
    golden_release = arguments.golden_release
    goldens = _goldens(golden_release, goldens_beside if golden_release else baseline_cache)
    baseline_cache = _run_baseline_cache(baseline_cache, served, request, platform, golden_release)
    return RunConfig(
        goldens=goldens,
        golden_release=golden_release,
        topologies=topologies,
        prompts=arguments.prompts,
        cases=arguments.cases,
        matrix=arguments.matrix,
        declared=arguments.declared,
        settings=settings,
        baseline_cache=baseline_cache,
        fault=request.plant_fault,
        prompt_tokens=prompt_tokens,
    )


def _refuse_ignored_flags(request: RunRequest) -> None:
    """A flag the chosen path would ignore is refused, never dropped: a self-test whose fault
    was silently not planted comes out green."""
    names.refuse_repeats("--topology", request.topologies)
    names.refuse_repeats("--prompt", request.prompts)
    if request.cases_file and (request.topologies or request.prompts):
        raise BadInput("--cases-file names the cases itself; drop --topology and --prompt")
    if request.scenarios and (request.topologies or request.prompts or request.cases_file):
        raise BadInput(
            "--scenario names its topology and prompts; drop --topology, --prompt and --cases-file"
        )
    if request.scenarios and request.plant_fault:
        raise BadInput(
            "--plant-fault plants its fault in the sweep's topologies, not in matrix "
            "scenarios; drop --scenario (or --plant-fault)"
        )
    if request.refresh_baseline and request.baseline_cache == "off":
        raise BadInput(
            "--refresh-baseline refreshes the baseline cache, which "
            "--baseline-cache off turns off; drop one of them"
        )
    if request.prompt_specs and (request.prompts or request.cases_file or request.scenarios):
        raise BadInput(
            "a load sends its own mix of prompts; drop --prompt, --cases-file and --scenario"
        )
    if request.reference_policy and request.reference_policy not in REFERENCE_POLICIES:
        raise BadInput(
            f"--reference-policy {request.reference_policy}: choose one of "
            f"{', '.join(REFERENCE_POLICIES)}"
        )
    if request.proxy not in PROXY_KINDS:
        raise BadInput(f"--proxy {request.proxy}: choose one of {', '.join(PROXY_KINDS)}")
    if request.proxy_registration is not None:
        refuse_registration_without_vllm_proxy(request.proxy_registration, request.proxy)
    if request.vllm_source and request.proxy != VLLM_PROXY:
        raise BadInput(
            "--vllm-source gives vLLM's proxy files, which only --proxy vllm runs; "
            "add --proxy vllm (or drop --vllm-source)"
        )
    if request.proxy == ATTACH_PROXY:
        _refuse_flags_attach_ignores(request)
    elif request.attach:
        raise BadInput(
            f"--attach judges a running deployment through its own proxy; drop --proxy "
            f"{request.proxy} (or --attach)"
        )
    refuse_ray_flags_without_ray(request)
    if request.colocate and request.platform == "cpu":
        raise BadInput(COLOCATE_ON_CPU)
    if request.colocate and request.launcher == RAY_LAUNCHER:
        raise BadInput(COLOCATE_ON_RAY)
    if request.no_enforce_eager and request.platform == "cpu":
        raise BadInput(NO_ENFORCE_EAGER_ON_CPU)


def refuse_registration_without_vllm_proxy(registration: str, proxy: str) -> None:
    """`--proxy-registration` says how vLLM's EPD proxy learns the instances: given with any
    other proxy it is refused, `static` too (found in the audit of ignored flags: `run
    --proxy-registration static` ran the harness's proxy, judging no proxy of vLLM's)."""
    if registration not in REGISTRATION_MODES:
        raise BadInput(
            f"--proxy-registration {registration}: choose one of {', '.join(REGISTRATION_MODES)}"
        )
    if proxy == VLLM_PROXY:
        return
    how = (
        "registers the instances with vLLM's proxy"
        if registration == DYNAMIC_REGISTRATION
        else "gives vLLM's proxy the instances' URLs on its command line"
    )
    raise BadInput(
        f"--proxy-registration {registration} {how}, which only --proxy vllm runs; add "
        "--proxy vllm (or drop --proxy-registration)"
    )


def _refuse_flags_attach_ignores(request: RunRequest) -> None:
    """Attach mode launches nothing but the baseline: flags that shape what is launched, or
    that act in the harness's own proxy or taps, would be ignored."""
    if not request.attach:
        raise BadInput("--proxy attach judges a running deployment: name it with --attach FILE")
    if request.plant_fault:
        raise BadInput(
            "--plant-fault plants its fault in the harness's proxy or taps, and an attached "
            "deployment has neither; drop --plant-fault (or --attach)"
        )
    if request.kv_connector:
        raise BadInput(
            "--kv-connector sets the connector of topologies the harness launches; an "
            "attached deployment's is the attach file's kv_connector: drop --kv-connector"
        )
    if request.ec_connector:
        raise BadInput(
            "--ec-connector sets the connector of topologies the harness launches; an "
            "attached deployment moves embeddings with its own: drop --ec-connector"
        )
    if request.colocate:
        raise BadInput(
            "--colocate lets the instances of a topology the harness launches share devices; "
            "with --attach it launches only the baseline, one instance: drop --colocate"
        )
    if request.scenarios or request.cases_file:
        flag = "--scenario" if request.scenarios else "--cases-file"
        # A scenario's own prompts are sent with --prompt, judged as it declares them (the
        # deployment `repro --keep-up` leaves serves one): say which (found by an audit).
        named = [n for n in request.scenarios if n in {s.name for s in MATRIX}]
        its = ",".join(p.name for n in named for p in get_scenario(n).prompts)
        instead = f"its prompts with --prompt {its}" if its else "prompts with --prompt"
        raise BadInput(
            f"{flag} names topologies to launch; with --attach the deployment is the "
            f"topology: drop {flag} and choose {instead}"
        )


def _attach(request: RunRequest, platform: PlatformProfile) -> AttachSpec | None:
    """The attached deployment (--proxy attach); a --topology must be the one it makes."""
    if request.proxy != ATTACH_PROXY or not request.attach:
        return None
    attach = load_attach_file(request.attach, platform_kv_connector(platform).name)
    if request.topologies and list(request.topologies) != [attach.topology.name]:
        raise BadInput(
            f"--topology {','.join(request.topologies)}: the attach file describes "
            f"{attach.topology.name}, the one topology it judges; drop --topology"
        )
    return attach


def _scenarios(requested: tuple[str, ...]) -> tuple[Scenario, ...]:
    if not requested:
        return ()
    if list(requested) == ["all"]:
        return MATRIX
    if "all" in requested:
        raise BadInput(
            f"--scenario {','.join(requested)}: 'all' names every scenario; give it alone, "
            "or name the scenarios without it"
        )
    return tuple(get_scenario(name) for name in requested)


def _parse_devices(
    text: str | None, platform: PlatformProfile, starts_here: bool
) -> tuple[int, ...]:
    """The CPU cores, or the GPU / XPU indices to spread instances over (required there), as
    written; () where nothing starts on this host (`starts_here` false: attached, with
    --golden): nothing would be placed on them, so they are not asked for, and given they are
    refused rather than ignored (found in review: cuda required them, run.json described this
    host's GPUs as the run's)."""
    if not starts_here:
        if text is not None:
            raise BadInput(
                "--devices places what the harness starts on this host, and attached with "
                "--golden it starts nothing on this host (the deployment serves elsewhere, "
                "the stored answers stand in for the baseline): drop --devices"
            )
        return ()
    if platform.exclusive_devices and text is None:
        raise BadInput(f"--platform {platform.name} needs --devices (e.g. --devices 0,1,2,3)")
    try:
        return parse_devices(text) if text is not None else DEFAULT_CPU_CORES
    except DevicePlanError as exc:
        raise BadInput(f"--devices: {exc}") from None


def devices_here(
    devices: tuple[int, ...], platform: PlatformProfile, source: str, places_here: bool
) -> tuple[int, ...]:
    """On cpu, the cores this process may use (the default cores are checked too); on GPUs,
    where this host's instances are placed (not by Ray; attached, the baseline), those an
    inherited CUDA_VISIBLE_DEVICES gives it (`check_inherited_devices`) and, on cuda, that
    nvidia-smi lists (`check_host_devices`). `repro` checks its devices here too. `source`:
    what named the devices, as a refusal names them ("--devices", "the default devices",
    repro's "the bundle's devices")."""
    if platform.exclusive_devices:
        if places_here:
            try:
                check_inherited_devices(platform, devices, os.environ, source)
                if platform.name == "cuda":
                    check_host_devices(platform, devices, smi_gpu_indices(), source)
            except DevicePlanError as exc:
                raise BadInput(str(exc)) from None
        return devices
    return resources.check_devices(devices, resources.available_cpu_cores(), source)


def _run_dir(request: RunRequest) -> Path:
    if request.run_dir:
        path = Path(request.run_dir)
    else:
        path = fresh_run_dir(Path("runs"))
    if request.worker_id:
        # Workers never write into each other's artifacts, and a lone xdist worker (`-n 1`, the
        # nightly's 2-GPU leg, the rehearsal on 4 GPUs) keeps its bundle apart from the root
        # too: there its junit.xml was the one pytest's --junitxml RUN_ROOT/junit.xml
        # overwrote, and the session's summary (gw*/verdicts.txt) showed no verdicts.
        path = path / request.worker_id
    return path.resolve()


def golden_release(
    golden: str | None, baseline_cache: str | None, refresh_baseline: bool
) -> str | None:
    """The release `--golden` names, whose stored baseline stands in for one. `--golden` starts
    no baseline, so the baseline cache's options mean nothing to it but where the goldens are
    (`_goldens`: beside a --baseline-cache DIR): a refresh or `off` would be dropped. Shared
    with `versions`, which forwards both to each release's run: refused there before a venv
    is built."""
    if golden is None:
        return None
    if refresh_baseline:
        raise BadInput(
            "--golden starts no baseline, so there is nothing to refresh; drop "
            "--refresh-baseline (or --golden)"
        )
    release = golden_release_argument(golden)
    if baseline_cache == "off":
        raise BadInput(
            f"--golden {golden} starts no baseline and reads the goldens kept beside the "
            "baseline cache, which --baseline-cache off does not change: drop "
            "--baseline-cache off (a --baseline-cache DIR moves the goldens beside DIR)"
        )
    return release


def refuse_prompts_without_goldens(request: RunRequest) -> None:
    """`--golden RELEASE`: a prompt of which the goldens directory holds no golden of that
    release at all (for any model or flags) is refused before anything runs. Each run checks
    the golden of its very request only once its vLLM is probed; `versions 0.30.0..0.32.0
    --golden 0.31.0 --prompt image` without an image golden of 0.31.0 built a 3.3 GB venv
    and ran every release only to fail each the same way (real vLLM: 365 s)."""
    release = golden_release(request.golden, request.baseline_cache, refresh_baseline=False)
    if release is None:
        return
    store = _goldens(release, _baseline_cache(request))
    assert store is not None  # a golden release always has its store
    prompts = (
        [p.name for p in names.check_prompts(request.prompts)]
        if request.prompts
        else [p.name for p in SKELETON_PROMPTS]
    )
    missing = sorted(set(prompts) - store.prompts_of(release))
    if missing:
        raise BadInput(
            f"no golden of vLLM {release} for prompt(s) {', '.join(missing)} under "
            f"{store.directory} (of any model or flags); run that release's sweep of "
            "them once, as the goldens' run, to store them"
        )


def _goldens(
    golden_release: str | None, baseline_cache: BaselineCache | None
) -> GoldenStore | None:
    """Goldens live beside the baseline cache; --golden reads them even when it is off."""
    directory = (baseline_cache.directory.parent if baseline_cache else cache_dir()) / "goldens"
    if golden_release is None:
        return GoldenStore(directory) if baseline_cache else None
    return GoldenStore(directory)


def _baseline_cache(request: RunRequest) -> BaselineCache | None:
    """The baseline cache the options name; with `refresh_baseline`, its refresh recorded in
    the session's shared directory, so that a session refreshes each entry once, however many
    workers need it."""
    value = request.baseline_cache
    if value == "off":
        return None
    directory = Path(value).expanduser().resolve() if value else cache_dir() / "baseline"
    if directory.exists() and not directory.is_dir():
        raise BadInput(f"baseline cache {directory} is not a directory (pass a directory or 'off')")
    ledger = Path(request.session_dir) / BASELINE_REFRESHED_DIR if request.session_dir else None
    return BaselineCache(directory, refresh=request.refresh_baseline, refresh_ledger=ledger)


def _refuse_cache_flags_of_an_unknown_version(request: RunRequest, served: ServedVllm) -> None:
    """A served vLLM whose version cannot be read (--allow-untested-vllm) has no baseline
    cache, so `--baseline-cache DIR` and `--refresh-baseline` would be dropped: refused, never
    dropped without a word (found in review). With --golden a DIR says where the goldens are,
    which the version does not change."""
    given = []
    if request.baseline_cache not in (None, "off") and request.golden is None:
        given.append(f"--baseline-cache {request.baseline_cache}")
    if request.refresh_baseline:
        given.append("--refresh-baseline")
    if given:
        raise BadInput(
            f"{' and '.join(given)}: baselines are cached by the served vLLM's version, and "
            f"the version of {served.executable} cannot be read (it is not a Python script), "
            f"so none would be read or kept: drop {'it' if len(given) == 1 else 'them'}"
        )


def _run_baseline_cache(
    asked: BaselineCache | None,
    served: ServedVllm,
    request: RunRequest,
    platform: PlatformProfile,
    golden_release: str | None,
) -> BaselineCache | None:
    """The cache the run's baselines are read from and kept in: the one asked for, none for a
    build whose code cannot be told apart (an editable install whose state could not be read:
    a key would name no code), else the session's private one where parallel workers share
    devices."""
    if served.cache_refusal is not None:
        if asked is not None:
            log.warning("epd-harness: %s", served.cache_refusal)
        return None  # each worker computes its own baseline, as `off` would without sharing
    if asked is None and served.known and golden_release is None:
        return _session_private_cache(request, platform)
    return asked


def _session_private_cache(request: RunRequest, platform: PlatformProfile) -> BaselineCache | None:
    """For `--baseline-cache off` where parallel workers share devices: a cache in the
    session's shared directory, empty when the session begins. Off means no answer is read
    from, or kept for, another session; without any cache each worker that judges anything
    would start a baseline of its own (found in review). Shared within the session it starts
    once, as with a cache. Chosen over refusing `off` under xdist: the option keeps its meaning
    and costs one start, and nothing of it outlives the session's run directory."""
    if request.baseline_cache != "off" or request.session_dir is None:
        return None
    if not (platform.exclusive_devices and request.workers > 1):
        return None  # one process, or one worker for every e2e item (a CPU host): no sharing
    return BaselineCache(Path(request.session_dir) / SESSION_BASELINE_DIR)
