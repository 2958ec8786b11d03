"""`TopologySession(role_env=...)`: environment additions reach the instances of one role only
(how the graded self-test gives D alone its NIXL KV-noise plugin), and are recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.serve.session import TopologySession
from harness.spec.topology import TOPOLOGIES, Role
from harness.testing.fake_vllm import fake_run_settings, install_fake_vllm

pytestmark = pytest.mark.process


def test_role_env_reaches_only_that_roles_process_and_its_command_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPD_HARNESS_PORT_DIR", str(tmp_path / "port-locks"))
    fake = install_fake_vllm(tmp_path / "bin")
    settings = fake_run_settings(tmp_path, fake)
    extra = {"EPD_TEST_ONLY_D": "yes"}
    with TopologySession(TOPOLOGIES["1P+1D"], settings, role_env={Role.DECODE: extra}) as session:
        environ = {}
        for server, spec in zip(session._servers, session.instances):
            raw = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
            environ[spec.role] = dict(e.decode().split("=", 1) for e in raw if b"=" in e)
    assert environ[Role.DECODE].get("EPD_TEST_ONLY_D") == "yes"
    assert "EPD_TEST_ONLY_D" not in environ[Role.PREFILL]
    commands = {path.name: json.loads(path.read_text()) for path in session.dir.glob("*.cmd.json")}
    recorded = {name: cmd["env"].get("EPD_TEST_ONLY_D") for name, cmd in commands.items()}
    assert sorted(recorded.values(), key=str) == [None, "yes"], recorded
