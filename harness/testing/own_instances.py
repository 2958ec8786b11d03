"""The command line of a scenario that starts topologies of its own (`own_instances`).

Some e2e scenarios drive `epd-harness` itself (`run`, `repro`, `fuzz`, `export`) in the
session's process: a planted fault's repro, the planted fuzz, the exports of the bugs found in
vLLM. Those commands place their own instances, so they must serve what the session serves,
where the session's plan lets them: left to the CLI's defaults they served the cpu profile
whatever the session's platform, and on GPUs they would have leased devices the session's
pool, or another xdist worker's, held (so they were deselected on every GPU platform, and the
GPU night never checked them).

`SESSION_OPTIONS` is every option of the session (conftest.py) that says what is served and
how, with the flag each command takes it as; a session option a command would ignore refuses
the item (deselected and listed at collection, `refusal`), never dropped. `OwnInstances` is
what an item gets (the plugin's `epd_own_instances` fixture): the flags for each command, the
devices of its xdist group's slots in the session's plan plus the baseline's (`devices`), and
a lease of those devices for servers a test starts outside the harness (an export's run.sh).
The plugin orders these items after every other e2e item of their xdist group and stops its
worker's pool before one runs, so the devices they lease are held by no instance of theirs;
another worker holds the baseline's device only while it serves the baseline, and no slot of
this group at all.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.spec.topology import TOPOLOGIES

# The commands a scenario may run with topologies of its own (its `own_instances` marker's
# arguments).
COMMANDS = ("run", "repro", "fuzz", "export")
SERVING = frozenset({"run", "fuzz"})  # the commands that take what is served and where
# The session options that choose tests or artifacts, not what is served.
NOT_SERVING = ("--epd-run-dir", "--epd-topology")


@dataclass(frozen=True)
class SessionOption:
    """One session option and how it reaches the CLI: the flag, the commands that take it,
    and the commands it means nothing to (with why); for any other command it is refused."""

    option: str  # the pytest option, e.g. --epd-model
    flag: str  # the CLI's, e.g. --model
    default: object = None  # the session's default: an option at it is not passed on
    takes: frozenset[str] = SERVING
    # Commands the option means nothing to: repro and export take what the bundle recorded.
    moot: frozenset[str] = frozenset({"repro", "export"})
    why: str = ""  # why a command outside `takes` and `moot` cannot honour it
    # The transfer the option configures ("kv": P to D, "ec": E to its consumer): left out of
    # a command none of whose topologies has one, which the CLI refuses as a flag it would
    # ignore (`harness.preflight.connectors`, the reference policy's in `check_arguments`).
    moves: str = ""

    def is_set(self, value: object) -> bool:
        return value not in (None, False, "", self.default)


RAY_WHY = (
    "the CLI in this process ends the session's Ray connection when it returns, and an "
    "export's run.sh serves on this host"
)
SESSION_OPTIONS = (
    SessionOption("--epd-model", "--model"),
    SessionOption("--epd-vllm", "--vllm", takes=frozenset({"run", "fuzz", "repro"})),
    SessionOption("--epd-allow-untested-vllm", "--allow-untested-vllm"),
    SessionOption("--epd-platform", "--platform", default="cpu"),
    SessionOption("--epd-colocate", "--colocate"),
    SessionOption("--epd-no-enforce-eager", "--no-enforce-eager"),
    SessionOption("--epd-dtype", "--dtype"),
    SessionOption("--epd-kv-connector", "--kv-connector", moves="kv"),
    SessionOption("--epd-ec-connector", "--ec-connector", moves="ec"),
    # The policies part only on a P->D hop (`harness.judge.policy`): "kv", as the CLI refuses it.
    SessionOption("--epd-reference-policy", "--reference-policy", moves="kv"),
    SessionOption("--epd-proxy", "--proxy", default="harness"),
    SessionOption("--epd-proxy-registration", "--proxy-registration"),
    # Given to run and fuzz with vLLM's proxy only (`OwnInstances.args`), as to the session's.
    SessionOption(
        "--epd-vllm-source",
        "--vllm-source",
        takes=frozenset({"run", "fuzz", "export"}),
        moot=frozenset({"repro"}),
    ),
    # fuzz --stream sends every example streamed, as run --stream does its cases.
    SessionOption("--epd-stream", "--stream"),
    # Fuzz serves its baseline live for every example; repro judges against a live one.
    SessionOption(
        "--epd-baseline-cache",
        "--baseline-cache",
        takes=frozenset({"run"}),
        moot=frozenset({"repro", "fuzz", "export"}),
    ),
    SessionOption(
        "--epd-refresh-baseline",
        "--refresh-baseline",
        takes=frozenset({"run"}),
        moot=frozenset({"repro", "fuzz", "export"}),
    ),
    # A repro replays the launcher its bundle recorded: in this process, the same refusal.
    SessionOption(
        "--epd-launcher",
        "--launcher",
        default="local",
        takes=frozenset(),
        moot=frozenset(),
        why=RAY_WHY,
    ),
    SessionOption(
        "--epd-ray-address", "--ray-address", takes=frozenset(), moot=frozenset(), why=RAY_WHY
    ),
    # The devices are the item's (`OwnInstances.devices`), not the session's list.
    SessionOption("--epd-devices", "--devices"),
)
OPTION_BY_NAME = {o.option: o for o in SESSION_OPTIONS}


def in_session_terms(message: str) -> str:
    """A preflight message with each CLI flag it names written as the session option that sets
    it (`--platform bogus` -> `--epd-platform bogus`): the session's preflight is the CLI's, and
    its messages name the CLI's flags, which a pytest command line does not have."""
    flags = {o.flag: o.option for o in SESSION_OPTIONS}
    # The CLI's --topology is the session's --epd-topology: it shrinks the session's plan too.
    flags.update({f"--{option.removeprefix('--epd-')}": option for option in NOT_SERVING})
    for flag, option in flags.items():
        message = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", option, message)
    return message


def commands_of(marker_args: Sequence[object], nodeid: str) -> tuple[str, ...]:
    """The commands an `own_instances` marker names; an unknown one, or none, is refused."""
    unknown = [repr(a) for a in marker_args if a not in COMMANDS]
    if unknown or not marker_args:
        raise ValueError(
            f"{nodeid}: own_instances names the epd-harness commands the item runs "
            f"({', '.join(COMMANDS)}), not {', '.join(unknown) or 'none'}"
        )
    return tuple(str(a) for a in marker_args)


def refusal(values: Mapping[str, object], commands: Sequence[str]) -> str | None:
    """Why the session's options (`values`: option -> value as given) cannot reach these
    commands, or None: an option set that a command neither takes nor can leave aside."""
    for option in SESSION_OPTIONS:
        if not option.is_set(values.get(option.option, option.default)):
            continue
        for command in commands:
            if command not in option.takes and command not in option.moot:
                return (
                    f"the session's {option.option} cannot reach `epd-harness {command}`, "
                    f"which a test runs with topologies of its own ({option.why})"
                )
    return None


def moved_by(option: SessionOption, topologies: Sequence[str]) -> bool:
    """Whether one of `topologies` (none named: any) has the transfer `option` configures."""
    if not option.moves or not topologies:
        return True
    served = [TOPOLOGIES[name] for name in topologies]
    if option.moves == "kv":
        return any(t.has_kv_transfer for t in served)
    return any(t.has_ec_transfer for t in served)


@dataclass(frozen=True)
class OwnInstances:
    """What an `own_instances` item gives the commands it runs: the session's options as their
    flags, and its devices."""

    values: Mapping[str, object]  # session option -> value as given
    commands: tuple[str, ...]  # what the item's marker declares
    platform: str  # the session's platform profile's name
    exclusive_devices: bool  # instances own their devices (GPU / XPU)
    # The item's devices: on GPUs its xdist group's slots and the baseline's in the session's
    # plan (no other worker's group is placed there); on CPU the session's cores, if given.
    devices: tuple[int, ...] | None
    # The session's baseline cache as resolved (a directory, or "off"), when the session chose
    # one: `--epd-baseline-cache off` under xdist is a directory of the session's own.
    baseline_cache: str | None = None
    lock_dir: Path | None = field(default=None, compare=False)  # default: the pool's

    def args(
        self, command: str, proxy: str | None = None, topologies: Sequence[str] = ()
    ) -> list[str]:
        """The flags that give `command` what the session serves and where. `proxy`: the
        proxy the test runs it through, when that is its own choice (the exports' vLLM
        proxy); the session's vLLM source then goes with it. `topologies`: those the command
        serves (names), when the test chooses them: a connector none of them uses is left
        out (under `--epd-kv-connector nixl` a run of 1E+1PD alone was refused, "none of
        1E+1PD has a D"); none named, every option set goes."""
        if command not in self.commands:
            raise ValueError(
                f"{command!r} is not among the commands the item's own_instances marker "
                f"declares ({', '.join(self.commands)}): the collection checked only those"
            )
        argv: list[str] = []
        values = dict(self.values)
        if proxy is not None:
            values["--epd-proxy"] = proxy
        proxy = str(values.get("--epd-proxy") or "harness")
        for option in SESSION_OPTIONS:
            value = values.get(option.option, option.default)
            if command not in option.takes:
                continue
            if option.option == "--epd-proxy" and proxy != option.default:
                argv += [option.flag, proxy]  # the test's own choice too
                continue
            if option.option == "--epd-devices":
                if self.devices is not None:
                    argv += [option.flag, ",".join(map(str, self.devices))]
                continue
            if option.option == "--epd-vllm-source" and proxy != "vllm" and command != "export":
                continue  # the session's proxy takes it only when it is vLLM's, as here
            if option.option == "--epd-baseline-cache":
                if self.baseline_cache is not None:
                    argv += [option.flag, self.baseline_cache]
                continue
            if not option.is_set(value) or not moved_by(option, topologies):
                continue
            argv += [option.flag] if value is True else [option.flag, str(value)]
        return argv

    @contextlib.contextmanager
    def held_devices(self) -> Iterator[str | None]:
        """The item's devices leased as the pool leases them (`lease_devices`), for servers
        the test starts outside the harness (an export's run.sh), as serve.sh's DEVICES
        value; on CPU nothing is leased and None is yielded (serve.sh's default)."""
        if not self.exclusive_devices or not self.devices:
            yield None
            return
        from harness.serve.ports import lease_devices

        leases = lease_devices(self.platform, self.devices, self.lock_dir)
        try:
            yield ",".join(map(str, self.devices))
        finally:
            for lease in leases:
                lease.release()
