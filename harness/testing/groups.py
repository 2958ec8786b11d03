"""An e2e item's group, the running topology it needs (`EpdGroup`: the topology, the variant of
its instances, the proxy it goes through), and the session's e2e items in the order they run
(`E2eQueue`): what the items after one still need running."""

from __future__ import annotations

import dataclasses

import pytest

from harness.testing.session_options import session_kv_connector, session_launcher

TOPOLOGY_ORDER = ("baseline", "1E+1PD", "2E+1PD", "1P+1D", "1E+1P+1D")
DEFAULT_VARIANT = ""
E2E_QUEUE_KEY = pytest.StashKey["E2eQueue"]()
# The node id of the item running now (what is still to come is read from the queue after it).
CURRENT_ITEM_KEY = pytest.StashKey[str]()


@dataclasses.dataclass(frozen=True)
class EpdGroup:
    """The running topology an e2e item needs: its name, the variant of its instances (another
    KV connector: other instances), and the proxy it goes through (same instances)."""

    topology: str
    variant: str = DEFAULT_VARIANT
    proxy: str = ""  # "" for the run's own proxy

    @property
    def instances(self) -> tuple[str, str]:
        """What decides which instances run: items sharing it share one start."""
        return (self.topology, self.variant)

    def order(self) -> tuple:
        """Default instances first, then variants; within them, the plan's topology order."""
        rank = TOPOLOGY_ORDER.index(self.topology) if self.topology in TOPOLOGY_ORDER else 99
        return (self.variant != DEFAULT_VARIANT, self.variant, rank, self.topology)

    def xdist_name(self) -> str:
        """A topology and the references its cases are judged against share a worker, through
        whichever proxy."""
        from harness.spec.topology import TOPOLOGIES

        root = self.topology
        while root in TOPOLOGIES and TOPOLOGIES[root].exact_reference:
            root = TOPOLOGIES[root].exact_reference
        return f"{self.variant}:{root}" if self.variant else root


def epd_group(item: pytest.Item) -> EpdGroup | None:
    """The group of an e2e item (None for every other tier)."""
    if item.get_closest_marker("e2e") is None:
        return None
    variant_marker = item.get_closest_marker("epd_variant")
    variant = variant_marker.args[0] if variant_marker else DEFAULT_VARIANT
    if variant in (session_kv_connector(item.config), session_launcher(item.config)):
        # A variant naming the session's own KV connector (NIXL on cuda), or its own launcher
        # (`ray` under `--epd-launcher ray`), asks for the very instances the default group
        # runs: in a group of its own they would start twice (found in review: the 3B P+D
        # again every GPU night; 1E+1P+1D again for scenarios/test_ray.py's first item).
        variant = DEFAULT_VARIANT
    proxy_marker = item.get_closest_marker("epd_proxy")
    proxy = proxy_marker.args[0] if proxy_marker else ""
    marker = item.get_closest_marker("epd_topology")
    params = getattr(getattr(item, "callspec", None), "params", {})
    topology = params.get("topology")
    scenario = params.get("scenario")
    if marker is not None:
        name = marker.args[0]
    elif isinstance(topology, str):
        name = topology
    elif scenario is not None and hasattr(scenario, "topology"):
        name = scenario.topology
    else:
        name = "baseline"
    return EpdGroup(name, variant, proxy)


def owns_instances(item: pytest.Item) -> bool:
    """Whether the item starts topologies of its own through the CLI (`own_instances`): it
    needs nothing of the pool, and runs after every item that does."""
    return item.get_closest_marker("own_instances") is not None


def ends_session(item: pytest.Item) -> bool:
    scenario = getattr(getattr(item, "callspec", None), "params", {}).get("scenario")
    return item.get_closest_marker("epd_ends_session") is not None or bool(
        getattr(scenario, "ends_its_session", False)
    )


@dataclasses.dataclass(frozen=True)
class E2eQueue:
    """The e2e items in the order they run, each with its xdist group and its group: what the
    items after one still need running. An xdist group runs on one worker in this order, and an
    exact reference is always in its topology's xdist group (`EpdGroup.xdist_name`), so the
    later items of an item's xdist group are those that can still need what it ran."""

    order: tuple[tuple[str, str, EpdGroup], ...]  # (node id, xdist group, group)

    @classmethod
    def of(cls, items: list[pytest.Item]) -> E2eQueue:
        order = []
        for item in items:
            group = epd_group(item)
            marker = item.get_closest_marker("xdist_group")
            if group is not None and not owns_instances(item):  # it needs nothing running
                order.append((item.nodeid, marker.args[0] if marker else "", group))
        return cls(tuple(order))

    def from_item(self, nodeid: str, same_xdist_group: bool) -> list[str]:
        """The node ids from `nodeid` on, itself first, in the order they run (only its xdist
        group's with `same_xdist_group`); none when `nodeid` is not an e2e item of the pool."""
        position = next((n for n, (node, _, _) in enumerate(self.order) if node == nodeid), None)
        if position is None:
            return []
        xdist_group = self.order[position][1]
        return [
            node
            for node, later_xdist_group, _ in self.order[position:]
            if not same_xdist_group or later_xdist_group == xdist_group
        ]

    def needed_after(self, nodeid: str) -> set[tuple[str, str]]:
        """The instances (topology, variant) that the items after `nodeid` in its xdist group
        need running: their own, and their topology's exact reference."""
        return self._needed(nodeid, 1)

    def needed_from(self, nodeid: str) -> set[tuple[str, str]]:
        """`needed_after`, with what `nodeid` itself needs."""
        return self._needed(nodeid, 0)

    def _needed(self, nodeid: str, skip: int) -> set[tuple[str, str]]:
        from harness.spec.topology import TOPOLOGIES

        position = next((n for n, (node, _, _) in enumerate(self.order) if node == nodeid), None)
        if position is None:
            return set()
        xdist_group = self.order[position][1]
        needed: set[tuple[str, str]] = set()
        for _, later_xdist_group, group in self.order[position + skip :]:
            if later_xdist_group != xdist_group:
                continue
            needed.add(group.instances)
            topology = TOPOLOGIES.get(group.topology)
            if topology is not None and topology.exact_reference:
                needed.add((topology.exact_reference, group.variant))
        return needed
