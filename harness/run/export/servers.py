"""The processes serve.sh starts (`ExportedServer`), from the commands the run recorded
(`.cmd.json`): each instance's argv and environment templated with shell variables, and one
server as serve.sh's command line (`shell_command`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.errors import BadInput
from harness.redact import REDACTED, SECRET_FLAGS
from harness.run.export.devices import (
    DEVICE_ENV_VARS,
    RecordedDevice,
    device_positions,
    device_var,
    node_of,
)
from harness.run.export.shell import Arg, Var, shell_variable, shell_word
from harness.run.repro import Bundle
from harness.serve.session import safe_name
from harness.spec.platforms import (
    EC_SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
)
from harness.spec.topology import Role

FIRST_PORT = 18100  # the proxy's; instances follow in topology order
FIRST_SIDE_CHANNEL_PORT = 18200
TRANSFER_CONFIG_FLAGS = ("--ec-transfer-config", "--kv-transfer-config")

# Network settings of the recording hosts' interfaces (UCX_NET_DEVICES=mlx5_0:1, an IB HCA, a
# socket interface): not carried into a one-host export, where they may name nothing. With
# what a Ray run gave every instance (`--ray-instance-env`, run.json's launcher.instance_env).
CLUSTER_ENV_PREFIXES = ("UCX_", "NCCL_SOCKET_", "NCCL_IB_", "GLOO_SOCKET_", "TP_SOCKET_")


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
    node: str | None = None  # the Ray node it ran on (`node_of`); None: the run's one host

    @property
    def url(self) -> Arg:
        return ("http://", Var("HOST"), ":", self.port)


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
    (short name, command): one per instance. An instance revived in place (a fuzz run's, after
    a crash) left a `<name>.revived-N.cmd.json` beside its first, with the same flags; the
    first is the one kept (it sorts first)."""
    commands: dict[str, dict[str, Any]] = {}
    for path in sorted(topology_dir(bundle, label).glob("*.cmd.json")):
        command = json.loads(path.read_text(encoding="utf-8"))
        short = command.get("name", "").rsplit("/", 1)[-1]
        if short and not short.startswith("vllm-proxy"):
            commands.setdefault(short, command)
    return list(commands.items())


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
        command["env"] = without_cluster_env(launched_env(command), cluster)
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
                node=node_of(command),
            )
        )
    return tuple(servers), devices


def launched_env(command: dict[str, Any]) -> dict[str, Any]:
    """The environment a recorded instance ran with, as far as it matters: what it inherited
    that can change what it computes (`inherited_env`, `harness.spec.inherited_env`) under
    what the harness gave it (`env`), as the launch merged them."""
    return {**(command.get("inherited_env") or {}), **command["env"]}


def inherited_env(bundle: Bundle, label: str) -> tuple[tuple[str, str], ...]:
    """What the case's recorded instances inherited that can change what they compute and
    serve.sh therefore sets (the cluster's network settings left out: `dropped_env`)."""
    cluster = cluster_env_keys(bundle)
    inherited: dict[str, str] = {}
    for _, command in recorded_commands(bundle, label):
        env = command.get("inherited_env") or {}
        inherited.update({k: str(v) for k, v in env.items() if not is_cluster_env(k, cluster)})
    return tuple(sorted(inherited.items()))


def cluster_env_keys(bundle: Bundle) -> set[str]:
    """What a Ray run gave every instance for its cluster (`--ray-instance-env`)."""
    return set((bundle.run.get("launcher") or {}).get("instance_env") or {})


def is_cluster_env(key: str, cluster: set[str]) -> bool:
    return key in cluster or key.startswith(CLUSTER_ENV_PREFIXES)


def without_cluster_env(env: dict[str, Any], cluster: set[str]) -> dict[str, Any]:
    """`env` less the cluster's network settings (`is_cluster_env`)."""
    return {k: v for k, v in env.items() if not is_cluster_env(k, cluster)}


def dropped_env(bundle: Bundle, label: str) -> tuple[tuple[str, str], ...]:
    """The cluster network settings the case's recorded environments held, left out."""
    cluster = cluster_env_keys(bundle)
    dropped: dict[str, str] = {}
    for path in sorted(topology_dir(bundle, label).glob("*.cmd.json")):
        command = json.loads(path.read_text(encoding="utf-8"))
        env = launched_env({"env": {}, **command})
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
        elif previous in SECRET_FLAGS and arg == REDACTED:
            rendered.append((secret_variable(previous),))
        elif arg.partition("=")[0] in SECRET_FLAGS and arg.partition("=")[2] == REDACTED:
            flag = arg.partition("=")[0]
            rendered.append((f"{flag}=", secret_variable(flag)))
        elif arg == REDACTED:
            raise BadInput(f"the recorded command has a redacted argument after {previous}")
        else:
            rendered.append((arg,))
    return tuple(rendered)


def secret_variable(flag: str) -> Var:
    """`--api-key` -> serve.sh's $API_KEY: the credential the run gave it, which the bundle
    holds only redacted (found in review: `--api-key=KEY` reached serve.sh as the placeholder
    itself, vLLM's key then "[redacted]")."""
    return Var(shell_variable(flag.lstrip("-")), secret=True)


def secret_variables(servers: Iterable[ExportedServer]) -> tuple[str, ...]:
    """The names of the redacted values `servers` start with, each once: the credentials of
    their argv (`secret_variable`) and the redacted variables of their environment
    (`template_env`)."""
    names: dict[str, None] = {}
    for server in servers:
        for arg in (*server.argv, *(value for _, value in server.env)):
            names.update({p.name: None for p in arg if isinstance(p, Var) and p.secret})
    return tuple(names)


def secret_env_variables(servers: Iterable[ExportedServer]) -> tuple[str, ...]:
    """Those of `secret_variables` that are a variable of a server's environment, recorded
    redacted because its name matches the secret rule (`harness.redact.is_secret_name`): a
    credential, or a numerics variable that only looks like one
    (VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE), whose value the run had and the export lacks."""
    names: dict[str, None] = {}
    for server in servers:
        for key, value in server.env:
            if any(isinstance(p, Var) and p.secret for p in value):
                names[key] = None
    return tuple(names)


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


# serve.sh's $WORK with its backslashes and `"` escaped, as a JSON string needs: $WORK itself
# pasted into the config broke it on a path such as `bug "epd"/` (found in review).
WORK_IN_JSON = Var("WORK_JSON")


def template_storage(config_json: str) -> Arg:
    """A transfer config with its shared storage path under `$WORK/storage/<ec|kv>` (as
    `$WORK_JSON`, escaped for JSON)."""
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
        arg += [WORK_IN_JSON, piece]
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
            # The user's own, refused unset before anything starts (`secret_check`): unset, it
            # aborted serve.sh mid-start under `set -u` (found in review).
            rendered.append((key, (Var(key, secret=True),)))
        else:
            rendered.append((key, (value,)))
    return tuple(rendered)


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
