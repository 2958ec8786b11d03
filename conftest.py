"""pytest options, and the plugin with the session-wide fixtures (harness.testing.plugin).

The e2e scenarios start real vLLM. They are never skipped for lack of vLLM: in an environment
without it they fail and say so (deselect them with `-m "not e2e"` instead). The baseline is
computed once per session and each topology is started once, because a start costs tens of
seconds on CPU.
"""

from __future__ import annotations

import os

import pytest

from harness.testing.vllm_source import ENV as VLLM_SOURCE_ENV

# The scenarios' fixtures and the test helpers; the repository's test tiers (every test module
# declares one, checked); pytest's own pytester, for the tiers' tests.
pytest_plugins = ["harness.testing.plugin", "harness.testing.tiers", "pytester"]


# The parser `pytest_addoption` receives is the session's own: pytest's options and every
# plugin's go into it (the hook is historic, so a plugin registered later adds to it too).
# tests/test_docs_commands.py parses the docs' pytest command lines with it; pytest.Config
# holds it only as the private `_parser`.
_session_parser: list[pytest.Parser] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    if not _session_parser:  # the outer session's, not a pytester run's inside it
        _session_parser.append(parser)
    group = parser.getgroup("epd-harness")
    group.addoption("--epd-model", help="model directory (default: the tiny model, built once)")
    group.addoption("--epd-run-dir", help="artifact directory (default: runs/pytest-<time>)")
    group.addoption("--epd-vllm", help="vllm executable (default: beside this Python)")
    group.addoption(
        "--epd-baseline-cache",
        help="baseline cache directory (default: ~/.cache/epd-harness/baseline; 'off' disables)",
    )
    group.addoption(
        "--epd-refresh-baseline", action="store_true", help="recompute and overwrite the baseline"
    )
    group.addoption("--epd-platform", default="cpu", help="cpu (default), cuda or xpu")
    group.addoption(
        "--epd-devices",
        help="devices this session may use: GPU ids on cuda/xpu, cores on cpu (default: 0,1); "
        "pytest-xdist workers run each topology on the devices `epd-harness plan` gives it",
    )
    group.addoption("--epd-colocate", action="store_true", help="let instances share a device")
    group.addoption(
        "--epd-allow-untested-vllm",
        action="store_true",
        help="run a vLLM outside the tested series (the version gate applies to pytest too)",
    )
    group.addoption(
        "--epd-kv-connector",
        help="KV connector between P and D: example (cpu default) or nixl (GPU default); "
        "see docs/connectors.md",
    )
    group.addoption(
        "--epd-ec-connector",
        help="EC connector between E and its consumer: example (the only one that runs; "
        "cpu and mooncake are refused with their cause); see docs/connectors.md",
    )
    group.addoption(
        "--epd-proxy",
        default="harness",
        help="the EPD proxy under test: harness (default) or vllm (the served release's own, "
        "fetched from its sdist; docs/proxies.md)",
    )
    group.addoption(
        "--epd-vllm-source",
        default=os.environ.get(VLLM_SOURCE_ENV) or None,
        help="the vLLM source tree the served vLLM was built from: its own proxy, toy proxy and "
        "correctness script (scenarios/test_vllm_proxy.py, tests/test_upstream_parity.py); "
        "required for a development build, else the release's sdist is fetched; refused where no "
        f"selected test reads it. Default ${VLLM_SOURCE_ENV}: a job's setting (the nightly's on "
        "a commit), never refused",
    )
    group.addoption(
        "--epd-no-enforce-eager",
        action="store_true",
        help="GPU: let vLLM compile and capture graphs (default: --enforce-eager, as upstream)",
    )
    group.addoption(
        "--epd-dtype",
        help="every instance's --dtype: bfloat16 (default), float16 (a GPU below compute "
        "capability 8.0: T4, V100) or float32",
    )
    # No default: given, it is checked as `run --proxy-registration` is (refused without
    # --epd-proxy vllm, `static` too); not given, vLLM's proxy is static.
    group.addoption(
        "--epd-proxy-registration",
        help="with --epd-proxy vllm: static (default: URLs on its command line) or dynamic "
        "(registered through its admin API)",
    )
    group.addoption(
        "--epd-launcher",
        default="local",
        help="where instances run: local (default) or ray (Ray actors on a cluster's nodes; "
        "docs/multi-node.md)",
    )
    group.addoption(
        "--epd-ray-address",
        help="with --epd-launcher ray: the cluster's HOST:PORT (default: a one-host cluster "
        "of three nodes, started for the session and stopped after it)",
    )
    group.addoption(
        "--epd-reference-policy",
        help="exact (cpu default) or pd-drift (GPU default): how each topology is judged "
        "against its references (harness/judge/policy.py)",
    )
    group.addoption(
        "--epd-stream",
        action="store_true",
        help="send the EPD topologies streamed requests (stream: true, with usage; ids read "
        "from the stream, framing checked), the load scenarios' loads too; the baseline "
        "answers unstreamed",
    )
    group.addoption(
        "--epd-topology",
        help="comma list: run only scenarios of these topologies (names contain '+', so -k "
        "cannot select them)",
    )


@pytest.fixture(scope="session")
def session_option_parser() -> pytest.Parser:
    """What `pytest ARGS` parses ARGS with here: conftest.py's options, pytest's own and its
    plugins' (`parse_known_and_unknown_args`, `getgroup`: pytest.Parser's public methods)."""
    (parser,) = _session_parser
    return parser


@pytest.fixture
def pytester(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pytestconfig: pytest.Config
) -> pytest.Pytester:
    """pytest's own pytester, its sessions without the plugins pyproject.toml's addopts leave
    out (their ini is their own, so they loaded them). Pytester puts sys.modules back after
    each in-process run, so Hypothesis's plugin was imported afresh in the next one and warned
    (HypothesisSideeffectWarning, one per CI worker in the summary) about the strategies this
    process's fuzz tests had drawn since."""
    addopts = pytestconfig.getini("addopts")
    left_out = [
        f"-p {value}"
        for flag, value in zip(addopts, addopts[1:])
        if flag == "-p" and value.startswith("no:")
    ]
    monkeypatch.setenv("PYTEST_ADDOPTS", " ".join(left_out))
    return pytester
