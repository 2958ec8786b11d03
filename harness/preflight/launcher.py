"""`--launcher` and the `--ray-*` flags, checked: which launcher runs the instances, and how.

Nothing here contacts a cluster: whether its nodes can serve (network invariants, shared
storage, the served vLLM on every node) is checked where the instances are placed
(`harness.serve.ray_launcher`), before any of them starts.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from harness.errors import BadInput
from harness.spec.platforms import PLATFORMS, SIDE_CHANNEL_PORT_ENV
from harness.spec.settings import (
    ATTACH_PROXY,
    LAUNCHER_KINDS,
    LOCAL_LAUNCHER,
    PLACEMENTS,
    RAY_LAUNCHER,
    REHEARSAL_NODES,
    SPREAD_PLACEMENT,
    LauncherChoice,
)
from harness.spec.topology import Topology

RAY_DISTRIBUTION = "ray"
SETUP_HINT = "scripts/cpu setup --ray, or pip install 'epd-harness[ray]'"
_ADDRESS = re.compile(r"[A-Za-z0-9_.:\[\]-]+:\d{1,5}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What the harness renders for each instance from its placement (harness.spec.instances); one
# value given to every instance would replace it: all of them on one device, whose memory
# shares were computed for devices of their own, or one side-channel port for all.
PLACED_ENV = {
    **{
        p.device_env_var: "its devices, from the placement"
        for p in PLATFORMS.values()
        if p.device_env_var
    },
    **{
        name: "how its devices are numbered"
        for p in PLATFORMS.values()
        for name, _value in p.device_order_env
    },
    SIDE_CHANNEL_PORT_ENV: "a port reserved for it",
}


class LauncherRequest(Protocol):
    launcher: str
    proxy: str
    ray_address: str | None
    ray_placement: str | None
    ray_shared_dir: str | None
    ray_instance_env: tuple[str, ...]


def refuse_ray_flags_without_ray(request: LauncherRequest) -> None:
    """A `--ray-*` flag means nothing to the local launcher: refused, never dropped."""
    if request.launcher not in LAUNCHER_KINDS:
        raise BadInput(f"--launcher {request.launcher}: choose one of {', '.join(LAUNCHER_KINDS)}")
    given = [
        flag
        for flag, value in (
            ("--ray-address", request.ray_address),
            ("--ray-placement", request.ray_placement),
            ("--ray-shared-dir", request.ray_shared_dir),
            ("--ray-instance-env", request.ray_instance_env),
        )
        if value
    ]
    if request.launcher == LOCAL_LAUNCHER and given:
        raise BadInput(
            f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} the Ray launcher; "
            f"add --launcher ray (or drop {'it' if len(given) == 1 else 'them'})"
        )
    if request.launcher == RAY_LAUNCHER and request.proxy == ATTACH_PROXY:
        raise BadInput(
            "--launcher ray launches the topology on a Ray cluster, and --attach judges one "
            "somebody else launched; drop one of them"
        )


def launcher_choice(request: LauncherRequest) -> LauncherChoice:
    """The launcher the flags choose, their values checked from the flags alone (nothing of
    this machine: `check_launcher_here` is that part)."""
    if request.launcher == LOCAL_LAUNCHER:
        return LauncherChoice()
    address = request.ray_address
    if address is not None and not _ADDRESS.fullmatch(address):
        raise BadInput(f"--ray-address {address!r}: expected HOST:PORT of the cluster's head")
    placement = request.ray_placement or SPREAD_PLACEMENT
    if placement not in PLACEMENTS:
        raise BadInput(f"--ray-placement {placement}: choose one of {', '.join(PLACEMENTS)}")
    shared_dir = None
    if request.ray_shared_dir:
        shared_dir = Path(request.ray_shared_dir).expanduser().resolve()
    env: list[tuple[str, str]] = []
    for item in request.ray_instance_env:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            raise BadInput(f"--ray-instance-env {item!r}: expected NAME=VALUE")
        if name in PLACED_ENV:
            raise BadInput(
                f"--ray-instance-env {item}: the harness sets {name} for each instance itself "
                f"({PLACED_ENV[name]}), and one value for every instance would replace it; "
                "drop it"
            )
        env.append((name, value))
    return LauncherChoice(
        kind=RAY_LAUNCHER,
        ray_address=address,
        placement=placement,
        shared_dir=shared_dir,
        instance_env=tuple(env),
    )


def sized_for(
    choice: LauncherChoice, topologies: Sequence[Topology], baseline_beside: bool
) -> LauncherChoice:
    """`choice` with its rehearsal cluster sized for what the run keeps up at once: its largest
    topology, one node per instance, and the baseline's node beside it where the command keeps
    the baseline up too (found on real vLLM: `fuzz --topology 1E+1P+1D --launcher ray` placed
    the baseline on one of three nodes, then waited 60 s for 1E+1P+1D's three and was refused).
    A cluster given by address is the user's, as it is."""
    if not choice.rehearses_on_this_host or not topologies:
        return choice
    most = max(len(t.roles) for t in topologies) + (1 if baseline_beside else 0)
    return replace(choice, rehearsal_nodes=max(REHEARSAL_NODES, most))


def check_launcher_here(choice: LauncherChoice) -> None:
    """That this environment can use the chosen launcher: for `ray`, Ray installed here and
    the shared directory there."""
    if choice.kind != RAY_LAUNCHER:
        return
    try:
        importlib.metadata.version(RAY_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise BadInput(f"--launcher ray needs Ray in this environment: {SETUP_HINT}") from None
    if choice.shared_dir is not None and not choice.shared_dir.is_dir():
        raise BadInput(f"--ray-shared-dir {choice.shared_dir}: not a directory")
