"""What the session's pool does as a topology is about to stop (`TopologyPool.before_stop`), so
that nothing has to start it again later: the batch calibrations of the loads still to come,
while the baseline serves, and a scenario module's later sweeps, while the exact reference
they are judged against serves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from harness.testing.groups import CURRENT_ITEM_KEY, E2E_QUEUE_KEY, epd_group

# A scenario module whose session-scoped sweeps judge a topology against its exact reference
# names here the function that makes them, `(config, epd_sweep, epd_events) -> sweeps`: the
# plugin makes them when the reference is about to stop, if nothing has yet (`later_sweeps`).
LATER_SWEEPS = "EPD_LATER_SWEEPS"
# module name -> (its LATER_SWEEPS function, the references its selected items are judged
# against); module name -> what that function made (or raised), once per session.
LATER_SWEEP_MAKERS_KEY = pytest.StashKey[dict]()
LATER_SWEEPS_KEY = pytest.StashKey[dict]()
# Node id -> the LoadSpec of every selected item marked `epd_load(spec)`.
LOAD_SPECS_KEY = pytest.StashKey[dict]()


def marked_load(item: pytest.Item) -> Any:
    """The LoadSpec of the item's `epd_load(spec)` mark, None without one; a mark without one
    LoadSpec is a usage error."""
    from harness.spec.load import LoadSpec

    marker = item.get_closest_marker("epd_load")
    if marker is None:
        return None
    spec = marker.args[0] if len(marker.args) == 1 and not marker.kwargs else None
    if not isinstance(spec, LoadSpec):
        raise pytest.UsageError(f"{item.nodeid}: epd_load takes one LoadSpec")
    return spec


def load_specs(items: list[pytest.Item]) -> dict[str, Any]:
    """The LoadSpec of each item marked `epd_load(spec)`, by node id; a mark without one, or
    whose topology is not the item's, is a usage error (its calibration would be of another
    load's requests, or of none), and so is an item that takes `epd_load_spec` unmarked."""
    specs = {}
    for item in items:
        spec = marked_load(item)
        if spec is None:
            if "epd_load_spec" in getattr(item, "fixturenames", ()):
                raise pytest.UsageError(
                    f"{item.nodeid}: it takes epd_load_spec, so it must be marked "
                    "epd_load(LoadSpec(...)): the mark is where its load is named"
                )
            continue
        group = epd_group(item)
        if group is None or group.topology != spec.topology:
            raise pytest.UsageError(
                f"{item.nodeid}: epd_load's load runs on {spec.topology}, the item on "
                f"{group.topology if group else 'no topology (not e2e)'}"
            )
        specs[item.nodeid] = spec
    return specs


def loads_to_come(config: pytest.Config, workers: int) -> list[Any]:
    """The LoadSpecs of the selected loads from the item running now on, in the order they
    run. Under several xdist workers only its xdist group's: which groups a worker gets next
    is not known here, and another worker's loads are measured in its own process."""
    queue = config.stash.get(E2E_QUEUE_KEY, None)
    specs = config.stash.get(LOAD_SPECS_KEY, {})
    current = config.stash.get(CURRENT_ITEM_KEY, None)
    if queue is None or current is None or not specs:
        return []
    return [specs[node] for node in queue.from_item(current, workers > 1) if node in specs]


def calibrate_loads_before(config: pytest.Config, sweep) -> Callable:
    """The pool's before-stop callback that, as the session's baseline is about to stop,
    measures the batch calibrations of the loads still to come (`calibrate_ahead`), so that
    none serves the baseline again for its own. Where every device the baseline could take is
    a topology's (2 GPUs, 1), each load stopped its topology to serve the baseline, then
    started the topology again: on the GitHub nightly's small rows 1E+1P+1D six times and the
    baseline eight (seen with the fake vLLM). A calibration that fails here is left to its
    load to measure (and fail there, where it is judged); the stop goes on."""

    def before_stop(session) -> None:
        if (
            not session.topology.is_baseline
            or session.settings.serving != sweep.settings.serving
            or session.settings.launcher != sweep.settings.launcher
        ):
            return
        specs = loads_to_come(config, sweep.settings.workers)
        if not specs:
            return
        from harness.run.load.calibration import calibrate_ahead

        try:
            calibrate_ahead(specs, sweep.baseline, sweep.settings.serving, session, say=print)
        except Exception as exc:  # noqa: BLE001 - each load measures its own instead
            print(f"[load] calibrating ahead of the loads failed ({exc}); each measures its own")

    return before_stop


def later_sweep_makers(items: list[pytest.Item]) -> dict[str, tuple[Callable, frozenset]]:
    """Each selected module's `EPD_LATER_SWEEPS`, with the exact references its items'
    topologies are judged against (those at whose stop its sweeps must exist)."""
    from harness.spec.topology import TOPOLOGIES

    references: dict[str, set[str]] = {}
    makers: dict[str, Callable] = {}
    for item in items:
        module = getattr(item, "module", None)
        maker = getattr(module, LATER_SWEEPS, None)
        group = epd_group(item)
        if module is None or maker is None or group is None:
            continue
        makers[module.__name__] = maker
        topology = TOPOLOGIES.get(group.topology)
        if topology is not None and topology.exact_reference:
            references.setdefault(module.__name__, set()).add(topology.exact_reference)
    return {name: (maker, frozenset(references.get(name, ()))) for name, maker in makers.items()}


def later_sweeps(config: pytest.Config, module_name: str, epd_sweep, epd_events) -> Any:
    """What the module's `EPD_LATER_SWEEPS` made, made now if nothing has yet; what making
    them raised is raised again, to the module's own items."""
    made = config.stash.setdefault(LATER_SWEEPS_KEY, {})
    if module_name not in made:
        maker, _ = config.stash.get(LATER_SWEEP_MAKERS_KEY, {})[module_name]
        made[module_name] = maker(config, epd_sweep, epd_events)
    if isinstance(made[module_name], BaseException):
        raise made[module_name]
    return made[module_name]


def make_later_sweeps_before(config: pytest.Config, epd_sweep, epd_events) -> Callable:
    """The pool's before-stop callback that makes a module's later sweeps when a reference
    they need is about to stop, so that they answer their prompts on it now. Made at their
    module's first item, they came too late where the reference and its topology cannot serve
    side by side (GPUs up to 5): 1E+1P+1D's first start had stopped 1P+1D, and vLLM's proxy
    module started 1P+1D again, then 1E+1P+1D again (seen with the fake vLLM on 2 and 4
    devices). What making them raises is kept for their own items (`later_sweeps`)."""

    def before_stop(session) -> None:
        made = config.stash.setdefault(LATER_SWEEPS_KEY, {})
        for name, (maker, references) in config.stash.get(LATER_SWEEP_MAKERS_KEY, {}).items():
            if name in made or session.topology.name not in references:
                continue
            try:
                made[name] = maker(config, epd_sweep, epd_events)
            except (Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - raised to its items
                made[name] = exc

    return before_stop
