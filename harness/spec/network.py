"""The network invariants of instances spread over several nodes: checked before any request.

On one host every address is the same machine, so a server bound to 127.0.0.1 or a side channel
announced as `localhost` works by accident. Across machines they are the classic multi-node
faults: vLLM's NIXL side channel (`VLLM_NIXL_SIDE_CHANNEL_HOST`) and the EC one
(`VLLM_EC_SIDE_CHANNEL_HOST`) default to `localhost`, P announces that host to D in its
`kv_transfer_params.remote_host`, and D then knocks on its own door. So for an instance placed
on a node whose address is A, what was rendered must say A everywhere:

* `--host` (the last one on the command line: argparse keeps the last) is A, so the proxy, the
  taps and the peers reach it at the URL the harness records;
* every side-channel host variable the instance gets is A, and an instance running NIXL has
  one at all (unset means vLLM's `localhost`);
* A itself is no name for "this machine" (`localhost`, 127.0.0.1, 0.0.0.0, ::1) when the
  topology spans more than one node.

`violations()` reads only the rendered argv and environment, so it judges exactly what is
launched (extra flags and environment included); a violation names the instance and the
variable. What can only be seen once the servers run (which address each one listens on, and
whether its peers' nodes can connect) is checked by the launcher that placed them
(`harness.serve.ray_launcher`). Nothing here opens a socket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from harness.spec.instances import InstanceSpec
from harness.spec.platforms import EC_SIDE_CHANNEL_HOST_ENV, SIDE_CHANNEL_HOST_ENV

# What vLLM uses when a side-channel host variable is unset.
VLLM_DEFAULT_SIDE_CHANNEL_HOST = "localhost"
# Names that mean "this machine" (or every interface of it): wrong for anything a peer on
# another node must reach.
THIS_MACHINE = frozenset({"localhost", "127.0.0.1", "0.0.0.0", "::1", "::", "ip6-localhost"})
SIDE_CHANNEL_HOST_VARIABLES = (SIDE_CHANNEL_HOST_ENV, EC_SIDE_CHANNEL_HOST_ENV)
HOST_FLAG = "--host"


@dataclass(frozen=True)
class Violation:
    """One rendered setting that a peer on another node could not use."""

    instance: str
    variable: str  # "--host", "VLLM_NIXL_SIDE_CHANNEL_HOST", ...
    value: str | None  # None: not set at all
    node_address: str
    why: str

    def __str__(self) -> str:
        shown = "unset" if self.value is None else f"{self.value!r}"
        return (
            f"{self.instance}: {self.variable} is {shown}, but its node's address is "
            f"{self.node_address}: {self.why}"
        )


def last_flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in argv (argparse keeps the last)."""
    value = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def violations(
    instance: InstanceSpec,
    argv: Sequence[str],
    env: Mapping[str, str],
    multi_node: bool,
) -> list[Violation]:
    """What `instance`, launched with `argv` and `env` on the node at `instance.host`, got
    wrong; `multi_node` says whether its topology spans more than one node."""
    found: list[Violation] = []
    address = instance.host

    def wrong(variable: str, value: str | None, why: str) -> None:
        found.append(Violation(instance.name, variable, value, address, why))

    if multi_node and address.lower() in THIS_MACHINE:
        wrong("node address", address, "a peer on another node cannot reach this machine by it")
    bound = last_flag_value(argv, HOST_FLAG)
    if bound != address:
        wrong(HOST_FLAG, bound, "the proxy, the taps and its peers reach it at its node's address")
    for variable in SIDE_CHANNEL_HOST_VARIABLES:
        value = env.get(variable)
        if value is not None and value != address:
            wrong(variable, value, "a peer on another node connects to the host announced here")
    if instance.uses_nixl and SIDE_CHANNEL_HOST_ENV not in env:
        wrong(
            SIDE_CHANNEL_HOST_ENV,
            None,
            f"vLLM then announces {VLLM_DEFAULT_SIDE_CHANNEL_HOST!r}, which a peer on another "
            "node resolves to itself",
        )
    return found


def side_channels(instance: InstanceSpec) -> list[tuple[str, int]]:
    """The (host, port) pairs peers must reach besides the HTTP port: NIXL's side channel."""
    if instance.uses_nixl and instance.side_channel_port is not None:
        return [(instance.host, instance.side_channel_port)]
    return []
