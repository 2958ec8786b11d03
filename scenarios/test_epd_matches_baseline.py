"""Every EPD topology answers every prompt with the baseline's token ids, and really transferred.

One test per (topology, prompt). A case fails with its verdict, the first divergence (window
and top-k on both sides) and any failed transfer guard in the assertion message.
"""

from __future__ import annotations

import pytest

from harness.report.text import format_failure
from harness.spec.prompts import SKELETON_PROMPTS
from harness.spec.topology import EPD_TOPOLOGY_NAMES

pytestmark = pytest.mark.e2e

# What CI runs within its budget: the full E -> P -> D path, with an image and a video.
CI_CASES = {("1E+1P+1D", "image"), ("1E+1P+1D", "video")}


def case_params():
    for topology in EPD_TOPOLOGY_NAMES:
        for prompt in SKELETON_PROMPTS:
            marks = [pytest.mark.ci] if (topology, prompt.name) in CI_CASES else []
            yield pytest.param(topology, prompt.name, marks=marks, id=f"{topology}-{prompt.name}")


@pytest.mark.parametrize("topology,prompt", list(case_params()))
def test_topology_matches_references(epd_sweep, topology: str, prompt: str) -> None:
    records = epd_sweep.judge(topology, prompt)
    assert records, f"no comparison was made for {topology} / {prompt}"
    failures = [record for record in records if not record.policy_passed]
    # Each request had a cache salt of its own: a guard nothing could check leaves it unproven.
    failures += [r for r in records if r.policy_passed and r.unchecked_guards()]
    assert not failures, "\n\n".join(format_failure(record) for record in failures)
