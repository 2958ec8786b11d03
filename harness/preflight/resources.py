"""What the run takes from the machine: CPU cores (or devices) and ports."""

from __future__ import annotations

import os
from collections.abc import Sequence

from harness.errors import BadInput
from harness.preflight.files import describe_os_error
from harness.serve.ports import NoFreePortError, reserve_ports
from harness.spec.placement import TooFewDevices, side_channel_port_count
from harness.spec.platforms import DevicePlanError
from harness.spec.topology import ServingConfig, Topology


def available_cpu_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def check_devices(
    devices: tuple[int, ...], available: tuple[int, ...], source: str
) -> tuple[int, ...]:
    """On CPU a device is a core this process may run on (taskset and cgroups narrow the set).

    Syntax (numbers, each once) is `harness.platforms.parse_devices`'s job; this checks that
    the cores exist for us: OMP threads bound to a core we may not use fail at vLLM start-up.
    `source`: what named them, for the refusal ("--devices", "the default devices", "the
    bundle's devices").
    """
    missing = [d for d in devices if d not in available]
    if missing:
        raise BadInput(
            f"{source} {','.join(map(str, devices))}: core {missing[0]} is not "
            f"available to this process (available: {_ranges(available)})"
        )
    return devices


def too_few_devices(exc: TooFewDevices, topologies: Sequence[Topology]) -> DevicePlanError:
    """The scheduler's refusal with the remedies of a command that chose `topologies` with
    --topology and takes --colocate (run, load, fuzz, plan). Leaving a topology out is offered
    only while another would still run: `run --topology 1P+1D` was told to leave its one
    topology out, and without --topology a run judges every EPD topology."""
    remedy = "use --colocate to share devices within a topology"
    kept = [t for t in topologies if not t.is_baseline and t.name not in exc.needs]
    if kept:
        remedy += f", or leave {'it' if len(exc.needs) == 1 else 'them'} out with --topology"
    return DevicePlanError(f"{exc}; {remedy}")


def _ranges(numbers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "none"


def ports_held(topology: Topology, serving: ServingConfig) -> int:
    """The ports a topology's launch holds at once: one per instance, and one per NIXL side
    channel (a KV producer's or consumer's, `side_channel_port_count`), as the launcher leases
    them. Counting the instances alone let a range too small for the side channels through
    the check, and the run stopped after its baseline had started (found in review)."""
    return len(topology.roles) + side_channel_port_count(topology, serving)


def check_free_ports(count: int, port_range: range) -> None:
    """Take and give back `count` leases: proves the range has room before anything starts.

    It cannot promise the ports are still free a minute later (the runner takes its own leases
    then), but it turns "every port is taken" from a traceback mid-run into one line up front.
    """
    try:
        leases = reserve_ports(count, port_range=port_range)
    except NoFreePortError as exc:
        raise BadInput(f"no free port: {exc}") from None
    except OSError as exc:
        raise BadInput(f"cannot reserve ports: {describe_os_error(exc)}") from None
    for lease in leases:
        lease.release()
