"""Upstream parity's rules (harness/preflight/upstream_parity.py, the deliberate differences in
harness/spec/upstream_differences.py, shown in docs/upstream-parity.md), on small scripts
written here in the form of vLLM's run_epd_correctness_test.sh. The real scripts, read from
each release's sdist, are compared in tests/test_upstream_parity.py (the `index` tier).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from harness.preflight.shell_script import ScriptError
from harness.preflight.upstream_parity import compare, harness_launches
from harness.spec.generations import NEWEST, generation_for
from harness.spec.platforms import CUDA
from harness.spec.topology import TOPOLOGIES, Role, Topology
from harness.spec.upstream_differences import DIFFERENCES, PROXY_ROLES, SERVE_ROLES, Kind
from harness.spec.upstream_differences import render_markdown as render_table

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "upstream-parity.md"
UPDATE_DOC_ENV = "EPD_UPDATE_DOCS"
TABLE_START = "<!-- the table: harness.spec.upstream_differences.render_markdown -->\n"
TABLE_END = "<!-- end of the table -->"

# A script in the form of upstream's (its flags for the baseline and 1E+1PD), written here.
SMALL = """\
#!/bin/bash
MODEL="${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}"
GPU_E="${GPU_E:-0}"
GPU_PD="${GPU_PD:-1}"
STORE="${STORE:-/tmp/ec}"
serve_baseline() {
    env "$DEVICE_AFFINITY_ENV=$GPU_PD" vllm serve "$MODEL" --port 10001 --max-model-len 10240 \\
        --enforce-eager --gpu-memory-utilization 0.9 --max-num-seqs 128 &
}
serve_e_pd() {
    env "$DEVICE_AFFINITY_ENV=$GPU_E" vllm serve "$MODEL" --port 19534 --max-model-len 10240 \\
        --enforce-eager --gpu-memory-utilization 0.01 --enable-request-id-headers \\
        --no-enable-prefix-caching --max-num-batched-tokens 114688 --max-num-seqs 128 \\
        --ec-transfer-config '{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
            "ec_connector_extra_config": {"shared_storage_path": "'"$STORE"'"}}' &
    env "$DEVICE_AFFINITY_ENV=$GPU_PD" vllm serve "$MODEL" --port 19537 --max-model-len 10240 \\
        --enforce-eager --enable-mm-embeds --gpu-memory-utilization 0.7 \\
        --enable-request-id-headers --max-num-seqs 128 \\
        --ec-transfer-config '{"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"shared_storage_path": "'"$STORE"'"}}' &
    python "${GIT_ROOT}/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py" \\
        --host 0.0.0.0 --port 10001 --encode-servers-urls "http://localhost:19534" \\
        --prefill-servers-urls disable --decode-servers-urls "http://localhost:19537" &
}
serve_baseline
serve_e_pd
"""


def planted(script: str, after: str, line: str) -> str:
    """`script` with `line` (a continued flag line) inserted after the first line ending in
    `after`."""
    lines = script.splitlines(keepends=True)
    index = next(i for i, text in enumerate(lines) if text.rstrip().endswith(after))
    indent = re.match(r"\s*", lines[index + 1]).group(0)
    return "".join([*lines[: index + 1], f"{indent}{line} \\\n", *lines[index + 1 :]])


# --- unit: the comparison ----------------------------------------------------------------------


def test_a_script_in_upstreams_form_shows_only_deliberate_differences() -> None:
    parity = compare(SMALL, NEWEST, CUDA)
    assert parity.report() == []
    assert sorted(parity.compared) == [
        "1E+1PD/encoder",
        "1E+1PD/epd-proxy",
        "1E+1PD/pd",
        "baseline/baseline",
    ]
    explained = {(f.instance, f.item) for f in parity.findings}
    assert ("1E+1PD/pd", "--enable-mm-embeds") in explained, "0.30+: vLLM turns it on itself"
    assert ("1E+1PD/encoder", "--gpu-memory-utilization") not in explained, "upstream's share"
    assert ("baseline/baseline", "--enforce-eager") not in explained


def test_a_difference_declared_for_some_releases_excuses_nothing_on_the_others() -> None:
    """--enable-mm-embeds upstream passes and the harness leaves out is deliberate only where
    vLLM turns it on itself (0.30 on): on an ec-items release (0.29) the same difference
    would start consumers that refuse metadata-only parts, and must be a finding there."""
    (entry,) = [
        d for d in DIFFERENCES if d.item == "--enable-mm-embeds" and d.kind is Kind.UPSTREAM_ONLY
    ]
    assert entry.applies_to("1E+1PD/pd", "by-hash")
    assert not entry.applies_to("1E+1PD/pd", "ec-items")
    assert not entry.applies_to("1E+1PD/encoder", "by-hash")


def test_a_planted_flag_fails_naming_the_instance_and_the_flag() -> None:
    script = planted(
        SMALL, "--gpu-memory-utilization 0.01 --enable-request-id-headers \\", "--x-new"
    )
    assert compare(script, NEWEST, CUDA).report() == [
        "1E+1PD/encoder: --x-new is set upstream (line 11), absent in the harness"
    ]


def test_a_changed_value_or_environment_fails_naming_the_item() -> None:
    script = SMALL.replace("--gpu-memory-utilization 0.7", "--gpu-memory-utilization 0.5")
    script = script.replace(
        'env "$DEVICE_AFFINITY_ENV=$GPU_PD" vllm',
        'env "$DEVICE_AFFINITY_ENV=$GPU_PD" UCX_TLS=all vllm',
        1,
    )
    assert compare(script, NEWEST, CUDA).report() == [
        "baseline/baseline: env UCX_TLS is 'all' upstream (line 7), absent in the harness",
        "1E+1PD/pd: --gpu-memory-utilization is '0.5' upstream (line 16), '0.7' in the harness",
    ]


def test_a_proxy_lines_environment_is_compared_as_a_servers_is() -> None:
    """An environment variable upstream gives its proxy is an item like a server's; the proxy
    lines were read as interpreter and flags only, and parity stayed green."""
    proxy = (
        '    python "${GIT_ROOT}/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"'
    )
    line = next(i for i, text in enumerate(SMALL.splitlines(), 1) if text.startswith(proxy))
    script = SMALL.replace(proxy, "    UCX_TLS=all " + proxy.lstrip())
    assert compare(script, NEWEST, CUDA).report() == [
        f"1E+1PD/epd-proxy: env UCX_TLS is 'all' upstream (line {line}), absent in the harness"
    ]


def test_an_exported_variable_is_every_later_lines_environment() -> None:
    """An `export` upstream adds (a backend, a UCX setting) reaches every server it starts,
    as an `env` prefix does; read as a mere assignment, parity stayed green without it."""
    script = SMALL.replace(
        'STORE="${STORE:-/tmp/ec}"\n', 'STORE="${STORE:-/tmp/ec}"\nexport UCX_TLS=all\n'
    )
    assert compare(script, NEWEST, CUDA).report() == [
        f"{instance}: env UCX_TLS is 'all' upstream (line {line}), absent in the harness"
        for instance, line in (
            ("baseline/baseline", 8),
            ("1E+1PD/encoder", 12),
            ("1E+1PD/epd-proxy", 22),
            ("1E+1PD/pd", 17),
        )
    ]


TOY_STAGE = """
serve_p_d() {
    env "$DEVICE_AFFINITY_ENV=1" VLLM_NIXL_SIDE_CHANNEL_PORT=5559 vllm serve "$MODEL" \\
        --port 19535 --max-model-len 10240 --enforce-eager --gpu-memory-utilization 0.7 \\
        --enable-request-id-headers --max-num-seqs 128 \\
        --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}' &
    env "$DEVICE_AFFINITY_ENV=2" VLLM_NIXL_SIDE_CHANNEL_PORT=6000 vllm serve "$MODEL" \\
        --port 19536 --max-model-len 10240 --enforce-eager --gpu-memory-utilization 0.7 \\
        --enable-request-id-headers --max-num-seqs 128 \\
        --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}' &
    python "${GIT_ROOT}/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py" \\
        --host 0.0.0.0 --port 10001 --prefiller-ports 19535 --decoder-ports 19536 &
}
serve_p_d
"""


def test_a_proxy_given_another_roles_instance_fails_naming_the_flag() -> None:
    """The proxy's URLs (ports) differ by design (the taps'), so each is also compared as the
    role of the instance it reaches: upstream's proxy handed the encoder's URL as the decode
    server, and the PD's as the encoder, left parity green."""
    with_toy = SMALL + TOY_STAGE
    assert compare(with_toy, NEWEST, CUDA).report() == []
    line = next(i for i, text in enumerate(SMALL.splitlines(), 1) if "disagg_epd_proxy" in text)
    swapped = with_toy.replace('"http://localhost:19534"', '"http://localhost:X"')
    swapped = swapped.replace('"http://localhost:19537"', '"http://localhost:19534"')
    swapped = swapped.replace('"http://localhost:X"', '"http://localhost:19537"')
    swapped = swapped.replace("--decoder-ports 19536", "--decoder-ports 19535")
    toy_line = len(SMALL.splitlines()) + 11
    assert compare(swapped, NEWEST, CUDA).report() == [
        f"1E+1PD/epd-proxy: --decode-servers-urls role is 'encoder' upstream (line {line}), "
        "'pd' in the harness",
        f"1E+1PD/epd-proxy: --encode-servers-urls role is 'pd' upstream (line {line}), "
        "'encoder' in the harness",
        f"1P+1D/toy-proxy: --decoder-ports role is 'prefill' upstream (line {toy_line}), "
        "'decode' in the harness",
    ]


def test_a_proxy_url_with_a_trailing_slash_reaches_the_instance_at_its_port() -> None:
    """A URL ending in a slash, "http://localhost:19534/", is the encoder at 19534: read as
    port "19534/", it reached no instance, a finding parity invented."""
    slashed = SMALL.replace('"http://localhost:19534"', '"http://localhost:19534/"')
    slashed = slashed.replace('"http://localhost:19537"', '"http://localhost:19537/"')
    assert slashed.count('/"') == 2
    parity = compare(slashed, NEWEST, CUDA)
    assert parity.report() == []
    roles = {f.item for f in parity.findings if f.item.endswith(" role")}
    assert roles == set(), "each URL reaches the role the harness's does"


def test_a_repeated_json_flag_is_read_as_vllm_takes_it_the_last_one() -> None:
    """vLLM's argparse keeps the last of two --ec-transfer-config: the keys of the first are
    gone. Merged key by key, the PD line still read as an EC consumer and parity stayed green
    for an instance vLLM starts with no EC role at all."""
    # The PD's config split in two: its role in the first, its storage in the second.
    assert SMALL.count('"ec_role": "ec_consumer",') == 1
    script = SMALL.replace(
        '"ec_role": "ec_consumer",',
        '"ec_role": "ec_consumer"}\' \\\n'
        '        --ec-transfer-config \'{"ec_connector": "ECExampleConnector",',
    )
    assert compare(script, NEWEST, CUDA).report() == [
        "stage serve_e_pd launches encoder, baseline, epd-proxy: no harness topology has these "
        "roles"
    ]


def test_a_repeated_flag_is_a_finding_of_its_own() -> None:
    """A flag given twice on one line is compared as such: for an append option (vLLM's
    --middleware) vLLM keeps every value, so the last one alone is not what it runs."""
    script = planted(
        SMALL, "--enable-request-id-headers --max-num-seqs 128 \\", "--max-num-seqs 128"
    )
    assert compare(script, NEWEST, CUDA).report() == [
        "1E+1PD/pd: --max-num-seqs repeated is '2 times' upstream (line 16), absent in the harness"
    ]


def test_a_proxy_flag_is_compared_as_spelled_unlike_a_vllm_serve_flag() -> None:
    """`vllm serve` takes --max_num_seqs for --max-num-seqs (vLLM's parser), a proxy's plain
    argparse does not: upstream's proxy taking --encode_servers_urls would refuse the harness's
    --encode-servers-urls, yet both read as one flag and parity stayed green."""
    serve = SMALL.replace(
        "--max-num-seqs 128 \\\n        --ec-transfer-config",
        "--max_num_seqs 128 \\\n        --ec-transfer-config",
    )
    assert serve != SMALL
    assert compare(serve, NEWEST, CUDA).report() == []
    line = next(i for i, text in enumerate(SMALL.splitlines(), 1) if "disagg_epd_proxy" in text)
    proxy = SMALL.replace("--encode-servers-urls", "--encode_servers_urls")
    assert compare(proxy, NEWEST, CUDA).report() == [
        f"1E+1PD/epd-proxy: --encode-servers-urls is absent upstream (line {line}), "
        "'http://127.0.0.1:30002' in the harness",
        f"1E+1PD/epd-proxy: --encode-servers-urls role is absent upstream (line {line}), "
        "'encoder' in the harness",
        f"1E+1PD/epd-proxy: --encode_servers_urls is 'http://localhost:19534' upstream "
        f"(line {line}), absent in the harness",
    ]


def test_the_compared_proxy_line_is_the_one_the_session_starts() -> None:
    """Parity's own proxy line must come from the session's wiring (`routes_for`), which sends
    decode work to the decode instances and to PD ones only when there are none; it built its
    own, handing the proxy every decode and PD instance: a line the harness never runs."""
    roles = (Role.ENCODER, Role.PREFILL, Role.DECODE, Role.PREFILL_DECODE)
    topology = Topology("1E+1P+1D+1PD", roles)
    launches = {launch.instance: launch for launch in harness_launches(topology, NEWEST)}
    proxy = launches["1E+1P+1D+1PD/epd-proxy"].items
    assert proxy["--decode-servers-urls role"] == "decode"
    assert proxy["--encode-servers-urls role"] == "encoder"
    assert proxy["--prefill-servers-urls role"] == "prefill"


def test_an_allowed_difference_is_allowed_only_where_and_when_the_table_says() -> None:
    # Upstream-only --enable-mm-embeds is allowed on PD from 0.30 (vLLM turns it on itself);
    # for 0.29 the harness renders it too, so nothing differs there.
    older = generation_for("0.29.0", None).generation
    assert compare(SMALL, older, CUDA).report() == []
    # Harness-only --enable-mm-embeds on 1P+1D is allowed for 0.28 / 0.29 alone: the entry is
    # looked up for the generation compared, not for the newest one.
    older_toy = compare(SMALL + TOY_STAGE, older, CUDA)
    assert older_toy.report() == []
    assert {f.instance for f in older_toy.findings if f.item == "--enable-mm-embeds"} == {
        "1P+1D/prefill",
        "1P+1D/decode",
    }
    script = SMALL.replace(
        "--enforce-eager --gpu-memory-utilization 0.9",
        "--enforce-eager --enable-mm-embeds --gpu-memory-utilization 0.9",
    )
    assert compare(script, NEWEST, CUDA).report() == [
        "baseline/baseline: --enable-mm-embeds is set upstream (line 7), absent in the harness"
    ]


def test_stages_the_harness_cannot_match_are_problems_not_silence() -> None:
    two_encoders = SMALL.replace('"ec_role": "ec_consumer"', '"ec_role": "ec_producer"')
    report = compare(two_encoders, NEWEST, CUDA).report()
    assert report == [
        "stage serve_e_pd launches encoder, encoder, epd-proxy: no harness topology has these roles"
    ]
    without_proxy = "\n".join(
        line
        for line in SMALL.splitlines()
        if "disagg_epd_proxy" not in line
        and "--host 0.0.0.0" not in line
        and "--prefill-servers-urls disable" not in line
    )
    assert compare(without_proxy, NEWEST, CUDA).report() == [
        "1E+1PD/epd-proxy: only the harness launches it"
    ]
    assert compare("#!/bin/bash\necho nothing\n", NEWEST, CUDA).report() == [
        "the script launches no vllm serve at all"
    ]


def test_an_instance_a_stage_launches_twice_is_a_problem() -> None:
    """Two proxy lines in one stage: the second would replace the first in the comparison, so
    the repetition itself is reported."""
    proxy_start = next(i for i, t in enumerate(SMALL.splitlines()) if "disagg_epd_proxy" in t)
    proxy = "\n".join(SMALL.splitlines()[proxy_start : proxy_start + 3]) + "\n"
    script = SMALL.replace(proxy, proxy + proxy)
    assert script.count("disagg_epd_proxy") == 2
    assert compare(script, NEWEST, CUDA).report() == [
        f"1E+1PD/epd-proxy is launched twice (line {proxy_start + 4})"
    ]


def two_encoder_stage(first_encoder_flag: str = "") -> str:
    """SMALL with a second encoder (port 19538) in its 1E+1PD stage, which makes it 2E+1PD;
    `first_encoder_flag`, if given, planted on the first encoder's line."""
    start = SMALL.index('    env "$DEVICE_AFFINITY_ENV=$GPU_E"')
    end = SMALL.index('    env "$DEVICE_AFFINITY_ENV=$GPU_PD" vllm serve "$MODEL" --port 19537')
    encoder = SMALL[start:end]
    first = encoder.replace("--port 19534", f"--port 19534 {first_encoder_flag}".rstrip())
    script = SMALL.replace(encoder, first + encoder.replace("19534", "19538"))
    return script.replace(
        '--encode-servers-urls "http://localhost:19534"',
        '--encode-servers-urls "http://localhost:19534,http://localhost:19538"',
    )


def test_two_instances_of_one_role_are_each_compared_not_launched_twice() -> None:
    """A topology with two encoders launches two instances named "2E+1PD/encoder" on either
    side. Keyed by that name alone, the first upstream encoder was replaced by the second
    (never compared: a flag planted on it went unseen) and reported as "launched twice"."""
    line = next(i for i, text in enumerate(SMALL.splitlines(), 1) if "--port 19534" in text)
    parity = compare(two_encoder_stage("--x-new"), NEWEST, CUDA)
    assert [p for p in parity.report() if "encoder" in p] == [
        f"2E+1PD/encoder: --x-new is set upstream (line {line}), absent in the harness"
    ]
    assert parity.compared.count("2E+1PD/encoder") == 2
    ports = [f.upstream for f in parity.findings if f.instance == "2E+1PD/encoder"]
    assert {"19534", "19538"} <= set(ports), "each upstream encoder against one of the harness"


def test_a_proxy_upstream_launches_from_elsewhere_is_named_not_dropped() -> None:
    """A proxy line the harness does not know (a module run with -m, a moved file) is the
    finding itself: the report names what upstream launches and what the harness launches,
    never just "only the harness launches it" as if upstream had dropped its proxy."""
    proxy = (
        '    python "${GIT_ROOT}/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"'
    )
    assert proxy in SMALL
    line = next(i for i, text in enumerate(SMALL.splitlines(), 1) if text.startswith(proxy))
    ours = "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
    as_module = SMALL.replace(proxy, "    python -m vllm.distributed.ec_transfer.proxy.epd_proxy")
    assert compare(as_module, NEWEST, CUDA).report() == [
        f"1E+1PD/epd-proxy: upstream launches 'python -m vllm.distributed.ec_transfer.proxy."
        f"epd_proxy' (line {line}), a proxy the harness does not know; the harness launches "
        f"{ours}"
    ]
    moved = SMALL.replace("examples/disaggregated/", "examples/online_serving/")
    assert compare(moved, NEWEST, CUDA).report() == [
        "1E+1PD/epd-proxy: upstream launches 'python <vllm-source>/examples/online_serving/"
        f"disaggregated_encoder/disagg_epd_proxy.py' (line {line}), a proxy the harness does "
        f"not know; the harness launches {ours}"
    ]
    # --port=N is the same flag as --port N to argparse: such a line is a proxy all the same.
    assert "--port 10001 --encode-servers-urls" in SMALL
    as_module_port_equals = as_module.replace(
        "--port 10001 --encode-servers-urls", "--port=10001 --encode-servers-urls"
    )
    assert compare(as_module_port_equals, NEWEST, CUDA).report() == (
        compare(as_module, NEWEST, CUDA).report()
    )
    as_subcommand = SMALL.replace(proxy, "    vllm disagg-proxy")
    assert compare(as_subcommand, NEWEST, CUDA).report() == [
        f"1E+1PD/epd-proxy: upstream launches 'vllm disagg-proxy' (line {line}), a proxy the "
        f"harness does not know; the harness launches {ours}"
    ]
    # The correctness client is a python line too, and no proxy: it takes no --port.
    client = SMALL.replace(
        "serve_baseline\n",
        'serve_baseline\npython "${GIT_ROOT}/tests/v1/ec_connector/integration/'
        'test_epd_correctness.py" --service_url http://localhost:10001\n',
    )
    assert compare(client, NEWEST, CUDA).report() == []


def test_a_line_it_cannot_expand_is_an_error_never_a_guess() -> None:
    script = SMALL.replace("--port 19537", '--port "$(free_port)"')
    with pytest.raises(ScriptError, match=r"line 16: cannot expand --port"):
        compare(script, NEWEST, CUDA)


def test_an_argument_it_cannot_expand_is_an_error_too_not_an_item() -> None:
    """An array of common flags ("${COMMON[@]}", a form upstream's script already uses for its
    client) right after the model is no flag's value: it became an item named by the reader's
    placeholder ("positional \\x00?"), compared as if upstream had set it."""
    script = SMALL.replace(
        'vllm serve "$MODEL" --port 19537', 'vllm serve "$MODEL" "${COMMON[@]}" --port 19537'
    )
    assert script != SMALL
    with pytest.raises(ScriptError, match=r"line 16: cannot expand an argument"):
        compare(script, NEWEST, CUDA)


def test_unused_entries_are_reported_as_stale() -> None:
    parity = compare(SMALL, NEWEST, CUDA)
    stale = {(entry.item, entry.kind) for entry in parity.unused()}
    # The small script sets no --allowed-local-media-path and has no KV roles or proxies of
    # 1P+1D: entries for the instances it has, which explained nothing, are stale for it.
    assert ("--allowed-local-media-path", Kind.UPSTREAM_ONLY) in stale
    assert ("env VLLM_NIXL_SIDE_CHANNEL_PORT", Kind.VALUE) not in stale, "no KV role compared"
    assert parity.used, "the small script's deliberate differences explain findings"
    assert not parity.used & set(parity.unused()), (
        "an entry that explained a finding is no stale one"
    )


# --- unit: the table and its page -------------------------------------------------------------


def test_every_entry_names_known_places_generations_and_a_reason() -> None:
    from harness.spec.generations import GENERATIONS_BY_NAME

    roles = set(SERVE_ROLES) | set(PROXY_ROLES)
    for entry in DIFFERENCES:
        assert entry.reason.endswith("."), entry
        assert entry.where, entry
        for where in entry.where:
            topology, _, role = where.rpartition("/")
            assert role in roles, (entry.item, where)
            assert not topology or topology in TOPOLOGIES, (entry.item, where)
        assert set(entry.generations) <= set(GENERATIONS_BY_NAME), entry
    keys = [(e.item, e.kind, e.where, e.generations) for e in DIFFERENCES]
    assert len(keys) == len(set(keys)), "an entry is listed twice"


def test_the_docs_show_the_table_as_the_code_has_it() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert TABLE_START in text and TABLE_END in text, f"{DOC} lost its table markers"
    head, rest = text.split(TABLE_START, 1)
    shown, tail = rest.split(TABLE_END, 1)
    if os.environ.get(UPDATE_DOC_ENV) == "1":
        DOC.write_text(head + TABLE_START + render_table() + TABLE_END + tail, encoding="utf-8")
        return
    assert shown == render_table(), f"{DOC} is stale: run {UPDATE_DOC_ENV}=1 pytest {__file__}"
