"""The case's reference in the export (`ReferenceServing`): the monolithic baseline, or an exact
reference such as 1P+1D behind vLLM's proxy for it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness.run.export.devices import RecordedDevice, device_positions
from harness.run.export.proxy import PROXY_NAME, ProxyFile, UpstreamProxy, proxy_server
from harness.run.export.servers import (
    FIRST_SIDE_CHANNEL_PORT,
    ExportedServer,
    cluster_env_keys,
    instance_servers,
    launched_env,
    recorded_commands,
    template_argv,
    template_env,
    without_cluster_env,
)
from harness.run.export.shell import Var
from harness.run.repro import Bundle, ReproCase
from harness.serve.session import safe_name
from harness.spec.generations import NEWEST, ProtocolGeneration, generation_for
from harness.spec.placement import place_instances, side_channel_port_count
from harness.spec.platforms import get_platform
from harness.spec.topology import BASELINE, Role, get_topology

BASELINE_PORT = 18199

# The case's exact reference (1P+1D for 1E+1P+1D), as `serve.sh reference` starts it: its
# proxy's port, then its instances'; its names and port variables carry REFERENCE_PREFIX, so
# nothing of it is mistaken for the case's (`REF_DECODE0_PORT`, work/logs/ref-decode0.log).
REFERENCE_FIRST_PORT = 18150
REFERENCE_FIRST_SIDE_CHANNEL_PORT = 18250
REFERENCE_PREFIX = "ref-"


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


def reference_serving(
    bundle: Bundle,
    case: ReproCase,
    upstream: UpstreamProxy,
    inherited: Mapping[str, str] | None = None,
) -> ReferenceServing:
    """The case's reference as serve.sh starts it: the monolithic baseline, or the exact
    reference's instances (as the run recorded them, else as the harness renders them, with
    `inherited`: what the case's instances inherited) behind vLLM's proxy for that topology."""
    if case.reference == BASELINE.name:
        server, devices = baseline_server(bundle, inherited)
        return ReferenceServing(BASELINE.name, (server,), devices=devices)
    topology = get_topology(case.reference)
    commands = recorded_commands(bundle, topology.name)
    source = "recorded"
    if not commands:
        commands, source = rendered_commands(bundle, topology.name, inherited), "rendered"
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


def baseline_server(
    bundle: Bundle, inherited: Mapping[str, str] | None = None
) -> tuple[ExportedServer, tuple[RecordedDevice, ...]]:
    """The monolithic reference: its recorded command, or when the run took its answers from
    the baseline cache (no baseline started), the command the harness's renderer gives it
    for the run's flags, platform and release, with `inherited` (`rendered_commands`)."""
    recorded = sorted((bundle.path / safe_name(BASELINE.name)).glob("*.cmd.json"))
    if recorded:
        command = json.loads(recorded[0].read_text(encoding="utf-8"))
    else:
        [(_, command)] = rendered_commands(bundle, BASELINE.name, inherited)
    cluster = cluster_env_keys(bundle)
    command["env"] = without_cluster_env(launched_env(command), cluster)
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


def rendered_commands(
    bundle: Bundle, topology_name: str, inherited: Mapping[str, str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The commands the harness's one renderer gives `topology_name` for the run's flags,
    platform and release: what the run would have started, for a topology it recorded no
    commands of (a baseline from the cache). Ports, storage and side channels become
    variables later, as for recorded ones. Each inherits `inherited` (the run's numerics
    variables, as the case's instances recorded them): a cached baseline's key held them, and
    rendered without them it was served with other kernels than the run's (found in review)."""
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
        generation=spoken_generation(bundle, version),
    )
    return [
        (
            spec.name.rsplit("/", 1)[-1],
            {"argv": spec.argv(), "env": spec.env(), "inherited_env": dict(inherited or {})},
        )
        for spec in specs
    ]


def spoken_generation(bundle: Bundle, version: str) -> ProtocolGeneration:
    """The protocol generation the run's instances were rendered for: the one run.json records
    (`--protocol` may have chosen another than the release's), else the release's; the newest
    for a version that could not be read, as the run spoke (`served_generation`)."""
    if bundle.protocol is not None:
        return bundle.protocol
    return NEWEST if version == "unknown" else generation_for(version).generation
