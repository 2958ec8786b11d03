"""`--launcher ray`: each instance on a node of a Ray cluster, started there by the same launcher.

Per topology the harness asks Ray for a placement group of one bundle per instance, STRICT_SPREAD
by default (every instance on a node of its own; PACK with `--ray-placement pack`), and puts one
actor, an `InstanceAgent`, in each bundle. Which bundle lands on which node is Ray's choice, so
nothing is assumed: each agent reports where it is (`where`: node address, node id, host name,
accelerator ids), and that is what the instance binds, what its side channels announce, what
its URL is, what `run.json` records. On a GPU node the instance's devices are the accelerator
ids Ray gave its agent.

Before any server starts, `check_before_start` refuses, in one line naming the instance and
the variable, a rendered command that breaks a network invariant (`harness.spec.network`), a
node that lacks the served vLLM executable, bfloat16 on a node's GPU below compute capability
8.0 (vLLM refuses it only once the instance has started, and the preflight reads only this
host's GPUs), and connector storage that is not one directory shared by every node of the
topology and the harness (a file written on each is read on every other). Once every server
answers `/health`, `check_serving` checks from the nodes what the rendered command cannot show:
each instance listens at its node's address (HTTP and NIXL side channel), and every NIXL side
channel can be reached from every peer's node.

The rest of `--launcher ray` has modules of its own: the run's connection to the cluster
(`harness.serve.ray_runtime`), the agent on each node (`harness.serve.ray_agent`), a call to an
agent from the harness (`harness.serve.ray_calls`) and the harness's side of each instance
(`harness.serve.ray_server`).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from harness.devices import bf16_refusal
from harness.environment import NETWORK_CHECKS_ENV, network_checks_enabled
from harness.serve.launcher import LaunchRefused, NodeInfo, Reservation
from harness.serve.ray_agent import AGENT_ENV, KILL_CHILDREN_ENV, RemoteAgent
from harness.serve.ray_calls import get_or_refuse
from harness.serve.ray_runtime import PLACEMENT_TIMEOUT_S, describe_nodes, runtime
from harness.serve.ray_server import RayServer
from harness.serve.server_command import ServerCommand
from harness.spec.instances import InstanceSpec
from harness.spec.network import side_channels, violations
from harness.spec.placement import needs_side_channel
from harness.spec.settings import PACK_PLACEMENT, RunSettings
from harness.spec.topology import Topology

log = logging.getLogger(__name__)

SIDE_CHANNEL_WAIT_S = 20.0  # NIXL's listener starts with the engine; /health may come first
# bfloat16 refused on a node's GPU, in words true of every command that launches on Ray (the
# default wording of what was asked is too): the launcher cannot tell whether --dtype was
# given, nor whether `repro` replays a bundle's.
RAY_BF16_REMEDY = (
    "pass --dtype float16 (repro: run the case again with run --dtype float16), or serve on "
    "Ray nodes whose GPUs have 8.0 or more"
)


def describe_free(bundle: dict[str, float]) -> str:
    """What of each resource a bundle asks for the cluster has free now, of its total: a
    placement refused on a cluster whose nodes look enough shows that something else holds
    them (e.g. the baseline a fuzz keeps up beside its topology)."""
    free, total = ray.available_resources(), ray.cluster_resources()
    return ", ".join(f"{name} {free.get(name, 0):g} of {total.get(name, 0):g}" for name in bundle)


class RayLauncher:
    """Places a topology's instances on the cluster's nodes and runs each through an agent."""

    kind = "ray"

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.choice = settings.launcher
        self._group: Any = None
        self._agents: list[Any] = []
        self._nodes: list[NodeInfo] = []
        self._agent_pids: list[int] = []
        self._storage_tag = uuid.uuid4().hex[:8]

    def storage_root(self, session_dir: Path) -> Path:
        """The shared directory if one was given (fresh per session: connectors key what they
        store by content), else the session's own artifact directory."""
        if self.choice.shared_dir is None:
            return session_dir
        return self.choice.shared_dir / f"epd-{self._storage_tag}" / session_dir.name

    def reserve(
        self,
        topology: Topology,
        devices: tuple[int, ...],
        before_device_wait: Callable[[], None] | None = None,
    ) -> Reservation:
        """The placement group's bundles (Ray places the instances; no device leases here, so
        `before_device_wait` is never called)."""
        refusal = self.choice.refusal_on(self.settings.platform)
        if refusal is not None:  # prepare_run refuses it too; scenarios build settings directly
            raise LaunchRefused(f"{topology.name}: {refusal}")
        runtime().connect(self.choice, self.settings.run_dir)
        roles = topology.roles
        bundle: dict[str, float] = {"CPU": 1}
        if self.settings.platform.exclusive_devices:
            bundle["GPU"] = 1
        spread = self.choice.placement != PACK_PLACEMENT
        self._group = placement_group(
            [dict(bundle) for _ in roles],
            strategy="STRICT_SPREAD" if spread else "PACK",
            name=f"epd-{topology.name}-{uuid.uuid4().hex[:6]}",
        )
        try:
            ray.get(self._group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise LaunchRefused(
                f"{topology.name}: Ray cannot place its {len(roles)} instances "
                f"({', '.join(f'{k} {v:g}' for k, v in bundle.items())} each"
                f"{', every one on a node of its own' if spread else ''}) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; nodes: {describe_nodes()}; "
                f"free now: {describe_free(bundle)}"
            ) from None
        self._agents = [
            RemoteAgent.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=index
                ),
                runtime_env={"env_vars": dict(AGENT_ENV)},
                max_restarts=0,
            ).remote()
            for index in range(len(roles))
        ]
        where = get_or_refuse(
            [agent.where.remote() for agent in self._agents],
            f"starting {topology.name}'s agents (is epd-harness installed on every node?)",
        )
        for w in where:
            if w["kill_children"] != AGENT_ENV[KILL_CHILDREN_ENV]:
                raise LaunchRefused(
                    f"{topology.name}: the agent on node {w['address']} runs with "
                    f"{KILL_CHILDREN_ENV}={w['kill_children']!r}, so Ray would SIGKILL its "
                    "server's leader and watchdog and leave vLLM's engine behind; does the "
                    "cluster allow runtime_env env_vars?"
                )
        self._nodes = [NodeInfo(w["address"], w["node_id"], w["hostname"]) for w in where]
        self._agent_pids = [w["pid"] for w in where]
        sides = [needs_side_channel(role, self.settings.serving) for role in roles]
        ports = get_or_refuse(
            [
                agent.reserve.remote(node.address, side)
                for agent, node, side in zip(self._agents, self._nodes, sides)
            ],
            f"reserving {topology.name}'s ports on its nodes",
        )
        for role, node in zip(roles, self._nodes):
            log.info(
                "[ray] %s %s -> node %s (%s)",
                topology.name,
                role.value,
                node.address,
                node.node_id[:12],
            )
        accelerators = None
        if self.settings.platform.exclusive_devices:
            accelerators = [tuple(int(i) for i in w["accelerators"].get("GPU", [])) for w in where]
        return Reservation(
            hosts=[node.address for node in self._nodes],
            ports=[http for http, _ in ports],
            side_channel_ports=[side for _, side in ports if side is not None],
            nodes=list(self._nodes),
            devices=accelerators,
            inherited=[dict(w.get("inherited") or {}) for w in where],
        )

    def node_inherited(self) -> dict[str, str]:
        """What an instance started on a node of the cluster inherits that can change what it
        computes, before any start (the baseline cache's lookup): the report of one agent
        holding no resources (so that topologies holding every bundle cannot keep it
        waiting), which Ray places on a node of its choice, ended at once. The harness's own
        variables reach no node; a cluster whose nodes differ is answered by whichever node
        this agent landed on."""
        runtime().connect(self.choice, self.settings.run_dir)
        agent = RemoteAgent.options(
            num_cpus=0,
            runtime_env={"env_vars": dict(AGENT_ENV)},
            max_restarts=0,
        ).remote()
        try:
            where = get_or_refuse(
                agent.where.remote(),
                "asking a node of the cluster what an instance inherits there "
                "(is epd-harness installed on every node?)",
            )
        finally:
            ray.kill(agent)
        return dict(where.get("inherited") or {})

    def instance_env(self, spec: InstanceSpec) -> dict[str, str]:
        return {**spec.env(), **dict(self.choice.instance_env)}

    def check_before_start(
        self, topology: Topology, instances: list[InstanceSpec], commands: list[ServerCommand]
    ) -> None:
        """Refuse what cannot work across nodes, in one line naming the instance and cause."""
        multi_node = len({spec.host for spec in instances}) > 1
        problems = [
            str(violation)
            for spec, command in zip(instances, commands)
            for violation in violations(spec, command.argv, command.env, multi_node)
        ]
        if problems and not network_checks_enabled():
            log.warning("[ray] %s=off: starting despite: %s", NETWORK_CHECKS_ENV, problems)
        elif problems:
            raise LaunchRefused("; ".join(problems))
        missing = get_or_refuse(
            [a.check_executable.remote(c.argv[0]) for a, c in zip(self._agents, commands)],
            f"checking {topology.name}'s nodes for the served vLLM",
        )
        for spec, node, problem in zip(instances, self._nodes, missing):
            if problem:
                raise LaunchRefused(f"{spec.name}: {problem} (node {node.address})")
        self._check_dtype(instances)
        self._check_storage(instances)
        self._check_media_dir(instances)

    def server(self, index: int, command: ServerCommand) -> RayServer:
        return RayServer(self._agents[index], command, self._nodes[index], self._agent_pids[index])

    def check_serving(self, instances: list[InstanceSpec]) -> None:
        """From the nodes: each instance listens at its node's address, and every NIXL side
        channel opens from every other node of the topology."""
        if not network_checks_enabled():
            log.warning(
                "[ray] %s=off: the instances' addresses are not checked", NETWORK_CHECKS_ENV
            )
            return
        deadline = time.monotonic() + SIDE_CHANNEL_WAIT_S
        for agent, spec in zip(self._agents, instances):
            wanted = [
                (spec.host, spec.port, "--host/--port"),
                *(
                    (host, port, "VLLM_NIXL_SIDE_CHANNEL_HOST/_PORT")
                    for host, port in side_channels(spec)
                ),
            ]
            while True:
                listening = get_or_refuse(agent.listening.remote(), f"asking {spec.name}'s node")
                missing = [w for w in wanted if (w[0], w[1]) not in listening]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            for host, port, variable in missing:
                shown = ", ".join(f"{h}:{p}" for h, p in listening) or "nothing"
                raise LaunchRefused(
                    f"{spec.name}: nothing listens at {host}:{port} ({variable}) on its node; "
                    f"it listens on {shown}"
                )
        for spec in instances:
            for host, port in side_channels(spec):
                for agent, peer in zip(self._agents, instances):
                    if peer is spec or peer.host == spec.host:
                        continue
                    error = get_or_refuse(
                        agent.can_connect.remote(host, port), f"asking {peer.name}"
                    )
                    if error:
                        raise LaunchRefused(
                            f"{spec.name}'s NIXL side channel {host}:{port} cannot be reached "
                            f"from {peer.name}'s node {peer.host}: {error}"
                        )
        runtime().log_memory()

    def check_revivable(self) -> None:
        """Reviving one instance in place needs its port held across the restart, which an
        agent gives back when its server stops: on Ray the caller starts the topology again
        (`TopologyPool.revive` does)."""
        raise LaunchRefused(
            "reviving an instance in place is the local launcher's; on Ray the topology is "
            "started again"
        )

    def close(self) -> None:
        """End the agents (their servers were stopped by then) and free the placement group."""
        agents, group = self._agents, self._group
        self._agents, self._group = [], None
        if not ray.is_initialized():
            return
        for agent in agents:
            try:
                ray.kill(agent)
            except RayError:
                pass
        if group is not None:
            remove_placement_group(group)

    def _check_dtype(self, instances: Sequence[InstanceSpec]) -> None:
        """On cuda, each instance's GPUs (its accelerator ids) as its node's nvidia-smi lists
        them, judged by `bf16_refusal`; a node whose nvidia-smi cannot say is not judged
        (vLLM still refuses there)."""
        if self.settings.platform.name != "cuda":
            return
        listings = get_or_refuse(
            [agent.compute_capabilities.remote() for agent in self._agents],
            "reading the GPUs' compute capabilities on the nodes",
        )
        for spec, listed in zip(instances, listings):
            used = [gpu for gpu in listed or () if gpu.index in spec.devices]
            refusal = bf16_refusal(self.settings.serving.dtype, used, remedy=RAY_BF16_REMEDY)
            if refusal is not None:
                raise LaunchRefused(f"{spec.name} on node {spec.host}: {refusal}")

    def _check_media_dir(self, instances: Sequence[InstanceSpec]) -> None:
        """`--media-dir`: each instance's vLLM reads the file:// media under it on its own
        node, so every node must see the directory the harness sees (the same names in it);
        otherwise the topology is refused before a start, not ERROR request by request."""
        media = self.settings.serving.allowed_local_media_path
        if not media:
            return
        mine = sorted(os.listdir(media))
        answers = get_or_refuse(
            [agent.directory_listing.remote(media) for agent in self._agents],
            f"listing --media-dir {media} on the nodes",
        )
        for spec, theirs in zip(instances, answers):
            if theirs != mine:
                problem = theirs if isinstance(theirs, str) else "it lists other files there"
                raise LaunchRefused(
                    f"--media-dir {media} is not the same directory on {spec.name}'s node "
                    f"{spec.host} ({problem}): each instance reads file:// media on its own "
                    "node; put the media on a filesystem every node mounts at that path"
                )

    def _check_storage(self, instances: Sequence[InstanceSpec]) -> None:
        """Every directory a connector shares between instances (ExampleConnector's) must be
        the same directory on each of their nodes and for the harness: a file written by each
        is read by all the others. Otherwise the topology is refused, naming the node."""
        users: dict[tuple[str, Path], list[int]] = {}
        for index, spec in enumerate(instances):
            for label, path in spec.shared_storage().items():
                users.setdefault((label, path), []).append(index)
        for (label, path), members in users.items():
            self._probe_storage(label, path, [instances[i] for i in members], members)

    def _probe_storage(
        self, label: str, path: Path, members: list[InstanceSpec], indexes: list[int]
    ) -> None:
        token = uuid.uuid4().hex
        mine = (str(path / f".epd-shared-{token}-harness"), f"{token} harness")
        theirs = [(str(path / f".epd-shared-{token}-{i}"), f"{token} {i}") for i in indexes]
        hint = (
            "its connector needs one directory every node of the topology and the harness "
            "see (--ray-shared-dir DIR on a shared filesystem)"
        )

        def on_each_node(probe: Callable[[tuple[str, str]], tuple], writer: str) -> None:
            """Each member's agent runs `storage_probe(*probe(its own file))`; the first node
            with a problem refuses the topology."""
            answers = get_or_refuse(
                [
                    self._agents[i].storage_probe.remote(*probe(own))
                    for i, own in zip(indexes, theirs)
                ],
                f"probing {label} {path} on the nodes",
            )
            for spec, problem in zip(members, answers):
                if problem:
                    raise LaunchRefused(
                        f"{label} {path} is not shared: {spec.name}'s node {spec.host} does not "
                        f"see what {writer} wrote there ({problem}); {hint}"
                    )

        try:
            Path(mine[0]).write_text(mine[1], encoding="utf-8")
            on_each_node(lambda own: ([mine], own), "the harness")
            on_each_node(lambda own: ([t for t in theirs if t != own], None), "another node")
            for (probe, expected), spec in zip(theirs, members):
                try:
                    same = Path(probe).read_text(encoding="utf-8") == expected
                except OSError:
                    same = False
                if not same:
                    raise LaunchRefused(
                        f"{label} {path} is not shared: the harness does not see what "
                        f"{spec.name}'s node {spec.host} wrote there; {hint}"
                    )
        finally:
            for probe, _ in [mine, *theirs]:
                Path(probe).unlink(missing_ok=True)
