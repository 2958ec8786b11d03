"""What a Ray instance inherits that can change what it computes is its node's environment, not
the harness's: each agent reports its own (`InstanceAgent.where`'s `inherited`), the launcher
puts it in the Reservation per instance (`RayLauncher.reserve`), and the instance's `.cmd.json`
records it (`command_json`'s `inherited_env`), which `export` sets again. Shown with a fake Ray
(no cluster, no process): each "node" is the real agent code run under that node's environment.
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

import pytest

from harness.serve import ray_agent, ray_launcher
from harness.serve.entry import command_json
from harness.serve.ray_agent import AGENT_ENV, InstanceAgent
from harness.serve.server_command import ServerCommand
from harness.spec.platforms import CPU
from harness.spec.settings import LauncherChoice, RunSettings
from harness.spec.topology import TOPOLOGIES, serving_for

pytestmark = pytest.mark.unit

DRIVER_ENV = {"VLLM_ATTENTION_BACKEND": "DRIVER", "OMP_NUM_THREADS": "8", "HOME": "/driver"}
NODE_ENVS = (
    # Ray sets the agent's own variables (`AGENT_ENV`) over the node's.
    {"VLLM_ATTENTION_BACKEND": "TORCH_SDPA", "VLLM_PORT": "1", "HOME": "/a", **AGENT_ENV},
    {"ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1", "HOME": "/b", **AGENT_ENV},
)


class Remote:
    """`agent.method.remote(...)` of a fake Ray: runs `method` at once under `environ`."""

    def __init__(self, method: Any, environ: dict[str, str], monkeypatch) -> None:
        self.method, self.environ, self.monkeypatch = method, environ, monkeypatch

    def remote(self, *args: Any) -> Any:
        with self.monkeypatch.context() as node:
            node.setattr(os, "environ", self.environ)
            return self.method(*args)


class NodeAgent:
    """One agent on a node with environment `environ`: the real `where`, ports made up."""

    def __init__(self, index: int, environ: dict[str, str], monkeypatch) -> None:
        self.where = Remote(InstanceAgent().where, environ, monkeypatch)
        self.reserve = Remote(lambda address, side: (41001 + index, None), environ, monkeypatch)


def fake_ray(monkeypatch) -> None:
    """Ray's calls `reserve` and `where` make, answered in-process, one node per agent."""
    context = types.SimpleNamespace(
        get_node_id=lambda: "n" * 56, get_accelerator_ids=lambda: {"GPU": []}
    )
    monkeypatch.setattr(ray_agent.ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(ray_agent.ray.util, "get_node_ip_address", lambda: "10.0.0.2")
    monkeypatch.setattr(
        ray_launcher, "runtime", lambda: types.SimpleNamespace(connect=lambda *_: None)
    )
    group = types.SimpleNamespace(ready=lambda: None)
    monkeypatch.setattr(ray_launcher, "placement_group", lambda *a, **k: group)
    monkeypatch.setattr(ray_launcher.ray, "get", lambda *a, **k: None)
    monkeypatch.setattr(ray_launcher, "PlacementGroupSchedulingStrategy", lambda *a, **k: None)
    monkeypatch.setattr(ray_launcher, "get_or_refuse", lambda answers, doing: answers)
    agents = iter(NodeAgent(i, env, monkeypatch) for i, env in enumerate(NODE_ENVS))
    options = types.SimpleNamespace(remote=lambda: next(agents))
    remote_agent = types.SimpleNamespace(options=lambda **_: options)
    monkeypatch.setattr(ray_launcher, "RemoteAgent", remote_agent)


def test_a_ray_instance_records_its_nodes_numerics_env_not_the_drivers(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(os, "environ", dict(DRIVER_ENV))
    fake_ray(monkeypatch)
    settings = RunSettings(
        serving_for(CPU, "/m"), tmp_path, platform=CPU, launcher=LauncherChoice("ray")
    )
    reservation = ray_launcher.RayLauncher(settings).reserve(TOPOLOGIES["1P+1D"], (0,))
    assert reservation.inherited == [
        {"VLLM_ATTENTION_BACKEND": "TORCH_SDPA"},
        {"ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"},
    ]
    # The instance's `.cmd.json`: the node's variables, less what the harness set over them.
    command = ServerCommand(
        name="1P+1D/decode0",
        argv=("vllm", "serve", "/m"),
        health_url="http://10.0.0.3:41002/health",
        log_path=tmp_path / "decode0.log",
        env={"OMP_NUM_THREADS": "2"},
    )
    recorded = json.loads(command_json(command, None, (), reservation.inherited[1]))
    assert recorded["inherited_env"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
