"""The EPD scenario matrix (declared in harness/run/scenarios.py, run by harness/run/matrix.py):
each scenario behaves exactly as declared.

Most scenarios must MATCH the baseline with every transfer guard holding. A scenario that
documents an upstream vLLM failure passes only while that failure looks exactly as described
(verdict and evidence), so a fix or a different failure is noticed.
"""

from __future__ import annotations

import pytest

from harness.report.text import format_failure
from harness.run.scenarios import MATRIX, matrix_prompts

EPD_BASELINE_PROMPTS = matrix_prompts()

pytestmark = pytest.mark.e2e


def scenario_params():
    for scenario in MATRIX:
        marks = [pytest.mark.ci] if scenario.ci else []
        yield pytest.param(scenario, marks=marks, id=scenario.name)


@pytest.mark.parametrize("scenario", list(scenario_params()))
def test_scenario_behaves_as_declared(epd_matrix, scenario) -> None:
    result = epd_matrix.run(scenario)
    assert result.records, f"{scenario.name}: no case was judged"
    problems = result.problems()
    details = "\n\n".join(format_failure(r) for r in result.records if r.verdict.value != "MATCH")
    assert not problems, "\n".join(problems) + ("\n\n" + details if details else "")
