"""A bundle from a planted failure, replayed by `epd-harness repro`, gives the same verdict.

Runs the real CLI in-process: `run --plant-fault corrupt-ec` must exit 1 with a MISMATCH in its
summary, and `repro` on that bundle must start the topology again with the recorded flags,
body and fault, and report the verdict reproduced (exit 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli.main import EXIT_FAILED, EXIT_OK

# `run` and `repro` start topologies of their own: on the session's options and the devices
# its plan gives 1E+1PD's group (epd_own_instances).
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.epd_topology("1E+1PD"),
    pytest.mark.own_instances("run", "repro"),
]


def test_repro_of_a_planted_mismatch_reproduces_it(
    epd_run_dir: Path, epd_cli, epd_own_instances
) -> None:
    bundle = epd_run_dir / "planted-corrupt-ec"
    code, out, _ = epd_cli(
        "run", "--topology", "1E+1PD", "--prompt", "image", "--plant-fault", "corrupt-ec",
        "--run-dir", bundle, *epd_own_instances.args("run", topologies=("1E+1PD",)),
    )  # fmt: skip
    assert code == EXIT_FAILED, f"a planted EC corruption must fail the run:\n{out[-3000:]}"
    summary = json.loads((bundle / "summary.json").read_text())
    assert [c["verdict"] for c in summary["cases"]] == ["MISMATCH"], summary["cases"]
    assert json.loads((bundle / "run.json").read_text())["fault"] == "corrupt-ec"

    code, out, _ = epd_cli(
        "repro", bundle, "--run-dir", epd_run_dir / "planted-repro",
        *epd_own_instances.args("repro"),
    )  # fmt: skip
    assert code == EXIT_OK, f"repro did not reproduce the MISMATCH:\n{out[-3000:]}"
    assert "MISMATCH now, MISMATCH in the bundle: reproduced" in out
