"""Differential fuzzing on real vLLM (`epd-harness fuzz`, docs/fuzzing.md), run in-process.

A short seeded fuzz of 1E+1PD must find no new failure (every generated request MATCHes the
baseline, or fails exactly as a declaration says), and with a planted fault that only a shape
of request triggers (two distinct images of one size: their EC files swap) the same budget must
find it and shrink it to that shape (two images, nothing else but a text).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli.main import EXIT_FAILED, EXIT_OK, main
from harness.spec.prompts import ImagePart

pytestmark = pytest.mark.e2e

CI_EXAMPLES = 20


def fuzz(run_dir: Path, *args: str) -> tuple[int, dict]:
    code = main(["fuzz", "--run-dir", str(run_dir), *args])
    return code, json.loads((run_dir / "fuzz.json").read_text())


@pytest.mark.ci
def test_a_seeded_fuzz_of_1e_1pd_finds_no_new_failure(epd_run_dir: Path, capsys) -> None:
    run_dir = epd_run_dir / "fuzz-1E+1PD"
    code, report = fuzz(run_dir, "--topology", "1E+1PD", "--examples", str(CI_EXAMPLES))
    out = capsys.readouterr().out
    assert report["examples_drawn"] == CI_EXAMPLES
    judged = [e for e in report["examples"] if e["status"] == "judged"]
    assert len(judged) >= CI_EXAMPLES // 2, report["counts"]
    assert any(e["layout"] and e["layout"]["runs"] for e in judged), "no media example judged"
    assert report["new_failures"] == 0 and code == EXIT_OK, out[-4000:]


def test_fuzzing_finds_and_shrinks_a_planted_shape_dependent_fault(epd_run_dir: Path) -> None:
    run_dir = epd_run_dir / "fuzz-planted"
    code, report = fuzz(
        run_dir, "--topology", "1E+1PD", "--examples", "40", "--plant-fault", "ec-swap-items"
    )
    assert code == EXIT_FAILED, report["counts"]
    (group,) = [g for g in report["groups"] if g["signature"]["verdict"] == "MISMATCH"]
    parts = group["minimal"]["parts"]
    images = [p for p in parts if p["kind"] == ImagePart.__name__]
    assert len(images) == 2 and len(parts) <= 3, parts
    assert images[0]["seed"] != images[1]["seed"], "identical images share one EC file"
