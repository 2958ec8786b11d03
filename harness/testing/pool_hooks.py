"""The session's pool as its items run: told which item begins and what it and the later items
of its xdist group need (`TopologyPool.item_begins`), and a group's topology stopped as the
group ends (memory, and NIXL's spinning progress threads), after every sweep that will need its
answers as an exact reference has had them (`TopologyPool.before_stop`: before_stop.py); where
a class ends, the variants its fixtures started with environment added to a role
(`TopologyPool.release_variants`)."""

from __future__ import annotations

from typing import Any

import pytest

from harness.testing.groups import CURRENT_ITEM_KEY, E2E_QUEUE_KEY, epd_group

POOL_KEY = pytest.StashKey[object]()
# Instances (topology, variant) a group's end left running for a later item of its xdist group.
KEPT_FOR_LATER_KEY = pytest.StashKey[set]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The item running now, from its fixtures' setup on (one may stop the baseline); the
    pool's sessions it asks for are in use until the next item (`TopologyPool.item_begins`)."""
    item.config.stash[CURRENT_ITEM_KEY] = item.nodeid
    pool = item.config.stash.get(POOL_KEY, None)
    if pool is not None:
        begin_item(item.config, pool)


def begin_item(config: pytest.Config, pool: Any) -> None:
    """Tell the pool an item begins, and which topologies it and the later items of its
    xdist group need: those it keeps for them, whoever waits for their devices."""
    queue = config.stash.get(E2E_QUEUE_KEY, None)
    current = config.stash.get(CURRENT_ITEM_KEY, None)
    needed = queue.needed_from(current) if queue is not None and current is not None else set()
    pool.item_begins({topology for topology, _ in needed})


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """At the end of a group, stop its topology, unless a later item of its xdist group needs
    it running (as its own, or as the exact reference of its topology): then it is stopped at
    the end of the first group after which nothing does. Where workers share devices, the
    baseline too, whichever group started it. Where a class (or module) ends, the variants
    its fixtures started with added environment, whatever their group."""
    config = item.config
    pool = config.stash.get(POOL_KEY, None)
    here = epd_group(item)
    if pool is None or here is None or nextitem is None:
        return  # at the very end the pool's fixture stops everything
    if declaring_scope(nextitem) != declaring_scope(item):
        pool.release_variants()  # a class's own instances (`TopologyPool.release_variants`)
    after = epd_group(nextitem)
    if after is not None and after.instances == here.instances:
        return
    share_devices = pool.settings.workers_share_devices
    if here.topology == "baseline" and not share_devices:
        return  # small; stopped when memory is needed, and fuzzing or load may still use it
    # Where workers share devices, a baseline kept up would keep the others' calibrations off
    # its device for this worker's whole session (found in review).
    queue = config.stash.get(E2E_QUEUE_KEY, None)
    needed = queue.needed_after(item.nodeid) if queue is not None else set()
    kept = config.stash.setdefault(KEPT_FOR_LATER_KEY, set())
    for instances in sorted({here.instances} | kept):
        if instances in needed:
            # A sweep made later (scenarios/test_vllm_proxy.py's, at its module's first item)
            # judges its topology against this one: the pool's before-stop hook serves only
            # the sweeps that exist, so stopped now it would start again there (found in
            # review: 1P+1D twice on the GPU nightly).
            kept.add(instances)
            continue
        kept.discard(instances)
        pool.release(instances[0])
    if share_devices and not (after is not None and after.topology == "baseline"):
        # Not only the baseline group's worker serves it: the first worker to judge anything
        # computes it (`Sweep.serve_baseline`, under the cache's lock), whatever group it holds.
        # Its group's end is where it is no longer needed here (found in review).
        if any(key.topology == "baseline" for key in pool.running()):
            pool.release("baseline")


def declaring_scope(item: pytest.Item) -> str:
    """The node id of the class that declares `item`, else of its module: the items that can
    share a variant of a topology that the class's own fixture starts."""
    parent = item.getparent(pytest.Class) or item.getparent(pytest.Module)
    return parent.nodeid if parent is not None else item.nodeid
