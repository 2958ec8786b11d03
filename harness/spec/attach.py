"""An EPD deployment the harness did not start, as an attach file describes it (`--attach FILE`).

Nightly GPU CI and release validation judge deployments made by Kubernetes, another launcher
or by hand on several machines. Nothing is launched for them: the file names the proxy that
serves the EPD requests and each instance's role and URL, so the harness can send the sweep's
prompts through the proxy, watch every instance's `/health` while it does, and read the
evidence each instance offers from outside (`/metrics`, and the EC storage when it is
reachable from the harness's machine). The same file is what `epd-harness repro --keep-up`
writes for the topology it keeps serving.

The file (JSON; YAML when its name ends in .yaml / .yml and PyYAML is installed):

    {"topology": "1E+1PD",                      # optional: checked against the roles
     "proxy": "http://10.0.0.5:8000",
     "instances": [{"role": "encoder", "url": "http://10.0.0.6:8000"},
                   {"role": "pd", "url": "http://10.0.0.7:8000"}],
     "ec_storage": "/mnt/ec-cache",             # optional: the ECExampleConnector's directory
     "kv_connector": "example"}                 # with a decode instance: example | nixl

`harness.preflight.attach` reads and checks it; this module is the checked result.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.spec.topology import TOPOLOGIES, Role, Topology

ATTACH_FILE_NAME = "attach.json"  # what `repro --keep-up` writes into its run directory
# The role names an attach file uses: Role values, less the baseline (the harness's own).
ATTACH_ROLES: dict[str, Role] = {
    role.value: role for role in (Role.ENCODER, Role.PREFILL_DECODE, Role.PREFILL, Role.DECODE)
}


@dataclass(frozen=True)
class AttachedInstance:
    """One vLLM instance of the deployment, reachable at `url` from the harness's machine."""

    name: str  # "<topology>/<role><n>", as the harness names the instances it launches
    role: Role
    url: str  # no trailing slash

    def describe(self) -> str:
        """How errors name it: its name, role and URL."""
        return f"{self.name} ({self.role.value}, {self.url})"


@dataclass(frozen=True)
class AttachSpec:
    """The deployment under test: its topology, the proxy's URL, its instances."""

    source: Path  # the attach file
    topology: Topology
    proxy_url: str
    instances: tuple[AttachedInstance, ...]
    # The ECExampleConnector's shared directory, as mounted on the harness's machine; None
    # when it is not reachable from here (the encoder guard is then not checkable).
    ec_storage: Path | None = None
    kv_connector: str = "example"  # harness.spec.connectors name: the KV guard's rule

    def with_role(self, role: Role) -> tuple[AttachedInstance, ...]:
        return tuple(i for i in self.instances if i.role is role)

    def to_json(self) -> dict[str, Any]:
        """The attach file's own form (what `repro --keep-up` writes, and run.json records)."""
        document: dict[str, Any] = {
            "topology": self.topology.name,
            "proxy": self.proxy_url,
            "instances": [{"role": i.role.value, "url": i.url} for i in self.instances],
        }
        if self.topology.has_kv_transfer:
            document["kv_connector"] = self.kv_connector
        if self.ec_storage is not None:
            document["ec_storage"] = str(self.ec_storage)
        return document


def attached_instances(
    topology: Topology, roles_and_urls: list[tuple[Role, str]]
) -> tuple[AttachedInstance, ...]:
    """Name the instances the way the harness names its own: `<topology>/<role><n>`, n
    counting per role in the order given."""
    seen: Counter[Role] = Counter()
    instances = []
    for role, url in roles_and_urls:
        instances.append(AttachedInstance(f"{topology.name}/{role.value}{seen[role]}", role, url))
        seen[role] += 1
    return tuple(instances)


def topology_of_roles(roles: list[Role]) -> Topology | None:
    """The known EPD topology with exactly these roles (in any order), or None."""
    wanted = Counter(roles)
    return next(
        (t for t in TOPOLOGIES.values() if not t.is_baseline and Counter(t.roles) == wanted),
        None,
    )


def describe_roles(roles: list[Role] | tuple[Role, ...]) -> str:
    """'encoder x2, pd' for error messages."""
    counts = Counter(roles)
    return ", ".join(
        role.value if n == 1 else f"{role.value} x{n}" for role, n in sorted_counts(counts)
    )


def sorted_counts(counts: Counter[Role]) -> list[tuple[Role, int]]:
    order = list(ATTACH_ROLES.values())
    return sorted(counts.items(), key=lambda item: order.index(item[0]) if item[0] in order else 9)
