"""`epd-harness export RUN_DIR`: one case of a run bundle as a directory that reproduces it with
vLLM alone, for a vLLM issue.

The harness is what found the failure; it must not be what a vLLM developer needs to see it.
So the export holds only what vLLM itself runs: every instance's recorded `vllm serve` command
and environment (ports, host, model and connector storage turned into shell variables), the
served release's own proxy (`disagg_epd_proxy.py`, or for 1P+1D the toy proxy of vLLM's NIXL
tests) pointed straight at the instances, the request body exactly as the harness sent it, the
case's reference's token ids to expect (with the policy and noise floor it was judged by), a
`check.py` on the standard library alone, the model (the tiny model's files, or a hub model's
name and revision) and an `ISSUE.md` drafting the report. Devices become positions that
serve.sh maps onto `DEVICES` (a Ray run's nodes onto this one host), never the recording
host's indices.
`harness.run.export_files` writes it; this module decides what goes in.

Upstream's proxy is shipped beside the scripts (unmodified, its Apache-2.0 header intact, its
sha256 recorded and checked by serve.sh before it runs) rather than fetched by them: the export
then reproduces offline, with the very bytes that ran, whatever happens to the package index,
and the sha256 lets anyone check it against their own checkout of that release.

Refused, in one line: a case whose failure the harness planted (a self-test fault: no vLLM
plugin can carry it, so vLLM alone would not fail), and a run of an attached deployment (the
harness never launched it, so it has no commands to export: rerun the case with
`epd-harness repro`, or judge it again with `--attach`, and export a run the harness started).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import mimetypes
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.devices import describe_devices
from harness.errors import BadInput
from harness.judge.compare import is_measured_floor
from harness.judge.policy import ReferencePolicy, default_reference_policy
from harness.judge.records import Verdict
from harness.redact import REDACTED
from harness.run.repro import Bundle, BundleError, ReproCase, case_of, killed_by_the_load
from harness.run.scenarios import MATRIX
from harness.serve.session import safe_name
from harness.serve.vllm_proxy import EPD_PROXY_FILE, TOY_PROXY_FILE, vllm_proxy_launch
from harness.spec.generations import generation_for
from harness.spec.placement import place_instances, side_channel_port_count
from harness.spec.platforms import (
    EC_SIDE_CHANNEL_HOST_ENV,
    PLATFORMS,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
    get_platform,
)
from harness.spec.prompts import DEFAULT_TOP_LOGPROBS, streaming_request
from harness.spec.settings import ATTACH_PROXY
from harness.spec.topology import TOPOLOGIES, Role, get_topology

BASELINE = TOPOLOGIES["baseline"]

# A model directory at most this large is copied into the export (the tiny model is ~3 MB).
MAX_COPIED_MODEL_BYTES = 64 * 1024 * 1024
LICENCE_MARKER = "SPDX-License-Identifier"
UNKNOWN_UUID_PROBE = "unknown-uuid"
PROBES = (UNKNOWN_UUID_PROBE,)
# The uuid of the unknown-uuid probe: the export's storage starts empty, so nothing has it.
NEVER_ENCODED_UUID = "epd-export-never-encoded-0000000000000000"
PROXY_NAME = "proxy"
FIRST_PORT = 18100  # the proxy's; instances follow in topology order
FIRST_SIDE_CHANNEL_PORT = 18200
BASELINE_PORT = 18199
# The case's exact reference (1P+1D for 1E+1P+1D), as `serve.sh reference` starts it: its
# proxy's port, then its instances'; its names and port variables carry REFERENCE_PREFIX, so
# nothing of it is mistaken for the case's (`REF_DECODE0_PORT`, work/logs/ref-decode0.log).
REFERENCE_FIRST_PORT = 18150
REFERENCE_FIRST_SIDE_CHANNEL_PORT = 18250
REFERENCE_PREFIX = "ref-"
HF_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[0-9a-f]+)")
TRANSFER_CONFIG_FLAGS = ("--ec-transfer-config", "--kv-transfer-config")
REQUEST_TIMEOUT_S = 600
# The variables that pin an instance to its device (CUDA_VISIBLE_DEVICES, ZE_AFFINITY_MASK).
DEVICE_ENV_VARS = tuple(
    dict.fromkeys(p.device_env_var for p in PLATFORMS.values() if p.device_env_var)
)
# serve.sh's list of the devices to run on, by position (`DEVICES=4,5,6`).
DEVICES_VAR = "DEVICES"
# Network settings of the recording hosts' interfaces (UCX_NET_DEVICES=mlx5_0:1, an IB HCA, a
# socket interface): not carried into a one-host export, where they may name nothing. With
# what a Ray run gave every instance (`--ray-instance-env`, run.json's launcher.instance_env).
CLUSTER_ENV_PREFIXES = ("UCX_", "NCCL_SOCKET_", "NCCL_IB_", "GLOO_SOCKET_", "TP_SOCKET_")


@dataclass(frozen=True)
class Var:
    """A shell variable in a rendered command line, e.g. `$DECODE0_PORT`."""

    name: str


# One argument: literal text and variables, concatenated.
Arg = tuple[str | Var, ...]


def device_var(position: int) -> Var:
    """The device at `position` of serve.sh's `DEVICES` list (`$DEVICE_0`, ...)."""
    return Var(f"DEVICE_{position}")


@dataclass(frozen=True)
class RecordedDevice:
    """One device an instance of the run was pinned to, as its device variable named it."""

    device: str  # "4": the recording host's index (or whatever the variable held)
    env_var: str  # CUDA_VISIBLE_DEVICES, ZE_AFFINITY_MASK
    # The node it was on (`--launcher ray`: "10.0.0.12 (h1)"); None: the run's one host.
    node: str | None = None

    def describe(self) -> str:
        kind = "GPU" if self.env_var == "CUDA_VISIBLE_DEVICES" else "device"
        return f"{kind} {self.device}" + (f" of node {self.node}" if self.node else "")


@dataclass(frozen=True)
class ExportedServer:
    """One process serve.sh starts: a vLLM instance, or vLLM's proxy."""

    name: str  # "decode0", "proxy": names the log, the state files and the port variable
    role: str  # the instance's role ("encoder", "pd", "prefill", "decode", "baseline"), "proxy"
    port: Var
    default_port: int
    argv: tuple[Arg, ...]
    env: tuple[tuple[str, Arg], ...] = ()
    health_path: str = "/health"
    side_channel: Var | None = None  # NIXL's side-channel port variable
    default_side_channel: int | None = None
    # Positions in serve.sh's DEVICES list this instance runs on (its device variable's value);
    # () on CPU, and for vLLM's proxy.
    devices: tuple[int, ...] = ()

    @property
    def url(self) -> Arg:
        return ("http://", Var("HOST"), ":", self.port)


@dataclass(frozen=True)
class UpstreamProxy:
    """vLLM's proxy files for the served release, as the harness has them (directory + origin)."""

    directory: Path
    origin: str


@dataclass(frozen=True)
class ProxyFile:
    relative: str  # its path in a vLLM source tree, kept under vllm-proxy/ in the export
    source: Path
    sha256: str
    origin: str


@dataclass(frozen=True)
class ModelSource:
    """The tiny model's files are copied; a hub model is named with its revision."""

    directory: Path | None  # copied into model/ when set
    hub_name: str | None = None
    hub_revision: str | None = None
    size_bytes: int = 0
    digest: str | None = None


@dataclass(frozen=True)
class ReferenceServing:
    """The case's reference as `serve.sh reference` starts it on the developer's machine, so
    `run.sh reference` judges the case against the reference's answer there and not only
    against the ids recorded on another host: the monolithic baseline (one server), or an
    exact reference such as 1P+1D (its instances with their KV connector, behind the proxy
    vLLM ships for it)."""

    name: str  # "baseline", "1P+1D"
    servers: tuple[ExportedServer, ...]
    proxy: ExportedServer | None = None
    proxy_file: ProxyFile | None = None
    # Its devices by position in serve.sh's DEVICES (it runs alone, after the case's stop).
    devices: tuple[RecordedDevice, ...] = ()
    # Where its commands come from: the run's record of them, or the harness's renderer.
    source: str = "recorded"

    @property
    def entry(self) -> ExportedServer:
        return self.proxy or self.servers[0]


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
    # The recorded devices of the case's instances, by position in serve.sh's DEVICES (the
    # distinct devices in first-use order).
    devices: tuple[RecordedDevice, ...] = ()
    # The nodes a `--launcher ray` run spread the case's instances over (one host here), and
    # the cluster's network settings the export leaves out (`CLUSTER_ENV_PREFIXES`).
    nodes: tuple[str, ...] = ()
    dropped_env: tuple[tuple[str, str], ...] = ()

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
    sending = bundle.how_sent(label)
    if sending.streamed:  # sent as the run sent it: requests.json holds it before streaming
        body = streaming_request(body)
    sent_unlike = sending.unlike
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
        reference = reference_serving(bundle, case, files)
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
        devices=devices,
        nodes=tuple(dict.fromkeys(d.node for d in devices if d.node)),
        dropped_env=dropped_env(bundle, label),
    )


def refuse_unexportable(bundle: Bundle) -> None:
    if bundle.proxy_kind == ATTACH_PROXY:
        raise BadInput(
            f"{bundle.path} judged an attached deployment: the harness never launched it, so "
            "there are no commands to export; rerun the case with 'epd-harness repro' (or "
            "'run --proxy vllm') and export that run"
        )
    killed = killed_by_the_load(bundle)
    if killed:
        raise BadInput(killed)
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


def topology_dir(bundle: Bundle, label: str) -> Path:
    """Where the session that served `label` left its commands: `<topology>/`, which a matrix
    scenario (`1E+1PD:ec-video-mp4`) shares with the sweep since the pool starts a topology
    once; bundles written before the pool kept a matrix's own `matrix-<topology>/`."""
    topology, _, scenario = label.partition(":")
    shared = bundle.path / safe_name(topology)
    if scenario and not any(shared.glob("*.cmd.json")):
        return bundle.path / safe_name(f"matrix-{topology}")
    return shared


def recorded_commands(bundle: Bundle, label: str) -> list[tuple[str, dict[str, Any]]]:
    """The `.cmd.json` of every instance that served `label` (vLLM's proxy left out), as
    (short name, command)."""
    commands = []
    for path in sorted(topology_dir(bundle, label).glob("*.cmd.json")):
        command = json.loads(path.read_text(encoding="utf-8"))
        short = command.get("name", "").rsplit("/", 1)[-1]
        if short and not short.startswith("vllm-proxy"):
            commands.append((short, command))
    return commands


def rendered_commands(bundle: Bundle, topology_name: str) -> list[tuple[str, dict[str, Any]]]:
    """The commands the harness's one renderer gives `topology_name` for the run's flags,
    platform and release: what the run would have started, for a topology it recorded no
    commands of (a baseline from the cache). Ports, storage and side channels become
    variables later, as for recorded ones."""
    topology = get_topology(topology_name)
    serving = bundle.serving()
    version = str((bundle.run.get("served_vllm") or {}).get("version", "unknown"))
    roles = len(topology.roles)
    specs = place_instances(
        topology,
        serving,
        get_platform(bundle.run.get("platform_profile", "cpu")),
        [BASELINE_PORT + 1 + i for i in range(roles)],
        bundle.path / "unused-storage",
        tuple(bundle.run.get("devices") or (0,)),
        side_channel_ports=[
            FIRST_SIDE_CHANNEL_PORT + 50 + i
            for i in range(side_channel_port_count(topology, serving))
        ],
        generation=generation_for(version).generation,
    )
    return [
        (spec.name.rsplit("/", 1)[-1], {"argv": spec.argv(), "env": spec.env()}) for spec in specs
    ]


def instance_servers(
    bundle: Bundle,
    label: str,
    roles: tuple[Role, ...],
    commands: list[tuple[str, dict[str, Any]]] | None = None,
    prefix: str = "",
    first_port: int = FIRST_PORT + 1,
    first_side_channel: int = FIRST_SIDE_CHANNEL_PORT + 1,
) -> tuple[tuple[ExportedServer, ...], tuple[RecordedDevice, ...]]:
    """Every instance of the case's topology, from its recorded `.cmd.json` (or `commands`),
    in role order, with the devices they ran on (`device_positions`). `prefix` names them
    apart from the case's (the reference's `ref-decode0`), from `first_port` on."""
    if commands is None:
        commands = recorded_commands(bundle, label)
    commands = list(commands)
    order = {role.value: index for index, role in enumerate(dict.fromkeys(roles))}
    commands.sort(key=lambda item: (order.get(role_of(item[0]), len(order)), item[0]))
    if len(commands) != len(roles):
        raise BadInput(
            f"{bundle.path}: expected {len(roles)} instance commands of {label} in "
            f"{topology_dir(bundle, label)}, found {len(commands)}"
        )
    model = bundle.serving().model
    cluster = cluster_env_keys(bundle)
    for _, command in commands:
        command["env"] = without_cluster_env(command["env"], cluster)
    positions, devices = device_positions([command for _, command in commands])
    servers = []
    for index, (short, command) in enumerate(commands):
        name = prefix + short
        variable = shell_variable(name)
        side = Var(f"{variable}_NIXL_PORT") if SIDE_CHANNEL_PORT_ENV in command["env"] else None
        servers.append(
            ExportedServer(
                name=name,
                role=role_of(short),
                port=Var(f"{variable}_PORT"),
                default_port=first_port + index,
                argv=template_argv(command["argv"], model, Var(f"{variable}_PORT")),
                env=template_env(command["env"], side, positions[index]),
                side_channel=side,
                default_side_channel=first_side_channel + index if side else None,
                devices=positions[index],
            )
        )
    return tuple(servers), devices


def reference_serving(bundle: Bundle, case: ReproCase, upstream: UpstreamProxy) -> ReferenceServing:
    """The case's reference as serve.sh starts it: the monolithic baseline, or the exact
    reference's instances (as the run recorded them, else as the harness renders them) behind
    vLLM's proxy for that topology."""
    if case.reference == BASELINE.name:
        server, devices = baseline_server(bundle)
        return ReferenceServing(BASELINE.name, (server,), devices=devices)
    topology = get_topology(case.reference)
    commands = recorded_commands(bundle, topology.name)
    source = "recorded"
    if not commands:
        commands, source = rendered_commands(bundle, topology.name), "rendered"
    servers, devices = instance_servers(
        bundle,
        topology.name,
        topology.roles,
        commands,
        prefix=REFERENCE_PREFIX,
        first_port=REFERENCE_FIRST_PORT + 1,
        first_side_channel=REFERENCE_FIRST_SIDE_CHANNEL_PORT + 1,
    )
    proxy, proxy_file = proxy_server(
        servers, upstream, REFERENCE_PREFIX + PROXY_NAME, REFERENCE_FIRST_PORT
    )
    return ReferenceServing(topology.name, servers, proxy, proxy_file, devices, source)


def device_positions(
    commands: list[dict[str, Any]],
) -> tuple[list[tuple[int, ...]], tuple[RecordedDevice, ...]]:
    """Each command's devices as positions 0..n-1 (the distinct recorded devices in first-use
    order), and the recorded device at each position. A run placed on GPUs 4,5,6 of its host
    is exported as positions 0,1,2, which serve.sh maps onto `DEVICES` (default 0,1,2): the
    recording host's indices name nothing on another host. Instances that shared a device
    share a position, so the recorded memory shares still add up per device."""
    order: dict[RecordedDevice, int] = {}
    positions: list[tuple[int, ...]] = []
    for command in commands:
        env = command.get("env") or {}
        env_var = next((name for name in DEVICE_ENV_VARS if env.get(name)), None)
        own: list[int] = []
        if env_var is not None:
            for device in str(env[env_var]).split(","):
                key = RecordedDevice(device.strip(), env_var, node_of(command))
                own.append(order.setdefault(key, len(order)))
        positions.append(tuple(own))
    return positions, tuple(order)


def node_of(command: dict[str, Any]) -> str | None:
    """The node a `--launcher ray` instance ran on, as its command records it ("address
    (hostname)"); None for the run's own host. Each node numbers its GPUs from 0, so a device
    is a (node, index) pair: E, P and D on three nodes' GPU 0 are three devices."""
    node = command.get("node")
    if not isinstance(node, dict):
        return None
    address = node.get("address") or node.get("node_id") or "?"
    return f"{address} ({node['hostname']})" if node.get("hostname") else str(address)


def cluster_env_keys(bundle: Bundle) -> set[str]:
    """What a Ray run gave every instance for its cluster (`--ray-instance-env`)."""
    return set((bundle.run.get("launcher") or {}).get("instance_env") or {})


def is_cluster_env(key: str, cluster: set[str]) -> bool:
    return key in cluster or key.startswith(CLUSTER_ENV_PREFIXES)


def shell_variable(name: str) -> str:
    """The stem of a server's serve.sh variables (`ref-decode0` -> REF_DECODE0: its _PORT,
    _NIXL_PORT): one rule, so an instance's and a proxy's names can never collide apart."""
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def without_cluster_env(env: dict[str, Any], cluster: set[str]) -> dict[str, Any]:
    """`env` less the cluster's network settings (`is_cluster_env`)."""
    return {k: v for k, v in env.items() if not is_cluster_env(k, cluster)}


def dropped_env(bundle: Bundle, label: str) -> tuple[tuple[str, str], ...]:
    """The cluster network settings the case's recorded environments held, left out."""
    cluster = cluster_env_keys(bundle)
    dropped: dict[str, str] = {}
    for path in sorted(topology_dir(bundle, label).glob("*.cmd.json")):
        env = json.loads(path.read_text(encoding="utf-8")).get("env") or {}
        dropped.update({k: str(v) for k, v in env.items() if is_cluster_env(k, cluster)})
    return tuple(sorted(dropped.items()))


def compacted(
    servers: tuple[ExportedServer, ...], devices: tuple[RecordedDevice, ...]
) -> tuple[tuple[ExportedServer, ...], tuple[RecordedDevice, ...]]:
    """`servers` (a subset of an export's) with their device positions renumbered 0..n-1 over
    the devices they use alone: the probe starts only its consumer."""
    used = list(dict.fromkeys(p for server in servers for p in server.devices))
    renumber = {old: new for new, old in enumerate(used)}
    kept = []
    for server in servers:
        mapped = {device_var(p): device_var(renumber[p]) for p in server.devices}
        env = tuple((key, tuple(mapped.get(x, x) for x in value)) for key, value in server.env)
        positions = tuple(renumber[p] for p in server.devices)
        kept.append(replace(server, env=env, devices=positions))
    return tuple(kept), tuple(devices[p] for p in used)


def baseline_server(bundle: Bundle) -> tuple[ExportedServer, tuple[RecordedDevice, ...]]:
    """The monolithic reference: its recorded command, or when the run took its answers from
    the baseline cache (no baseline started), the command the harness's renderer gives it
    for the run's flags, platform and release."""
    recorded = sorted((bundle.path / safe_name(BASELINE.name)).glob("*.cmd.json"))
    if recorded:
        command = json.loads(recorded[0].read_text(encoding="utf-8"))
    else:
        [(_, command)] = rendered_commands(bundle, BASELINE.name)
    cluster = cluster_env_keys(bundle)
    command["env"] = without_cluster_env(command["env"], cluster)
    port = Var("BASELINE0_PORT")
    [positions], devices = device_positions([command])
    server = ExportedServer(
        name="baseline0",
        role=Role.BASELINE.value,
        port=port,
        default_port=BASELINE_PORT,
        argv=template_argv(command["argv"], bundle.serving().model, port),
        env=template_env(command["env"], None, positions),
        devices=positions,
    )
    return server, devices


def role_of(short_name: str) -> str:
    """ "decode0" -> "decode" (placement names instances role + index)."""
    return short_name.rstrip("0123456789")


def template_argv(argv: list[str], model: str, port: Var) -> tuple[Arg, ...]:
    """The recorded `vllm serve` argv with the executable, host, port, model and connector
    storage as variables; everything else exactly as it ran."""
    if len(argv) < 3 or argv[1] != "serve":
        raise BadInput(f"not a 'vllm serve' command line: {argv[:3]}")
    argv = without_local_media_path(argv)
    rendered: list[Arg] = [(Var("VLLM"),)]
    for previous, arg in zip(argv, argv[1:]):
        if previous == "--port":
            rendered.append((port,))
        elif previous == "--host":
            rendered.append((Var("HOST"),))
        elif arg == model:
            rendered.append((Var("MODEL"),))
        elif previous in TRANSFER_CONFIG_FLAGS:
            rendered.append(template_storage(arg))
        elif arg == REDACTED:
            raise BadInput(f"the recorded command has a redacted argument after {previous}")
        else:
            rendered.append((arg,))
    return tuple(rendered)


LOCAL_MEDIA_FLAG = "--allowed-local-media-path"


def without_local_media_path(argv: list[str]) -> list[str]:
    """The argv less `--allowed-local-media-path DIR`: a directory of the recording machine,
    where vLLM refuses every request with media when DIR is missing. The export's request
    carries its media inline (`inline_local_media`), so no server needs it."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == LOCAL_MEDIA_FLAG:
            skip = True
        elif not arg.startswith(LOCAL_MEDIA_FLAG + "="):
            kept.append(arg)
    return kept


def inline_local_media(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with every file:// media URL (a run with `--media-dir`) replaced by a data: URL
    of the same bytes, so the export needs no file of the recording machine. vLLM reads both
    into the same bytes; BadInput when a file is gone since the run."""
    body = copy.deepcopy(body)
    for message in body.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            for key in ("image_url", "video_url"):
                media = part.get(key)
                url = media.get("url", "") if isinstance(media, dict) else ""
                if url.startswith("file://"):
                    media["url"] = data_url(Path(url[len("file://") :]))
    return body


def data_url(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadInput(
            f"the case's request reads {path} (file:// media), which cannot be read now: {exc}"
        ) from exc
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def template_storage(config_json: str) -> Arg:
    """A transfer config with its shared storage path under `$WORK/storage/<ec|kv>`."""
    config = json.loads(config_json)
    marker = "@@EPD_EXPORT_WORK@@"
    for key, value in config.items():
        if key.endswith("_extra_config") and isinstance(value, dict):
            path = value.get("shared_storage_path")
            if path:
                value["shared_storage_path"] = f"{marker}/storage/{Path(path).name}"
    head, *rest = json.dumps(config, sort_keys=True).split(marker)
    arg: list[str | Var] = [head]
    for piece in rest:
        arg += [Var("WORK"), piece]
    return tuple(a for a in arg if a != "")


def template_env(
    env: dict[str, str], side_channel: Var | None, devices: tuple[int, ...] = ()
) -> tuple[tuple[str, Arg], ...]:
    """The recorded environment with the side-channel port, the host and the device (its
    positions in serve.sh's DEVICES, `device_positions`) as variables."""
    rendered: list[tuple[str, Arg]] = []
    for key, value in sorted(env.items()):
        if key in DEVICE_ENV_VARS and devices:
            arg: list[str | Var] = []
            for position in devices:
                arg += [",", device_var(position)]
            rendered.append((key, tuple(arg[1:])))
        elif key == SIDE_CHANNEL_PORT_ENV and side_channel is not None:
            rendered.append((key, (side_channel,)))
        elif key in (SIDE_CHANNEL_HOST_ENV, EC_SIDE_CHANNEL_HOST_ENV):
            rendered.append((key, (Var("HOST"),)))
        elif value == REDACTED:
            rendered.append((key, (Var(key),)))  # a secret: the user's own environment
        else:
            rendered.append((key, (value,)))
    return tuple(rendered)


def proxy_server(
    servers: tuple[ExportedServer, ...],
    upstream: UpstreamProxy,
    name: str = PROXY_NAME,
    default_port: int = FIRST_PORT,
) -> tuple[ExportedServer, ProxyFile]:
    """vLLM's proxy for these instances, rendered by the harness's one renderer of its
    command (`vllm_proxy_launch`) with static URLs straight to the instances (no taps);
    `name` gives it its port variable (`proxy`: PROXY_PORT, `ref-proxy`: REF_PROXY_PORT)."""
    marker = {"python": "\x00PYTHON\x00", "dir": "\x00PROXY_DIR\x00", "host": "\x00HOST\x00"}

    def url(server: ExportedServer) -> str:
        return f"http://{marker['host']}:\x00{server.port.name}\x00"

    by_role: dict[str, list[str]] = {}
    for server in servers:
        by_role.setdefault(server.role, []).append(url(server))
    decode = by_role.get(Role.DECODE.value) or by_role.get(Role.PREFILL_DECODE.value) or []
    launch = vllm_proxy_launch(
        (marker["python"],),
        Path(marker["dir"]),
        marker["host"],
        FIRST_PORT,
        by_role.get(Role.ENCODER.value, []),
        by_role.get(Role.PREFILL.value, []),
        decode,
    )
    variables = {
        marker["python"]: Var("PYTHON"),
        marker["dir"]: Var("PROXY_DIR"),
        marker["host"]: Var("HOST"),
        **{f"\x00{s.port.name}\x00": s.port for s in servers},
    }
    port = Var(shell_variable(name) + "_PORT")
    argv: list[Arg] = []
    for previous, arg in zip(("",) + launch.argv, launch.argv):
        argv.append((port,) if previous == "--port" else split_markers(arg, variables))
    relative = EPD_PROXY_FILE if any(EPD_PROXY_FILE in a for a in launch.argv) else TOY_PROXY_FILE
    source = upstream.directory / relative
    if not source.is_file():
        raise BadInput(f"vLLM's proxy file {source} is missing ({upstream.origin})")
    head = source.read_text(encoding="utf-8", errors="replace")[:2000]
    if LICENCE_MARKER not in head:
        raise BadInput(f"{source} has no licence header ({LICENCE_MARKER}): not shipping it")
    proxy_file = ProxyFile(relative, source, sha256_of(source), upstream.origin)
    server = ExportedServer(
        name=name,
        role=PROXY_NAME,
        port=port,
        default_port=default_port,
        argv=tuple(argv),
        env=tuple((k, (v,)) for k, v in sorted(launch.env.items())),
        health_path=launch.health_path,
    )
    return server, proxy_file


def split_markers(text: str, variables: dict[str, Var]) -> Arg:
    pattern = "(" + "|".join(re.escape(m) for m in variables) + ")"
    return tuple(variables.get(piece, piece) for piece in re.split(pattern, text) if piece != "")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokens_expectation(
    bundle: Bundle, case: ReproCase, record: dict[str, Any], body: dict[str, Any]
) -> dict[str, Any]:
    """expected.json of a case: its reference's ids and log-probs, how the harness judged it
    (the case's policy, the run's noise floor), and what the harness recorded, where."""
    policy = reference_policy(bundle)
    topology = get_topology(case.topology)
    drift_passes = policy.policy_for(topology, case.reference == BASELINE.name).passes(
        Verdict.DRIFT
    )
    return {
        **expected_answer(bundle, case),
        "check": "tokens",
        "what": f"{case.topology} / {case.prompt}: {describe_request(body)}; expecting "
        f"{reference_words(case.reference)}'s token ids",
        "timeout_s": REQUEST_TIMEOUT_S,
        "policy": policy.name,
        "drift_passes": drift_passes,
        "noise_floor_nats": noise_floor(bundle, record),
        "recorded": {
            "verdict": case.verdict,
            "source": f"the harness (run {bundle.path.name})",
            "where": recording_host(bundle.run),
            "ids_vary_with": ids_vary_with(bundle.run),
        },
    }


def reference_policy(bundle: Bundle) -> ReferencePolicy:
    """The run's reference policy (summary.json), else its platform's default."""
    name = bundle.summary.get("reference_policy")
    try:
        return ReferencePolicy(str(name))
    except ValueError:
        return default_reference_policy(get_platform(bundle.run.get("platform_profile", "cpu")))


def noise_floor(bundle: Bundle, record: dict[str, Any]) -> float:
    """The tolerance the harness judged the case with (its divergence's), else the run's
    measured noise floor (summary.json, run.json); 0 when none was recorded. A recorded one
    that is no measurement (inf, NaN, negative, not a number) is BadInput naming the file and
    the field: it would be check.py's drift tolerance (an inf one passes every near tie)."""
    sources = (
        ("summary.json", record.get("divergence") or {}),
        ("summary.json", bundle.summary),
        ("run.json", bundle.run),
    )
    for file, source in sources:
        field = "tolerance" if "tolerance" in source else "noise_floor_nats"
        value = source.get(field)
        if value is None:
            continue
        if not is_measured_floor(value):
            raise BadInput(
                f"{bundle.path / file}: {field} is {value!r}, not a measured noise floor "
                "(a finite number of nats, 0 or more)"
            )
        return float(value)
    return 0.0


def recording_host(run: dict[str, Any]) -> str:
    """Where the expected ids were computed, as far as run.json knows: its host and the
    devices the run used (`devices_used`: model, count, driver, CUDA or AMX); for a bundle
    written before that was recorded, its devices (GPU platforms) or its CPU."""
    hostname = run.get("hostname")
    host = f"the recording host {hostname}" if hostname else "the recording host"
    used = describe_devices(run.get("devices_used"))
    if used:
        return f"{host} ({used})"
    profile = run.get("platform_profile", "cpu")
    if profile == "cpu":
        cpu = (run.get("cpu") or {}).get("model") or "model not recorded"
        return f"{host} (CPU {cpu})"
    devices = ",".join(str(d) for d in run.get("devices") or []) or "?"
    return f"{host} ({profile} devices {devices}; GPU model not recorded)"


def ids_vary_with(run: dict[str, Any]) -> str:
    """What else, beside a bug, can give other ids than the recording host's, for the platform
    the case was recorded on: a CPU export said "another GPU model, driver or CUDA", which a
    developer on another CPU could not act on (found by a real-vLLM audit on CPU)."""
    platform = run.get("platform_profile", "cpu")
    if platform == "cpu":
        return (
            "another CPU model (its vector instructions, AMX), torch or vLLM build, or thread count"
        )
    if platform == "xpu":
        return "another GPU model, driver or oneAPI version"
    return "another GPU model, driver or CUDA version"


def asks_for_logprobs(body: dict[str, Any]) -> bool:
    """Whether a chat request asks for the top-k log-probs (at least 2: the drift rule needs
    the other token's)."""
    top = body.get("top_logprobs")
    return bool(body.get("logprobs")) and isinstance(top, int) and top >= 2


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


def reference_words(reference: str) -> str:
    """'the monolithic baseline', or the exact reference's name ('1P+1D')."""
    return "the monolithic baseline" if reference == BASELINE.name else reference


def expected_answer(bundle: Bundle, case: ReproCase) -> dict[str, Any]:
    """The answer of the case's own reference (the monolithic baseline, or an exact reference
    such as 1P+1D) to the case's request, as the bundle recorded it: the ids the harness
    compared with, never another reference's."""
    responses_path = bundle.path / "responses.json"
    try:
        responses = json.loads(responses_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(f"{responses_path} cannot be read: {exc}") from None
    reference = case.reference
    result = ((responses.get(reference) or {}).get(case.prompt) or {}).get("result")
    if not result:
        raise BadInput(
            f"{bundle.path}: responses.json has no answer of {reference} to {case.prompt!r}"
        )
    logprobs = result.get("logprobs") or []
    return {
        "reference": reference,
        "prompt_token_ids": result["prompt_token_ids"],
        "token_ids": result["token_ids"],
        "text": result.get("text", ""),
        "top_logprobs": [p.get("top") for p in logprobs],
        "token_logprobs": [p.get("logprob") for p in logprobs],
    }


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


def model_source(bundle: Bundle) -> ModelSource:
    """Copy a small local model; name a hub snapshot with its revision; refuse anything else."""
    model = bundle.serving().model
    digest = (bundle.run.get("model") or {}).get("digest")
    path = Path(model)
    snapshot = HF_SNAPSHOT.search(model)
    if path.is_dir():
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if size <= MAX_COPIED_MODEL_BYTES:
            return ModelSource(path, size_bytes=size, digest=digest)
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


def describe_request(body: dict[str, Any]) -> str:
    """'one image + 4 words of text': what a reader of the issue needs to picture it."""
    kinds: dict[str, int] = {}
    words = 0
    for message in body.get("messages", []):
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        for part in parts:
            kind = part.get("type", "?")
            if kind == "text":
                words += len(str(part.get("text", "")).split())
            else:
                kinds[kind] = kinds.get(kind, 0) + 1
    names = {"image_url": "image", "video_url": "video", "image_embeds": "image_embeds part"}
    media = [
        f"{count} {names.get(kind, kind)}{'s' if count > 1 else ''}"
        for kind, count in kinds.items()
    ]
    return " + ".join([*media, f"{words} words of text"])


def declared_failure(
    bundle: Bundle, label: str, case: ReproCase, record: dict[str, Any]
) -> str | None:
    """How the harness declares this failure: a matrix scenario's expectation, or the
    release's declared failure (`docs/versions.md`); None when it is not declared."""
    if case.verdict == Verdict.MATCH.value:
        return None
    scenario_name = label.partition(":")[2]
    scenarios = {s.name: s for s in MATRIX}
    if scenario_name in scenarios:
        connector = bundle.serving().kv_connector
        scenario = scenarios[scenario_name].for_kv_connector(connector)
        if case.verdict in {v.value for v in scenario.expect} and scenario.reason:
            return f"matrix scenario {scenario.name} expects {case.verdict}: {scenario.reason}"
    detail = str(record.get("detail", ""))
    if "declared for this release:" in detail:
        return "declared for this release: " + detail.split("declared for this release:", 1)[1]
    return None


def export_name(bundle: Bundle, case: ReproCase, probe: str | None) -> str:
    """`vllm-0.32.0-1E-1P-1D-m-image-short-text-error`: release, case and what it showed."""
    version = str((bundle.run.get("served_vllm") or {}).get("version", "unknown"))
    release = version.split("+", 1)[0]
    outcome = probe or case.verdict.lower().replace("_", "-")
    return safe_name(f"vllm-{release}-{case.topology}-{case.prompt}-{outcome}")


# -- shell rendering ---------------------------------------------------------------------------


def shell_word(arg: Arg) -> str:
    """One argument as a shell word: `"http://${HOST}:${PORT}"` when its literal text needs
    no escaping inside double quotes, else literal pieces single-quoted and variables
    double-quoted (a JSON config: `'{"path": "'"${WORK}"'/storage/kv"}'`)."""
    if all(isinstance(piece, str) for piece in arg):
        return shlex.quote("".join(str(piece) for piece in arg))
    literal = "".join(piece for piece in arg if isinstance(piece, str))
    if not re.search(r'["$`\\!]', literal):
        inner = "".join(f"${{{p.name}}}" if isinstance(p, Var) else p for p in arg)
        return f'"{inner}"'
    return "".join(
        f'"${{{piece.name}}}"' if isinstance(piece, Var) else shlex.quote(piece) for piece in arg
    )


def shell_command(server: ExportedServer) -> str:
    """`env K=V ... argv...` over continuation lines, one option per line."""
    words = [f"{key}={shell_word(value)}" for key, value in server.env]
    argv = [shell_word(arg) for arg in server.argv]
    head = next((i for i, word in enumerate(argv) if word.startswith("--")), len(argv))
    lines = [" ".join((["env", *words] if words else []) + argv[:head])]
    rest = argv[head:]
    while rest:
        pair = rest[0].startswith("--") and len(rest) > 1 and not rest[1].startswith("--")
        take = 2 if pair else 1
        lines.append(" ".join(rest[:take]))
        rest = rest[take:]
    return " \\\n    ".join(lines)
