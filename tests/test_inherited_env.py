"""The variables an instance inherits from the harness's environment that can change what it
computes (`harness.spec.inherited_env.numerics_env`: VLLM_ATTENTION_BACKEND,
VLLM_CPU_OMP_THREADS_BIND, ...) are part of how it ran: they key the baseline cache, so they
are recorded in each instance's `.cmd.json` too (redacted as the rest of it is), for an
export to carry them upstream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.redact import REDACTED
from harness.serve.session import TopologySession
from harness.spec.topology import TOPOLOGIES
from harness.testing.fake_vllm import fake_run_settings, install_fake_vllm

pytestmark = pytest.mark.process

SECRET = "s3cr3t-inherited-value"


def test_the_numerics_variables_an_instance_inherits_are_recorded_secrets_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a run whose shell set VLLM_CPU_OMP_THREADS_BIND or
    VLLM_ATTENTION_BACKEND served every instance with it (launch: {**os.environ, **env}), but
    `.cmd.json` held only the rendered additions, so `export` re-ran the case without them."""
    monkeypatch.setenv("EPD_HARNESS_PORT_DIR", str(tmp_path / "port-locks"))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TORCH_SDPA")
    monkeypatch.setenv("VLLM_ACCESSKEY", SECRET)  # the rule keeps it; a secret by its name
    monkeypatch.setenv("EPD_UNRELATED_SETTING", "x")  # no numerics prefix: not recorded
    fake = install_fake_vllm(tmp_path / "bin")
    settings = fake_run_settings(tmp_path, fake)
    with TopologySession(TOPOLOGIES["1P+1D"], settings) as session:
        pass
    paths = sorted(session.dir.glob("*.cmd.json"))
    commands = [json.loads(p.read_text()) for p in paths if "vllm-proxy" not in p.name]
    assert len(commands) == 2
    for command in commands:
        inherited = command.get("inherited_env", {})
        assert inherited.get("VLLM_CPU_OMP_THREADS_BIND") == "0-1", command
        assert inherited.get("VLLM_ATTENTION_BACKEND") == "TORCH_SDPA", command
        assert inherited.get("VLLM_ACCESSKEY") == REDACTED, command
        assert "EPD_UNRELATED_SETTING" not in inherited
    for path in paths:
        assert SECRET not in path.read_text(), path
