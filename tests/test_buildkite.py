"""The Buildkite step vLLM's CI would carry (ci/buildkite/epd_harness.yaml) and the script it runs
(ci/buildkite/nightly.sh), checked the way tests/test_workflows.py checks the GitHub workflows.

vLLM's pipeline generator (vllm-project/ci-infra, buildkite/pipeline_generator) reads every YAML
of .buildkite/test_areas/ into its `Step` model, maps `device` and `num_devices` to an agent
queue, runs a step's commands in the CI image after `cd working_dir`, turns every ' into " in
them, and `buildkite-agent pipeline upload` expands $VAR when the pipeline is uploaded. A step
that breaks any of that fails only on vLLM's agents; here it fails first.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from harness.cli.plan import DEFAULT_TOPOLOGY_NAMES, PlanRequest, build_plan
from harness.spec.platforms import CUDA
from harness.spec.topology import get_topology
from tests.test_workflows import find_tool

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parents[1]
STEP_FILE = ROOT / "ci" / "buildkite" / "epd_harness.yaml"
NIGHTLY = ROOT / "ci" / "buildkite" / "nightly.sh"
# The fields of ci-infra's test-area `Step` (buildkite/pipeline_generator/step.py) and of a
# test-area file; anything else is dropped by the generator without a word.
STEP_FIELDS = {
    "label",
    "group",
    "working_dir",
    "key",
    "depends_on",
    "commands",
    "device",
    "agent_tags",
    "num_devices",
    "num_nodes",
    "source_file_dependencies",
    "soft_fail",
    "parallelism",
    "timeout_in_minutes",
    "mount_buildkite_agent",
    "env",
    "retry",
    "optional",
    "no_plugin",
    "mirror",
}
FILE_FIELDS = {"group", "depends_on", "steps"}


def load() -> dict:
    return yaml.safe_load(STEP_FILE.read_text(encoding="utf-8"))


def only_step() -> dict:
    (step,) = load()["steps"]
    return step


def as_the_agent_runs(command: str) -> str:
    """A command after upload-time interpolation: $$ becomes $."""
    return command.replace("$$", "$")


def test_the_file_is_in_vllms_test_area_format() -> None:
    data = load()
    assert set(data) <= FILE_FIELDS, set(data) - FILE_FIELDS
    assert data["depends_on"] == ["image-build"], "the step runs in the image built for the commit"
    step = only_step()
    assert set(step) <= STEP_FIELDS, f"fields vLLM's generator ignores: {set(step) - STEP_FIELDS}"
    assert isinstance(step["label"], str) and re.fullmatch(r"[a-z0-9-]+", step["key"])
    assert all(isinstance(c, str) for c in step["commands"])
    assert all(isinstance(v, str) for v in step["env"].values()), "env values must be strings"
    assert step["working_dir"] == "/vllm-workspace"


def test_it_runs_nightly_on_enough_gpus_and_uploads_its_artifacts() -> None:
    step = only_step()
    assert step["optional"] is True, "nightly builds run it; others offer a block step"
    assert step["mount_buildkite_agent"] is True, "buildkite-agent inside the container"
    assert 60 <= step["timeout_in_minutes"] <= 480
    plan = build_plan(
        PlanRequest(
            platform=CUDA,
            devices=tuple(range(step["num_devices"])),
            topologies=tuple(get_topology(n) for n in DEFAULT_TOPOLOGY_NAMES),
            model="m",
        )
    )
    assert plan.waves, "every topology fits the step's GPUs without colocation"
    nightly = NIGHTLY.read_text(encoding="utf-8")
    assert "trap upload EXIT" in nightly
    assert 'buildkite-agent artifact upload "runs/**/*"' in nightly


def test_commands_survive_the_generator_and_the_upload_interpolation(tmp_path: Path) -> None:
    commands = only_step()["commands"]
    for command in commands:
        assert "'" not in command, f"vLLM's generator turns ' into \": {command}"
        assert not re.search(r"(?<!\$)\$(?!\$)", command.replace("$$", "")), (
            f"a single $ is expanded at pipeline upload, not on the agent: {command}"
        )
    script = tmp_path / "step.sh"
    script.write_text("#!/bin/sh\n" + "\n".join(as_the_agent_runs(c) for c in commands) + "\n")
    lint = subprocess.run(
        [find_tool("shellcheck"), "-s", "sh", str(script)], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout


def test_the_step_runs_the_nightly_script_with_the_images_own_vllm_tree() -> None:
    commands = [as_the_agent_runs(c) for c in only_step()["commands"]]
    assert any("git clone" in c and "${EPD_HARNESS_REPO}" in c for c in commands)
    assert commands[-1] == "bash /tmp/epd-harness/ci/buildkite/nightly.sh /vllm-workspace"
    nightly = NIGHTLY.read_text(encoding="utf-8")
    assert '--vllm-source "$vllm_tree"' in nightly, "the dev build's files are its tree's"
    assert '--epd-vllm-source "$vllm_tree"' in nightly
    assert "scripts/gpu_rehearsal.py" in nightly


def test_the_nightly_script_is_shellcheck_clean() -> None:
    lint = subprocess.run([find_tool("shellcheck"), str(NIGHTLY)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
