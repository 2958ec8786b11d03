"""The baseline under a load's traffic: whether batching changes the baseline's own answers on
this platform is measured, not assumed, and the log-prob noise it shows is the tolerance the
drift rule gives batched answers (`harness.judge.policy`: a batched answer may DRIFT within that
floor, so where it is 0 every comparison stays exact). A calibration depends on the requests
and the concurrency only, not on the topology: measured once per baseline, it is every later
load's of the same (`BaselineAnswers.known_calibration`), and a pytest session measures its
loads' while its baseline serves (`calibrate_ahead`); the load's account says which."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from harness.run.baseline import BaselineAnswers, BatchCalibration
from harness.run.load.plan import plan_load
from harness.run.load.sessions import is_launched
from harness.run.sweep import Sweep
from harness.serve.session import TopologySession
from harness.spec.load import LoadSpec, PlannedRequest, load_mix
from harness.spec.topology import BASELINE, ServingConfig

log = logging.getLogger(__name__)


def calibrate_ahead(
    specs: Sequence[LoadSpec],
    baseline: BaselineAnswers,
    serving: ServingConfig,
    session: TopologySession,
    say: Callable[[str], None] = log.info,
) -> int:
    """The batch calibration each load of `specs` will need, measured now on the running
    baseline `session` unless one of the same requests at the same concurrency is known
    already; how many were measured. A calibration is the baseline's own behaviour under a
    load's traffic, whatever topology the load then serves: a pytest session computes its
    loads' calibrations while the baseline serves, before it stops. Where every device the
    baseline could take is a topology's (2 GPUs, 1), each load served it again for its own,
    stopping its topology and starting it again after. A load's prompts are its mix
    (`load_mix(spec.distinct_media)`), as its sweep's; one whose prompts the baseline has not
    answered is left to measure its own."""
    measured = 0
    for spec in specs:
        if spec.concurrency <= 1:
            continue
        prompts = [p.name for p in load_mix(spec.distinct_media) if p.name in baseline.bodies]
        if not prompts or any(p not in baseline.outcomes for p in prompts):
            continue
        regular = plan_load(spec, prompts, baseline, serving).regular
        requests = [(r.name, r.prompt) for r in regular]
        if baseline.known_calibration(requests, spec.concurrency) is not None:
            continue
        say(
            f"[load] ahead of a load on {spec.topology}: the baseline answers its "
            f"{len(requests)} requests at concurrency {spec.concurrency} before it stops"
        )
        baseline.calibrate_batched(
            session,
            requests,
            spec.concurrency,
            "ahead of the loads to come, while the baseline served before it stopped",
        )
        measured += 1
    return measured


def calibrate_load(
    sweep: Sweep,
    regular: list[PlannedRequest],
    concurrency: int,
    topology: str,
    keep_baseline: bool,
    say: Callable[[str], None],
) -> tuple[BatchCalibration, str]:
    """The calibration of a load of `regular` requests at `concurrency` on `topology`, and
    where it came from. Measured once per (requests, concurrency) on a baseline: a calibration
    measured earlier (for another load of the same requests, or ahead of this one while the
    baseline served: `calibrate_ahead`) is this load's too, and the baseline is not served
    again for it. `keep_baseline`: leave the baseline running after measuring (never where
    workers share devices)."""
    requests = [(r.name, r.prompt) for r in regular]
    known = sweep.baseline.known_calibration(requests, concurrency)
    if known is not None:
        source = (
            f"measured earlier in this session {known.measured_for} (the same "
            f"{len(requests)} requests at concurrency {concurrency}), not again"
        )
        say(f"[load] the baseline's batch numerics: {source}")
        return known, source
    baseline = sweep.pool.session(BASELINE)
    assert is_launched(baseline)
    say(
        f"[load] the baseline answers the {len(regular)} requests at concurrency "
        f"{concurrency}: does batching change its answers?"
    )
    calibration = sweep.baseline.calibrate_batched(
        baseline, requests, concurrency, f"for a load on {topology}"
    )
    # Kept up, the baseline would hold its device for this worker's whole session, and
    # every other worker's calibration would wait for it (found in review: the 8-GPU
    # night's loads run one after another).
    if not keep_baseline or sweep.settings.workers_share_devices:
        sweep.pool.release(BASELINE.name)
    return calibration, "measured now, for this load"
