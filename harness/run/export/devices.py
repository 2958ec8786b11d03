"""The devices an export's instances ran on, as positions in serve.sh's `DEVICES` list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.run.export.shell import Var
from harness.spec.platforms import PLATFORMS

# The variables that pin an instance to its device (CUDA_VISIBLE_DEVICES, ZE_AFFINITY_MASK).
DEVICE_ENV_VARS = tuple(
    dict.fromkeys(p.device_env_var for p in PLATFORMS.values() if p.device_env_var)
)

# serve.sh's list of the devices to run on, by position (`DEVICES=4,5,6`).
DEVICES_VAR = "DEVICES"


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
