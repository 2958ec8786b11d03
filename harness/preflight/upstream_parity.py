"""Upstream parity: the served release's own `run_epd_correctness_test.sh`, role by role, against
what the harness launches for the same role on a GPU platform.

The script (from the release's sdist or a dev build's tree: `harness.preflight.upstream_proxy`)
is read without running it (`harness.preflight.shell_script`), as run with
`DEVICE_PLATFORM=<platform>`: each stage (a top-level function call) is one topology, known by
the roles its `vllm serve` lines take (their EC and KV transfer configs), plus its proxy line.
Each `vllm serve` line and proxy line becomes items (flags, keys of JSON-valued flags, the
model, environment variables, the interpreter), and so does the harness's own rendering of the
same topology by the builders a session uses (`harness.spec.placement.place_instances`,
`harness.serve.entry.routes_for` and `vllm_proxy_for`), one device per instance, upstream's
layout. Every item that differs must be a deliberate difference of
`harness.spec.upstream_differences`; anything else is a finding naming the instance and the item.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.environment import LOOPBACK_HOST
from harness.preflight.shell_script import UNKNOWN, Command, ScriptError, read_commands
from harness.serve.entry import routes_for, vllm_proxy_for
from harness.serve.vllm_proxy import EPD_PROXY_FILE, TOY_PROXY_FILE
from harness.spec.generations import ProtocolGeneration
from harness.spec.placement import place_instances, side_channel_port_count
from harness.spec.platforms import CUDA, PlatformProfile
from harness.spec.topology import TOPOLOGIES, Role, Topology, serving_for
from harness.spec.upstream_differences import DIFFERENCES, Difference, Kind

SOURCE_ROOT = "<vllm-source>"  # GIT_ROOT, as the script is read
SERVED_PYTHON = "<served vLLM's python>"
PROXY_ROLES = {EPD_PROXY_FILE: "epd-proxy", TOY_PROXY_FILE: "toy-proxy"}
ABSENT = None  # an item a launch does not have; a flag without a value has ""
PYTHON = re.compile(r"python[0-9.]*")
# The proxy flags that name instances: by URL (the EPD proxy), by port (the toy proxy).
PROXY_URL_FLAGS = ("--encode-servers-urls", "--prefill-servers-urls", "--decode-servers-urls")
PROXY_PORT_FLAGS = ("--prefiller-ports", "--decoder-ports")
# The role of a proxy line whose program the harness does not know (`_unknown_proxy`).
UNKNOWN_PROXY = "unknown-proxy"


@dataclass(frozen=True)
class Launch:
    """One process a topology starts, as comparable items."""

    instance: str  # "TOPOLOGY/role": "1E+1P+1D/prefill", "1E+1PD/epd-proxy"
    items: dict[str, str]
    where: str  # the script line, or "harness"


@dataclass(frozen=True)
class Finding:
    """One item that differs; `allowed_by` is the table entry that explains it, if any."""

    instance: str
    item: str
    upstream: str | None
    harness: str | None
    allowed_by: Difference | None
    where: str

    def describe(self) -> str:
        def shown(value: str | None) -> str:
            return "absent" if value is None else (repr(value) if value else "set")

        return (
            f"{self.instance}: {self.item} is {shown(self.upstream)} upstream ({self.where}), "
            f"{shown(self.harness)} in the harness"
        )


@dataclass
class Parity:
    """The comparison of one script with the harness, for one release's generation."""

    generation: str
    findings: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # topologies missing on one side, ...
    compared: list[str] = field(default_factory=list)  # instances compared

    @property
    def unexplained(self) -> list[Finding]:
        return [f for f in self.findings if f.allowed_by is None]

    @property
    def used(self) -> set[Difference]:
        return {f.allowed_by for f in self.findings if f.allowed_by is not None}

    def unused(self) -> list[Difference]:
        """Entries that apply to this generation and to an instance compared, yet explained
        nothing: stale, or the harness moved closer to upstream without updating the table."""
        return [
            entry
            for entry in DIFFERENCES
            if entry not in self.used
            and any(entry.applies_to(i, self.generation) for i in self.compared)
        ]

    def report(self) -> list[str]:
        """One line per failure: an unexplained difference or a structural problem."""
        return [*self.problems, *(f.describe() for f in self.unexplained)]


# --- upstream ---------------------------------------------------------------------------------


def upstream_launches(script_text: str, platform: PlatformProfile) -> dict[str, list[Launch]]:
    """The script's launches per topology name (a stage whose roles match no harness topology
    is keyed by its function name, prefixed "?")."""
    pinned = {
        "DEVICE_PLATFORM": platform.name,
        "DEVICE_AFFINITY_ENV": platform.device_env_var or "",
        "GIT_ROOT": SOURCE_ROOT,
    }
    by_stage: dict[str, list[Command]] = {}
    for command in read_commands(script_text, pinned):
        if (
            _is_vllm_serve(command.argv)
            or _proxy_file(command.argv)
            or _unknown_proxy(command.argv)
        ):
            by_stage.setdefault(command.stage or "(top level)", []).append(command)
    launches: dict[str, list[Launch]] = {}
    for stage, commands in by_stage.items():
        serves = [c for c in commands if _is_vllm_serve(c.argv)]
        roles = tuple(_role_of(serve_items(c.argv, c.env)) for c in serves)
        roles_by_port = {
            serve_items(c.argv, c.env).get("--port", ""): role.value
            for c, role in zip(serves, roles, strict=True)
        }
        topology = _topology_of(roles)
        name = topology.name if topology else f"?{stage}"
        found = []
        for command in commands:
            if _is_vllm_serve(command.argv):
                items = serve_items(command.argv, command.env)
                role = _role_of(items).value
            elif _unknown_proxy(command.argv):
                # Compared with no item: the program is the finding (`compare`).
                program = _unknown_proxy(command.argv) or ""
                where = f"line {command.line}"
                found.append(Launch(f"{name}/{UNKNOWN_PROXY}", {"program": program}, where))
                continue
            else:
                items = _with_roles(proxy_items(command.argv, command.env), roles_by_port)
                role = PROXY_ROLES[_proxy_file(command.argv)]
            # An unexpanded word that is no flag's value names its own item: never compare it.
            unknown = [
                "an argument" if UNKNOWN in k else k for k, v in items.items() if UNKNOWN in k + v
            ]
            if unknown:
                raise ScriptError(f"line {command.line}: cannot expand {unknown[0]}")
            found.append(Launch(f"{name}/{role}", items, f"line {command.line}"))
        launches.setdefault(name, []).extend(found)
    return launches


def proxy_programs(script_text: str) -> list[tuple[int, str]]:
    """(line, program) of every proxy line of a script, known to the harness or not, as
    `_unknown_proxy` shows them: what a tree's script launches, for a refusal to name."""
    pinned = {"DEVICE_PLATFORM": CUDA.name, "GIT_ROOT": SOURCE_ROOT}
    pinned["DEVICE_AFFINITY_ENV"] = CUDA.device_env_var or ""
    found = []
    for command in read_commands(script_text, pinned):
        known = _proxy_file(command.argv)
        program = f"python {SOURCE_ROOT}/{known}" if known else _unknown_proxy(command.argv)
        if program:
            found.append((command.line, program))
    return found


def _is_vllm_serve(argv: Sequence[str]) -> bool:
    return len(argv) >= 2 and Path(argv[0]).name == "vllm" and argv[1] == "serve"


def _proxy_file(argv: Sequence[str]) -> str | None:
    for word in argv[:2]:
        for name in PROXY_ROLES:
            if word.endswith(name):
                return name
    return None


def _unknown_proxy(argv: Sequence[str]) -> str | None:
    """A proxy line whose program is none the harness knows, as it reads ("python -m
    vllm.x.epd_proxy", "python <vllm-source>/examples/moved/disagg_epd_proxy.py", "vllm
    disagg-proxy"), else None.
    A proxy is a Python program given --port (the correctness client takes --service_url); one
    upstream moved or turned into a module would otherwise be dropped from the comparison,
    and parity would say only that the harness launches a proxy."""
    if not argv or _proxy_file(argv) or _is_vllm_serve(argv):
        return None
    if not any(word == "--port" or word.startswith("--port=") for word in argv[1:]):
        return None
    if Path(argv[0]).name == "vllm" and len(argv) > 1:  # a vLLM subcommand: `vllm X-proxy`
        return f"vllm {argv[1]}"
    if not PYTHON.fullmatch(Path(argv[0]).name):
        return None
    program = argv[1:3] if len(argv) > 2 and argv[1] == "-m" else argv[1:2]
    return " ".join(["python", *program])


def _role_of(items: dict[str, str]) -> Role:
    ec_role = items.get("--ec-transfer-config ec_role")
    kv_role = items.get("--kv-transfer-config kv_role")
    if ec_role == "ec_producer":
        return Role.ENCODER
    if kv_role == "kv_producer":
        return Role.PREFILL
    if kv_role == "kv_consumer":
        return Role.DECODE
    if ec_role == "ec_consumer":
        return Role.PREFILL_DECODE
    return Role.BASELINE


def _topology_of(roles: tuple[Role, ...]) -> Topology | None:
    return next((t for t in TOPOLOGIES.values() if sorted(t.roles) == sorted(roles)), None)


# --- items -----------------------------------------------------------------------------------


def serve_items(argv: Sequence[str], env: dict[str, str]) -> dict[str, str]:
    """A `vllm serve` line as items: "model", each flag (JSON values key by key), "env NAME"."""
    start = list(argv).index("serve") + 1
    items: dict[str, str] = {}
    if start < len(argv) and not argv[start].startswith("--"):
        items["model"] = argv[start]
        start += 1
    items.update(_flag_items(argv[start:], vllm_spelling=True))
    items.update({f"env {name}": value for name, value in env.items()})
    return items


def proxy_items(argv: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """A proxy line as items: "interpreter", "program" (its path in the vLLM tree), flags,
    "env NAME"."""
    program = _proxy_file(argv)
    index = next(i for i, word in enumerate(argv) if program and word.endswith(program))
    items = {"interpreter": " ".join(argv[:index]), "program": program or ""}
    items.update(_flag_items(argv[index + 1 :], vllm_spelling=False))
    items.update({f"env {name}": value for name, value in env.items()})
    return items


def _with_roles(items: dict[str, str], roles_by_port: Mapping[str, str]) -> dict[str, str]:
    """`items` and, for each proxy flag naming instances, the roles of those it names
    ("--decode-servers-urls role": "decode"): their URLs and ports differ by design (the
    taps', a deliberate difference), which instance each reaches must not."""
    found = dict(items)
    for flag in (*PROXY_URL_FLAGS, *PROXY_PORT_FLAGS):
        if flag not in items:
            continue
        named = []
        for target in items[flag].replace(",", " ").split():
            if flag in PROXY_URL_FLAGS and "://" not in target:
                named.append(target)  # "disable": no instance
                continue
            port = target.rstrip("/").rsplit(":", 1)[-1]
            named.append(roles_by_port.get(port, f"no instance at {target}"))
        found[f"{flag} role"] = " ".join(named)
    return found


def _flag_items(words: Sequence[str], vllm_spelling: bool) -> dict[str, str]:
    """Flags as vLLM's argparse takes them: a flag given again replaces what it gave before
    (a JSON config whole, never merged key by key), and the repetition is an item of its own,
    "--flag repeated": "2 times", as an append option (--middleware) keeps every value.
    `vllm_spelling`: "--max_num_seqs" is "--max-num-seqs", as vLLM's parser reads it; a
    proxy's plain argparse takes only the spelling it declares."""
    items: dict[str, str] = {}
    given: dict[str, int] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            items[f"positional {word}"] = ""
            i += 1
            continue
        name, equals, inline = word.partition("=")
        if vllm_spelling:
            name = name.replace("_", "-")
        values = [inline] if equals else []
        i += 1
        while not equals and i < len(words) and not words[i].startswith("--"):
            values.append(words[i])
            i += 1
        value = " ".join(values)
        given[name] = given.get(name, 0) + 1
        for key in [k for k in items if k == name or k.startswith(f"{name} ")]:
            del items[key]
        parsed = _json_object(value)
        if parsed is None:
            items[name] = value
        else:
            items.update({f"{name} {key}": leaf for key, leaf in _leaves(parsed)})
    items.update(
        {f"{name} repeated": f"{count} times" for name, count in given.items() if count > 1}
    )
    return items


def _json_object(value: str) -> dict | None:
    if not value.lstrip().startswith("{"):
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _leaves(data: dict, prefix: str = "") -> Iterable[tuple[str, str]]:
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path, value if isinstance(value, str) else json.dumps(value)


# --- the harness -----------------------------------------------------------------------------


def harness_launches(
    topology: Topology, generation: ProtocolGeneration, platform: PlatformProfile = CUDA
) -> list[Launch]:
    """What the harness starts for `topology` on `platform`: every instance on a device of its
    own (upstream's layout), placeholder ports and storage, and vLLM's own proxy (static)."""
    model = platform.default_model or "MODEL"
    serving = serving_for(platform, model)
    ports = iter(range(30000, 31000))
    specs = place_instances(
        topology,
        serving,
        platform,
        [next(ports) for _ in topology.roles],
        Path("/runs/run-id") / topology.name,
        tuple(range(len(topology.roles))),
        side_channel_ports=[next(ports) for _ in range(side_channel_port_count(topology, serving))],
        generation=generation,
    )
    launches = [
        Launch(f"{topology.name}/{spec.role.value}", serve_items(spec.argv(), spec.env()), "")
        for spec in specs
    ]
    if len(specs) > 1:
        # A tap in front of every instance, wired as the session wires them (`routes_for`).
        tap_ports = {spec.url: str(next(ports)) for spec in specs}
        roles_by_port = {tap_ports[spec.url]: spec.role.value for spec in specs}
        tap_urls = {url: f"http://{LOOPBACK_HOST}:{port}" for url, port in tap_ports.items()}
        routes = routes_for(specs, tap_urls)
        proxy = vllm_proxy_for((SERVED_PYTHON,), Path(SOURCE_ROOT), next(ports), routes)
        role = PROXY_ROLES[_proxy_file(proxy.argv) or ""]
        items = _with_roles(proxy_items(proxy.argv, proxy.env), roles_by_port)
        launches.append(Launch(f"{topology.name}/{role}", items, ""))
    return launches


# --- comparing -------------------------------------------------------------------------------


def compare(
    script_text: str, generation: ProtocolGeneration, platform: PlatformProfile = CUDA
) -> Parity:
    """The script's launches against the harness's, topology by topology, item by item."""
    parity = Parity(generation.name)
    upstream = upstream_launches(script_text, platform)
    if not upstream:
        parity.problems.append("the script launches no vllm serve at all")
    for name, launches in upstream.items():
        if name.startswith("?"):
            roles = ", ".join(launch.instance.rsplit("/", 1)[1] for launch in launches)
            parity.problems.append(
                f"stage {name[1:]} launches {roles}: no harness topology has these roles"
            )
            continue
        # Grouped by name: a topology with two instances of one role (2E+1PD's encoders)
        # names them alike, on either side; each is compared with its counterpart in order.
        ours: dict[str, list[Launch]] = {}
        for launch in harness_launches(TOPOLOGIES[name], generation, platform):
            ours.setdefault(launch.instance, []).append(launch)
        unknown = [launch for launch in launches if launch.instance.endswith(UNKNOWN_PROXY)]
        launches = [launch for launch in launches if launch not in unknown]
        for launch in unknown:
            # Upstream's proxy is there, under a program the harness does not launch: say
            # which, against the harness's own, instead of "only the harness launches it".
            mine = next(
                (
                    ours.pop(instance)[0]
                    for instance in sorted(ours)
                    if instance.rsplit("/", 1)[1] in PROXY_ROLES.values()
                ),
                None,
            )
            instance = mine.instance if mine else launch.instance
            ours_there = f"launches {mine.items['program']}" if mine else "launches no proxy there"
            parity.problems.append(
                f"{instance}: upstream launches {launch.items['program']!r} ({launch.where}), "
                f"a proxy the harness does not know; the harness {ours_there}"
            )
        theirs: dict[str, list[Launch]] = {}
        for launch in launches:
            theirs.setdefault(launch.instance, []).append(launch)
        for instance in sorted(set(ours) | set(theirs)):
            if instance not in theirs or instance not in ours:
                side = "upstream" if instance in theirs else "the harness"
                parity.problems.append(f"{instance}: only {side} launches it")
                continue
            # Serve roles come in equal numbers (the topology was matched by them): only a
            # stage's proxy can come more often upstream, which the harness launches once.
            for extra in theirs[instance][len(ours[instance]) :]:
                parity.problems.append(f"{instance} is launched twice ({extra.where})")
            for upstream, harness in zip(theirs[instance], ours[instance], strict=False):
                parity.compared.append(instance)
                parity.findings += _differences(upstream, harness, generation.name)
    return parity


def _differences(theirs: Launch, ours: Launch, generation: str) -> list[Finding]:
    findings = []
    for item in sorted(set(theirs.items) | set(ours.items)):
        upstream, harness = theirs.items.get(item, ABSENT), ours.items.get(item, ABSENT)
        if upstream == harness:
            continue
        if upstream is ABSENT:
            kind = Kind.HARNESS_ONLY
        elif harness is ABSENT:
            kind = Kind.UPSTREAM_ONLY
        else:
            kind = Kind.VALUE
        allowed = next(
            (
                entry
                for entry in DIFFERENCES
                if entry.item == item
                and entry.kind is kind
                and entry.applies_to(ours.instance, generation)
            ),
            None,
        )
        findings.append(Finding(ours.instance, item, upstream, harness, allowed, theirs.where))
    return findings
