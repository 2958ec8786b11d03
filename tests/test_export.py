"""The exporter's pure parts, on synthetic bundles (no vLLM, no server): what an export holds,
the commands it renders, what it refuses, its ISSUE.md, and check.py's comparison.

The exports that reproduce real vLLM failures are run in scenarios/test_export_repro.py (e2e);
serve.sh / run.sh / check.py as processes, on fake servers, in tests/test_export_process.py.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from export_bundle import (
    BASELINE_IDS,
    GRID,
    PROMPT,
    PROMPT_IDS,
    REPAIR,
    plan_for,
    write,
    write_bundle,
    write_exact_reference_bundle,
    write_model,
    write_scenario_bundle,
    write_upstream,
)

from harness.cli.main import main
from harness.errors import BadInput
from harness.judge.verdicts import STREAM_BROKEN, STREAM_CHECK
from harness.redact import REDACTED
from harness.run.export import files as files_module
from harness.run.export import standalone_check as check
from harness.run.export.files import render_serve_sh, write_export
from harness.run.export.issue import (
    ENVIRONMENT_KEYS,
    HEADLINE_CHARS,
    ISSUE_FIELDS,
    TITLE_PREFIX,
    broken_framing,
    condensed_error,
    error_headline,
    render_issue,
)
from harness.run.export.probe import NEVER_ENCODED_UUID, UNKNOWN_UUID_PROBE
from harness.run.export.reference import REFERENCE_FIRST_PORT
from harness.run.export.request import describe_request
from harness.run.export.servers import FIRST_PORT, template_storage
from harness.run.export.shell import Var, shell_word
from harness.serve.session import safe_name

pytestmark = pytest.mark.unit


# -- what goes in ------------------------------------------------------------------------------


def test_the_instances_come_in_role_order_with_their_recorded_flags(tmp_path: Path) -> None:
    plan = plan_for(write_bundle(tmp_path / "run"))
    assert [s.name for s in plan.servers] == ["encoder0", "prefill0", "decode0"]
    assert [s.port.name for s in plan.servers] == ["ENCODER0_PORT", "PREFILL0_PORT", "DECODE0_PORT"]
    assert len({s.default_port for s in (*plan.servers, plan.proxy)}) == 4
    decode = plan.servers[2]
    words = [shell_word(arg) for arg in decode.argv]
    assert words[:3] == ['"${VLLM}"', "serve", '"${MODEL}"']
    assert words[words.index("--port") + 1] == '"${DECODE0_PORT}"'
    assert words[words.index("--host") + 1] == '"${HOST}"'
    assert "--enable-prompt-tokens-details" in words and "--block-size" in words
    assert dict(decode.env)["OMP_NUM_THREADS"] == ("1",)


def test_a_bundle_missing_an_instances_command_is_refused_naming_the_count(
    tmp_path: Path,
) -> None:
    """1E+1P+1D with decode0's .cmd.json gone: serve.sh would start a topology without its D
    and check.py would wait on a port nothing serves. Refused in one line, with the count."""
    run = write_bundle(tmp_path / "run")
    [decode] = (run / safe_name("1E+1P+1D")).glob("*decode0.cmd.json")
    decode.unlink()
    with pytest.raises(BadInput, match="expected 3 instance commands of 1E\\+1P\\+1D .* found 2"):
        plan_for(run)


@pytest.mark.parametrize(
    "argv, cause",
    [
        (["python", "-m", "vllm.entrypoints.openai.api_server"], "not a 'vllm serve' command"),
        (
            ["vllm", "serve", "m", "--chat-template", REDACTED],
            "redacted argument after --chat-template",
        ),
    ],
)
def test_a_recorded_command_serve_sh_cannot_rerun_is_refused(argv: list[str], cause: str) -> None:
    """Only a `vllm serve` line is templated (its executable, model and port made variables);
    a redacted value of a flag serve.sh has no variable for would reach vLLM as the placeholder
    itself."""
    from harness.run.export.servers import template_argv

    with pytest.raises(BadInput, match=re.escape(cause)):
        template_argv(argv, "m", Var("DECODE0_PORT"))


def test_no_path_of_the_recording_machine_survives(tmp_path: Path) -> None:
    bundle_dir = write_bundle(tmp_path / "run")
    serve = render_serve_sh(plan_for(bundle_dir))
    assert str(tmp_path) not in serve
    assert "/somewhere/venv/bin/vllm" not in serve
    assert '"${WORK_JSON}"\'/storage/kv"' in serve and '"${WORK_JSON}"\'/storage/ec"' in serve


def test_storage_paths_become_work_variables_and_stay_json() -> None:
    arg = template_storage(
        '{"kv_connector": "ExampleConnector", "kv_connector_extra_config": '
        '{"shared_storage_path": "/run/1E-1P-1D/storage/kv"}, "kv_role": "kv_consumer"}'
    )
    assert Var("WORK_JSON") in arg
    rendered = "".join("/w" if isinstance(piece, Var) else piece for piece in arg)
    config = json.loads(rendered)
    assert config["kv_connector_extra_config"]["shared_storage_path"] == "/w/storage/kv"
    assert config["kv_role"] == "kv_consumer"


def test_vllms_own_proxy_is_shipped_with_its_sha256_and_pointed_at_the_instances(
    tmp_path: Path,
) -> None:
    out = write(tmp_path)
    shipped = out / "vllm-proxy/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
    upstream = tmp_path / "run-upstream" / shipped.relative_to(out / "vllm-proxy")
    assert shipped.read_bytes() == upstream.read_bytes()
    digest, name = (out / "vllm-proxy/SHA256SUMS").read_text().split()
    import hashlib

    assert digest == hashlib.sha256(shipped.read_bytes()).hexdigest()
    assert name == str(shipped.relative_to(out / "vllm-proxy"))
    serve = (out / "serve.sh").read_text()
    script = '"${PROXY_DIR}/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"'
    assert f'"${{PYTHON}}" {script} \\\n' in serve
    assert '--encode-servers-urls "http://${HOST}:${ENCODER0_PORT}"' in serve
    assert '--prefill-servers-urls "http://${HOST}:${PREFILL0_PORT}"' in serve
    assert '--decode-servers-urls "http://${HOST}:${DECODE0_PORT}"' in serve
    assert "harness" not in (out / "serve.sh").read_text().split("# Every variable")[1]
    # vLLM's file travels with its licence named, as Apache-2.0 asks of a redistributed copy.
    origin = (out / "vllm-proxy/ORIGIN").read_text()
    assert f"{name}: vLLM's own file, unmodified, from " in origin
    assert "Licensed under Apache-2.0" in origin


def test_p_d_gets_the_toy_proxy_with_hosts_and_ports(tmp_path: Path) -> None:
    plan = plan_for(write_bundle(tmp_path / "run", topology="1P+1D", verdict="MISMATCH"))
    assert plan.proxy_file is not None and plan.proxy_file.relative.endswith("toy_proxy_server.py")
    words = [shell_word(arg) for arg in plan.proxy.argv]
    assert words[words.index("--prefiller-ports") + 1] == '"${PREFILL0_PORT}"'
    assert words[words.index("--decoder-hosts") + 1] == '"${HOST}"'
    assert plan.proxy.health_path == "/healthcheck"


@pytest.mark.parametrize("topology", ["1P+1D", "1E+1PD"])
def test_vllms_proxy_in_serve_sh_bypasses_http_proxy_after_the_users_own_list(
    tmp_path: Path, topology: str
) -> None:
    """The toy proxy's httpx follows HTTP_PROXY with no bypass for loopback of its own: on a
    machine with HTTP_PROXY set, serve.sh's proxy relayed its calls to P and D there (found
    in review). The user's NO_PROXY is kept; `set -u` holds when it is unset."""
    out = tmp_path / "out"
    write_export(plan_for(write_bundle(tmp_path / "run", topology=topology)), out, REPAIR)
    serve = (out / "serve.sh").read_text()
    for name in ("NO_PROXY", "no_proxy"):
        assert f'{name}="${{{name}:+${{{name}}},}}127.0.0.1,localhost,${{HOST}}"' in serve


def test_a_proxy_file_without_licence_header_is_not_shipped(tmp_path: Path) -> None:
    upstream = write_upstream(tmp_path / "bare")
    proxy = upstream / "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
    proxy.write_text("print('no header')\n")
    with pytest.raises(BadInput, match="no licence header"):
        plan_for(write_bundle(tmp_path / "run", upstream=upstream))


def test_each_proxy_listens_on_its_own_port_variable_with_its_own_default(tmp_path: Path) -> None:
    """serve.sh waits for the proxy on ${PROXY_PORT} (the reference's on ${REF_PROXY_PORT}):
    the proxy must be told that port, not the renderer's placeholder or the case proxy's
    variable, or it listens where nothing looks (the reference's colliding with the case's)."""
    plan = plan_for(write_exact_reference_bundle(tmp_path / "run"))
    assert plan.proxy is not None and plan.reference is not None
    proxies = (plan.proxy, plan.reference.proxy)
    for proxy, variable in zip(proxies, ("PROXY_PORT", "REF_PROXY_PORT")):
        words = [shell_word(arg) for arg in proxy.argv]
        assert proxy.port == Var(variable)
        assert words[words.index("--port") + 1] == f'"${{{variable}}}"'
        assert str(proxy.default_port) not in words
    assert [p.default_port for p in proxies] == [FIRST_PORT, REFERENCE_FIRST_PORT]


def test_a_missing_proxy_file_is_refused_naming_it(tmp_path: Path) -> None:
    """The release's proxy file absent from the harness's copy: one refusal naming the file
    and where the copy came from, not a traceback from reading it."""
    upstream = write_upstream(tmp_path / "partial")
    proxy = upstream / "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
    proxy.unlink()
    with pytest.raises(BadInput, match=f"proxy file {re.escape(str(proxy))} is missing"):
        plan_for(write_bundle(tmp_path / "run", upstream=upstream))


def test_the_entry_is_the_proxy_and_only_a_probe_without_one_sends_to_an_instance(
    tmp_path: Path,
) -> None:
    """run.sh and check.py send the request to ENTRY: through vLLM's proxy when there is one
    (the case's and the reference's each their own), the probed consumer itself otherwise.
    Sent to the first instance, a case through the proxy would ask the encoder for text."""
    plan = plan_for(write_exact_reference_bundle(tmp_path / "run"))
    entries = re.findall(r"^ *ENTRY=(.*)$", render_serve_sh(plan), re.M)
    assert sorted(entries) == [
        '"http://${HOST}:${PROXY_PORT}"',
        '"http://${HOST}:${REF_PROXY_PORT}"',
    ]
    probe = plan_for(write_bundle(tmp_path / "probe"), probe=UNKNOWN_UUID_PROBE)
    entries = re.findall(r"^ *ENTRY=(.*)$", render_serve_sh(probe), re.M)
    assert entries == ['"http://${HOST}:${DECODE0_PORT}"']


def test_the_export_directory_is_readable_by_others(tmp_path: Path) -> None:
    """The export is written in a temporary directory renamed into place, and mkdtemp's is
    0700: left so, nobody but its writer could open the export it is meant to be sent as."""
    out = write(tmp_path)
    assert out.stat().st_mode & 0o777 == 0o755


def test_request_and_expected_answer_are_the_recorded_ones(tmp_path: Path) -> None:
    out = write(tmp_path)
    recorded = json.loads((tmp_path / "run/requests.json").read_text())[PROMPT]
    assert json.loads((out / "request.json").read_text()) == recorded
    expected = json.loads((out / "expected.json").read_text())
    assert expected["check"] == "tokens"
    assert (expected["prompt_token_ids"], expected["token_ids"]) == (PROMPT_IDS, BASELINE_IDS)
    assert expected["recorded"]["verdict"] == "ERROR"
    # where it showed, for check.py's "reproduced": the instance that died, by its export name
    assert expected["recorded"]["died"] == "decode0"


def test_expected_json_records_which_ids_parted_and_where(tmp_path: Path) -> None:
    recorded = json.loads((write(tmp_path, verdict="MISMATCH") / "expected.json").read_text())
    assert {k: recorded["recorded"][k] for k in ("ids", "position")} == {
        "ids": "generated ids",
        "position": 1,
    }


def test_a_record_without_detail_tells_nowhere_and_still_exports() -> None:
    """A summary.json record with no `detail` (nothing to tell the dead instance or the ids
    by) gives expected.json no `died`, `ids` or `position`, as repro's `another_failure`
    reads such a record: never a KeyError that stops the export of an ERROR or a MISMATCH."""
    from harness.run.export.expectation import where_it_failed

    for verdict in ("ERROR", "MISMATCH", "DRIFT"):
        assert where_it_failed(verdict, {"verdict": verdict}) == {}, verdict
    died = where_it_failed("ERROR", {"detail": "x", "error": "decode0 (pid 7) died: exit 1"})
    assert set(died) == {"died"}


def test_expected_json_keeps_no_log_probs_of_other_tokens(tmp_path: Path) -> None:
    """check.py judges drift with expected.json's log-probs as those of its ids: the reference's
    recorded entry of another token than the id it generated there (a batched answer's, which
    the harness's judge does not read, `_logprob_at`) is written as none (null), never as the
    id's."""
    run = write_bundle(tmp_path / "run")
    responses = json.loads((run / "responses.json").read_text())
    entries = responses["baseline"][PROMPT]["result"]["logprobs"]
    entries[0] = {"token_id": BASELINE_IDS[0] + 1, "logprob": -3.0, "top": [[1, -3.0]]}
    (run / "responses.json").write_text(json.dumps(responses))
    out = tmp_path / "export"
    write_export(plan_for(run, f"1E+1P+1D:{PROMPT}"), out, REPAIR)
    expected = json.loads((out / "expected.json").read_text())
    assert expected["token_logprobs"][:2] == [None, -0.5]
    assert expected["top_logprobs"][:2] == [None, [[BASELINE_IDS[1], -0.5]]]


def test_a_gone_model_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="model directory /gone/model is gone"):
        plan_for(write_bundle(tmp_path / "run", model="/gone/model"))


def test_a_local_model_past_the_copy_limit_and_no_hub_snapshot_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model directory larger than an export carries, whose path names no Hugging Face
    snapshot: neither copied (an export of gigabytes) nor named (no hub name to fetch)."""
    from harness.run.export import plan as plan_module

    root = write_bundle(tmp_path / "run")
    monkeypatch.setattr(plan_module, "MAX_COPIED_MODEL_BYTES", 1024)
    with pytest.raises(BadInput, match="is larger than 0 MiB and not a Hugging Face snapshot"):
        plan_for(root)
    monkeypatch.setattr(plan_module, "MAX_COPIED_MODEL_BYTES", 2048)
    assert plan_for(root).model.directory is not None


def test_a_relative_model_path_deeper_than_org_name_is_no_hub_name(tmp_path: Path) -> None:
    """`org/name` is a hub model's name; `models/org/name`, gone from here, is a directory of
    the recording machine, which an export cannot name as a model to download."""
    with pytest.raises(BadInput, match="model directory models/acme/vl is gone"):
        plan_for(write_bundle(tmp_path / "run", model="models/acme/vl"))
    plan = plan_for(write_bundle(tmp_path / "hub", model="acme/vl"))
    assert (plan.model.directory, plan.model.hub_name) == (None, "acme/vl")


@pytest.mark.parametrize(
    "config, architecture",
    [
        (
            {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl"},
            "Qwen2VLForConditionalGeneration",
        ),
        ({"architectures": [], "model_type": "qwen2_vl"}, "qwen2_vl"),
        ({"model_type": ""}, None),
    ],
)
def test_a_models_architecture_is_its_class_else_its_model_type(
    tmp_path: Path, config: dict, architecture: str | None
) -> None:
    from harness.run.export.plan import architecture_of

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert architecture_of(tmp_path) == architecture


def test_the_unknown_uuid_probe_sends_only_the_consumer_a_never_encoded_uuid(
    tmp_path: Path,
) -> None:
    plan = plan_for(write_bundle(tmp_path / "run"), probe=UNKNOWN_UUID_PROBE)
    assert [s.name for s in plan.servers] == ["decode0"] and plan.proxy is None
    part = plan.request["messages"][0]["content"][0]
    assert part == {"type": "image_embeds", "image_embeds": GRID, "uuid": NEVER_ENCODED_UUID}
    assert plan.expected["check"] == "refused-and-alive"
    assert plan.expected["send_to"] == "decode0"
    assert plan.name.endswith("-unknown-uuid")
    pd = plan_for(write_bundle(tmp_path / "pd", topology="1E+1PD"), probe=UNKNOWN_UUID_PROBE)
    assert [s.name for s in pd.servers] == ["pd0"]


def test_the_default_case_is_the_first_that_did_not_match_even_when_declared(
    tmp_path: Path,
) -> None:
    plan = plan_for(write_bundle(tmp_path / "run", scenario="epd-media-in-decode-tail"))
    assert plan.label == "1E+1P+1D:epd-media-in-decode-tail"
    assert plan.case.verdict == "ERROR"
    assert plan.declared is not None and "epd-media-in-decode-tail expects ERROR" in plan.declared
    assert plan.name == "vllm-0.32.0-1E-1P-1D-m-image-error"


def test_devices_are_positions_in_first_use_order_and_a_node_is_part_of_a_device() -> None:
    """An instance on a device an earlier one used gets that device's position, not the last
    one's; a recorded list's spaces are no part of a device; a Ray node, by address or by id,
    makes its GPU 0 a device of its own, named with the node."""
    from harness.run.export.devices import device_positions

    positions, devices = device_positions(
        [
            {"env": {"CUDA_VISIBLE_DEVICES": "4, 5"}},
            {"env": {"CUDA_VISIBLE_DEVICES": "6"}},
            {"env": {"CUDA_VISIBLE_DEVICES": "4"}},
            {"env": {"ZE_AFFINITY_MASK": "0"}, "node": {"node_id": "abc"}},
            {
                "env": {"CUDA_VISIBLE_DEVICES": "0"},
                "node": {"address": "10.0.0.12", "hostname": "h1"},
            },
            {"env": {}},
        ]
    )
    assert positions == [(0, 1), (2,), (0,), (3,), (4,), ()]
    assert [d.describe() for d in devices] == [
        "GPU 4",
        "GPU 5",
        "GPU 6",
        "device 0 of node abc",
        "GPU 0 of node 10.0.0.12 (h1)",
    ]


def test_a_scenarios_declaration_covers_the_verdict_it_declares_only(tmp_path: Path) -> None:
    """epd-media-in-decode-tail declares an ERROR: a MISMATCH of the same case is no failure
    the harness declares, and ISSUE.md must not call it expected."""
    root = write_bundle(tmp_path / "run", verdict="MISMATCH", scenario="epd-media-in-decode-tail")
    plan = plan_for(root)
    assert plan.label == "1E+1P+1D:epd-media-in-decode-tail" and plan.case.verdict == "MISMATCH"
    assert plan.declared is None, plan.declared


def test_a_failure_declared_for_the_release_is_exported_as_declared(tmp_path: Path) -> None:
    """A release's own known failure (`KnownFailure`, docs/versions.md) is recorded as the judge
    writes it: `declared_failure` names it and the detail ends with its upstream cause. ISSUE.md
    must say the harness declares it, not that it does not expect it; a case that failed
    otherwise than declared is no declared failure."""
    from harness.judge.records import CaseRecord, Verdict
    from harness.judge.verdicts import held_as_declared
    from harness.spec.generations import VIDEO_TIMING_BEFORE_0_31 as KNOWN

    root = write_bundle(tmp_path / "run", verdict="MISMATCH")
    [record] = json.loads((root / "summary.json").read_text())["cases"]
    fields = {k: v for k, v in record.items() if k in CaseRecord.__dataclass_fields__}
    judged = CaseRecord(**{**fields, "verdict": Verdict.MISMATCH})
    declared = held_as_declared(judged, KNOWN).to_json()
    (root / "summary.json").write_text(json.dumps({"cases": [declared]}))
    plan = plan_for(root)
    assert plan.declared is not None and KNOWN.name in plan.declared, plan.declared
    assert KNOWN.reason in plan.declared
    assert f"Declared by the harness: {plan.declared}" in render_issue(plan)
    otherwise = {**declared, "policy_passed": False, "detail": "request failed"}
    (root / "summary.json").write_text(json.dumps({"cases": [otherwise]}))
    assert plan_for(root).declared is None


def test_a_fuzz_groups_known_failure_is_exported_as_declared(tmp_path: Path) -> None:
    """Seen on real vLLM 0.32.0: `fuzz --topology 1E+1PD --examples 12 --seed 0` reported one
    known group (scenario ec-video-jpeg-frames-default-fps, a declared upstream MISMATCH), and
    the ISSUE.md `export` wrote of its bundle said "not declared: the harness does not expect
    this failure". A group's bundle keeps its cases failing (so that repro and export pick
    them) and names the rule it is known by in summary.json's `fuzz_group`."""
    root = write_bundle(tmp_path / "run", verdict="MISMATCH")
    summary = json.loads((root / "summary.json").read_text())
    rule = {
        "name": "scenario ec-video-jpeg-frames-default-fps",
        "verdict": "MISMATCH",
        "reason": "the consumer assumes 1.0 s per grid, the baseline 2.0",
        "evidence": "generated tokens differ",
        "trigger": "a video as JPEG frames",
    }
    summary["run"] = {"fuzz_group": {"known": rule}}
    (root / "summary.json").write_text(json.dumps(summary))
    plan = plan_for(root)
    assert plan.declared is not None, "the fuzz's known failure exported as not declared"
    assert rule["name"] in plan.declared and rule["reason"] in plan.declared, plan.declared
    assert f"Declared by the harness: {plan.declared}" in render_issue(plan)
    summary["run"]["fuzz_group"]["known"] = {**rule, "verdict": "ERROR"}  # failed otherwise
    (root / "summary.json").write_text(json.dumps(summary))
    assert plan_for(root).declared is None
    summary["run"]["fuzz_group"]["known"] = None  # a new group
    (root / "summary.json").write_text(json.dumps(summary))
    assert plan_for(root).declared is None


def test_a_probe_is_sent_without_the_log_probs_a_token_check_adds(tmp_path: Path) -> None:
    """A probe is judged by refusal and survival, not by check.py's drift rule: its crafted
    body is sent as crafted, and ISSUE.md does not say log-probs were asked for."""
    root = write_bundle(tmp_path / "run")
    recorded = json.loads((root / "requests.json").read_text())
    for body in recorded.values():
        del body["logprobs"], body["top_logprobs"]  # a run that did not ask for them
    (root / "requests.json").write_text(json.dumps(recorded))
    token_check = plan_for(root)
    assert token_check.request["top_logprobs"] >= 2 and "log-probs" in token_check.sent_unlike
    probe = plan_for(root, probe=UNKNOWN_UUID_PROBE)
    assert "logprobs" not in probe.request and "top_logprobs" not in probe.request
    assert probe.sent_unlike is None, probe.sent_unlike


def test_the_numerics_env_the_run_inherited_is_set_by_serve_sh_and_named(tmp_path: Path) -> None:
    """Found in review: an instance inherits the harness's environment, and a variable that
    picks kernels or threads (VLLM_ATTENTION_BACKEND) is part of how the case ran, recorded in
    `.cmd.json`'s `inherited_env`; serve.sh must set it for the case's instances and the
    baseline (ISSUE.md saying so), a redacted one taken from the user's own environment."""
    run = write_bundle(tmp_path / "run", verdict="MISMATCH")
    inherited = {"VLLM_ATTENTION_BACKEND": "TORCH_SDPA", "VLLM_ACCESSKEY": REDACTED}
    baseline_dir = run / "baseline"
    baseline_dir.mkdir()
    recorded = sorted(run.glob("*/*.cmd.json"))
    argv = json.loads(recorded[0].read_text())["argv"]
    (baseline_dir / "baseline0.cmd.json").write_text(
        json.dumps({"name": "baseline/baseline0", "argv": argv, "env": {}})
    )
    for path in sorted(run.glob("*/*.cmd.json")):
        command = json.loads(path.read_text())
        if "vllm-proxy" not in path.name:
            command["inherited_env"] = inherited
            path.write_text(json.dumps(command))
    plan = plan_for(run, f"1E+1P+1D:{PROMPT}")
    assert plan.baseline is not None
    for server in (*plan.servers, plan.baseline):
        env = dict(server.env)
        assert env.get("VLLM_ATTENTION_BACKEND") == ("TORCH_SDPA",), server.name
        assert env.get("VLLM_ACCESSKEY") == (Var("VLLM_ACCESSKEY", secret=True),), server.name
    serve = render_serve_sh(plan)
    assert "VLLM_ATTENTION_BACKEND=TORCH_SDPA" in serve
    assert 'VLLM_ACCESSKEY="${VLLM_ACCESSKEY}"' in serve
    # Refused unset before anything starts, as a recorded --api-key is (process test:
    # test_a_redacted_inherited_variable_is_refused_before_any_server_starts).
    assert "if [[ -z ${VLLM_ACCESSKEY:-} ]]" in serve
    issue = render_issue(plan)
    assert "`VLLM_ATTENTION_BACKEND=TORCH_SDPA`" in issue
    assert "`VLLM_ACCESSKEY` in their environment, recorded redacted" in issue
    assert "set it to the run's value" in issue


def test_a_baseline_from_the_cache_is_served_with_the_numerics_env_the_run_inherited(
    tmp_path: Path,
) -> None:
    """Found in review: a baseline the run took from the cache left no `.cmd.json`, and the
    export rendered its command with no inherited variables, though its cache key held them
    (`harness.run.baseline_launch`): `run.sh reference` served it without the
    VLLM_ATTENTION_BACKEND the case ran with. It now gets what the case's instances
    inherited, as ISSUE.md says (`serve.sh` sets them on every instance)."""
    run = write_bundle(tmp_path / "run", verdict="MISMATCH")
    assert not (run / "baseline").exists(), "the baseline came from the cache"
    for path in sorted(run.glob("*/*.cmd.json")):
        command = json.loads(path.read_text())
        if "vllm-proxy" not in path.name:
            command["inherited_env"] = {"VLLM_ATTENTION_BACKEND": "TORCH_SDPA"}
            path.write_text(json.dumps(command))
    plan = plan_for(run, f"1E+1P+1D:{PROMPT}")
    assert plan.baseline is not None
    assert dict(plan.baseline.env).get("VLLM_ATTENTION_BACKEND") == ("TORCH_SDPA",)


def test_nixl_side_channel_ports_become_variables(tmp_path: Path) -> None:
    plan = plan_for(write_bundle(tmp_path / "run", topology="1P+1D", kv_connector="NixlConnector"))
    env = {key: value for server in plan.servers for key, value in server.env}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] in (
        (Var("PREFILL0_NIXL_PORT"),),
        (Var("DECODE0_NIXL_PORT"),),
    )
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == (Var("HOST"),)
    assert "DECODE0_NIXL_PORT=${DECODE0_NIXL_PORT:-" in render_serve_sh(plan)


def test_only_nixl_instances_get_a_side_channel_port_each_its_own(tmp_path: Path) -> None:
    """P and D of a NixlConnector run each listen on a NIXL side channel of their own: one
    default port for both makes the second fail on one host. An instance of a connector
    without one gets no port variable, which serve.sh would otherwise check free."""
    nixl = plan_for(write_bundle(tmp_path / "nixl", topology="1P+1D", kv_connector="NixlConnector"))
    sides = [s.default_side_channel for s in nixl.servers]
    assert None not in sides and len(set(sides)) == len(sides) == 2, sides
    plain = plan_for(write_bundle(tmp_path / "plain"))
    assert [s.side_channel for s in plain.servers] == [None, None, None]
    assert "NIXL_PORT" not in render_serve_sh(plain)


def test_what_the_harness_gave_an_instance_wins_over_what_it_inherited(tmp_path: Path) -> None:
    """The launch set the harness's env over the inherited one: OMP_NUM_THREADS=1 of the
    harness ran, not the shell's 8, and serve.sh must start it so."""
    run = write_bundle(tmp_path / "run")
    for path in sorted(run.glob("*/*.cmd.json")):
        command = json.loads(path.read_text())
        if "vllm-proxy" not in path.name:
            command["inherited_env"] = {"OMP_NUM_THREADS": "8", "VLLM_USE_V2": "1"}
            path.write_text(json.dumps(command))
    decode = plan_for(run).servers[2]
    assert dict(decode.env)["OMP_NUM_THREADS"] == ("1",)
    assert dict(decode.env)["VLLM_USE_V2"] == ("1",)


def test_a_clusters_network_settings_are_dropped_wherever_they_were_recorded(
    tmp_path: Path,
) -> None:
    """What a Ray run gave every instance (run.json's launcher.instance_env, whatever its
    name) and a network prefix (UCX_), in the harness's env or inherited: none set by
    serve.sh, each named as dropped."""
    run = write_bundle(tmp_path / "run")
    info = json.loads((run / "run.json").read_text())
    info["launcher"] = {"kind": "ray", "instance_env": {"MY_FABRIC": "ib0"}}
    (run / "run.json").write_text(json.dumps(info))
    for path in sorted(run.glob("*/*.cmd.json")):
        command = json.loads(path.read_text())
        if "vllm-proxy" not in path.name:
            command["env"] = {**command["env"], "MY_FABRIC": "ib0"}
            command["inherited_env"] = {"UCX_TLS": "rc", "VLLM_USE_V2": "1"}
            path.write_text(json.dumps(command))
    plan = plan_for(run)
    for server in plan.servers:
        assert "MY_FABRIC" not in dict(server.env) and "UCX_TLS" not in dict(server.env)
    assert plan.inherited_env == (("VLLM_USE_V2", "1"),)
    assert plan.dropped_env == (("MY_FABRIC", "ib0"), ("UCX_TLS", "rc"))
    serve = render_serve_sh(plan)
    assert "MY_FABRIC" not in serve and "UCX_TLS" not in serve


def test_the_local_media_flag_is_dropped_in_either_spelling() -> None:
    """`--allowed-local-media-path DIR` and `--allowed-local-media-path=DIR` name a directory
    of the recording machine; vLLM refuses every media request where it is missing."""
    from harness.run.export.servers import template_argv

    for flag in (["--allowed-local-media-path", "/rec/media"], ["--allowed-local-media-path=/rec"]):
        argv = ["vllm", "serve", "m", *flag, "--block-size", "16"]
        words = [shell_word(arg) for arg in template_argv(argv, "m", Var("DECODE0_PORT"))]
        assert words == ['"${VLLM}"', "serve", '"${MODEL}"', "--block-size", "16"], words


def test_a_runs_media_dir_is_not_needed_its_files_travel_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with `--media-dir` served `--allowed-local-media-path DIR` and may send file://
    media: on another machine vLLM refuses every media request when DIR is missing, and the
    file is not there (found in review). The export drops the flag and inlines the bytes."""
    import base64
    import functools

    import export_bundle

    media = tmp_path / "recording media"
    media.mkdir()
    picture = media / "cat.png"
    picture.write_bytes(b"\x89PNG not really")
    monkeypatch.setattr(
        export_bundle,
        "ServingConfig",
        functools.partial(export_bundle.ServingConfig, allowed_local_media_path=str(media)),
    )
    bundle_dir = write_bundle(tmp_path / "run", verdict="MISMATCH")
    requests = json.loads((bundle_dir / "requests.json").read_text())
    parts = requests[PROMPT]["messages"][0]["content"]
    parts[0]["image_url"]["url"] = f"file://{picture}"
    (bundle_dir / "requests.json").write_text(json.dumps(requests))
    logged = json.loads(next(bundle_dir.rglob("*decode0.cmd.json")).read_text())["argv"]
    assert "--allowed-local-media-path" in logged, "the bundle stands for a --media-dir run"
    plan = plan_for(bundle_dir)
    serve = render_serve_sh(plan)
    assert "--allowed-local-media-path" not in serve and str(media) not in serve
    (part, _) = plan.request["messages"][0]["content"]
    payload = base64.b64encode(picture.read_bytes()).decode()
    assert part["image_url"]["url"] == f"data:image/png;base64,{payload}"
    assert requests[PROMPT]["messages"][0]["content"][0]["image_url"]["url"].startswith("file")
    picture.unlink()
    with pytest.raises(BadInput, match="cat.png"):
        plan_for(bundle_dir)


def test_file_audio_travels_inline_as_images_and_videos_do(tmp_path: Path) -> None:
    """An `audio_url` file:// part stayed a path of the recording machine while images and
    videos were inlined (found in review): the export then needed a file its reader lacks.
    vLLM's typeless form (`{"audio_url": "file://..."}`, the URL a plain string) is a media URL
    it reads too."""
    import base64

    from harness.run.export.request import inline_local_media

    sound = tmp_path / "bird.wav"
    sound.write_bytes(b"RIFF not really")
    url = f"file://{sound}"
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "audio_url", "audio_url": {"url": url}},
                    {"audio_url": url},
                    {"type": "text", "text": url},
                ],
            }
        ]
    }
    inlined = inline_local_media(body)["messages"][0]["content"]
    payload = f";base64,{base64.b64encode(sound.read_bytes()).decode()}"
    for url_now in (inlined[0]["audio_url"]["url"], inlined[1]["audio_url"]):
        assert url_now.startswith("data:audio/") and url_now.endswith(payload), url_now
    assert inlined[2]["text"] == url, "a text part is the prompt's words, never media"
    assert body["messages"][0]["content"][0]["audio_url"]["url"] == url


def with_api_keys(bundle_dir: Path) -> Path:
    """The bundle's decode given `--api-key=KEY`, its prefill `--api-key KEY`, as extra_args
    would: the `.cmd.json` holds them redacted."""
    for name, extra in (
        ("decode0", [f"--api-key={REDACTED}"]),
        ("prefill0", ["--api-key", REDACTED]),
    ):
        path = next(bundle_dir.rglob(f"*{name}.cmd.json"))
        command = json.loads(path.read_text())
        path.write_text(json.dumps({**command, "argv": command["argv"] + extra}))
    return bundle_dir


def test_a_recorded_api_key_comes_from_a_named_variable_never_the_placeholder(
    tmp_path: Path,
) -> None:
    """`--api-key=KEY` reached serve.sh as `--api-key=[redacted]`, so vLLM started with the
    key "[redacted]" (found in review); `--api-key KEY` refused the export. Both now take
    serve.sh's $API_KEY, which it refuses to start without, before starting anything."""
    plan = plan_for(with_api_keys(write_bundle(tmp_path / "run", verdict="MISMATCH")))
    serve = render_serve_sh(plan)
    assert REDACTED not in serve
    assert '"--api-key=${API_KEY}"' in serve and '--api-key "${API_KEY}"' in serve
    assert "if [[ -z ${API_KEY:-} ]]" in serve  # refused unset: tests/test_export_process.py
    assert "set `API_KEY` (any value of your own)" in render_issue(plan)


def test_the_ec_side_channel_host_follows_host_as_nixls_does(tmp_path: Path) -> None:
    """A Ray run's node address must not survive into an export (found in review)."""
    plan = plan_for(write_bundle(tmp_path / "run"))
    encoder = next(server for server in plan.servers if server.role == "encoder")
    assert dict(encoder.env)["VLLM_EC_SIDE_CHANNEL_HOST"] == (Var("HOST"),)


# -- what is refused ---------------------------------------------------------------------------


def one_line_refusal(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_planted_fault_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    bundle = write_bundle(tmp_path / "run", verdict="MISMATCH", fault="corrupt-ec")
    line = one_line_refusal(capsys, ["export", str(bundle)])
    assert "planted by the harness's self-test (corrupt-ec)" in line
    assert not (bundle / "exports").exists()


def test_a_graded_self_tests_bundle_is_refused_as_a_planted_fault_is(
    tmp_path: Path, capsys
) -> None:
    """A graded self-test plants its faults rung by rung and records no single `fault` in
    run.json, only its detection.json: its MISMATCHes are the harness's too, which vLLM
    alone would not show."""
    bundle = write_bundle(tmp_path / "run", verdict="MISMATCH")
    (bundle / "detection.json").write_text("{}")
    line = one_line_refusal(capsys, ["export", str(bundle)])
    assert "planted by the harness's self-test (graded faults)" in line


def test_a_load_that_killed_an_instance_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    """`export` of a `load --kill decode` run (real vLLM, 1P+1D) wrote "[Bug]: EPD 1P+1D
    (ExampleConnector): D dies on a request of ..." with D's exit code -9: an upstream report
    of the SIGKILL the harness sent, whose run.sh vLLM alone never fails. Refused, as a planted
    fault is; repro too, which would rerun the request without the kill."""
    bundle = write_bundle(tmp_path / "run", topology="1P+1D", verdict="ERROR")
    run = json.loads((bundle / "run.json").read_text())
    (bundle / "run.json").write_text(json.dumps({**run, "killed": "1P+1D/decode0"}))
    line = one_line_refusal(capsys, ["export", str(bundle)])
    assert "the load killed 1P+1D/decode0 (--kill)" in line, line
    assert not (bundle / "exports").exists()
    line = one_line_refusal(capsys, ["repro", str(bundle)])
    assert "the load killed 1P+1D/decode0 (--kill)" in line, line
    assert not (tmp_path / "run-repro").exists()


def test_an_attached_run_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    bundle = write_bundle(tmp_path / "run", proxy_kind="attach")
    line = one_line_refusal(capsys, ["export", str(bundle)])
    assert "attached deployment" in line and "no commands to export" in line


def test_an_attached_runs_refusal_advises_no_command_that_refuses_it_too(
    tmp_path: Path, capsys
) -> None:
    """The refusal said "rerun the case with 'epd-harness repro'", which refuses an attached
    run as well, having nothing to start either (found in review)."""
    bundle = write_bundle(tmp_path / "run", proxy_kind="attach")
    line = one_line_refusal(capsys, ["export", str(bundle)])
    repro = one_line_refusal(capsys, ["repro", str(bundle)])
    assert "epd-harness repro" not in line, repro
    assert "'epd-harness run --proxy vllm'" in line


def test_a_golden_judged_run_is_refused_in_one_line_naming_the_golden(
    tmp_path: Path, capsys
) -> None:
    """Real vLLM: `export` of `run --vllm <0.30.0> --golden 0.31.0`'s video case said only
    "responses.json has no answer of golden-0.31.0 to 'video'". The golden is another
    release's recorded answer, which the export's vLLM alone cannot serve as the reference
    (serve.sh would start its own release's baseline, another comparison): refused, saying
    which run can be exported."""
    bundle = write_bundle(tmp_path / "run")
    run = json.loads((bundle / "run.json").read_text())
    (bundle / "run.json").write_text(json.dumps({**run, "golden_release": "0.31.0"}))
    line = one_line_refusal(capsys, ["export", str(bundle)])
    assert "judged against the golden of vLLM 0.31.0 (--golden)" in line, line
    assert "export a run judged against its own baseline" in line, line
    assert not (bundle / "exports").exists()


def test_an_all_match_run_needs_a_case_and_an_existing_out_is_kept(tmp_path: Path, capsys) -> None:
    bundle = write_bundle(tmp_path / "run", verdict="MATCH")
    assert "name one with --case" in one_line_refusal(capsys, ["export", str(bundle)])
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine").write_text("keep")
    line = one_line_refusal(
        capsys, ["export", str(bundle), "--case", f"1E+1P+1D:{PROMPT}", "--out", str(out)]
    )
    assert "is not empty" in line and (out / "mine").read_text() == "keep"


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_an_export_that_failed_midway_leaves_nothing_and_can_be_written_again(
    tmp_path: Path, monkeypatch, failure: BaseException
) -> None:
    """An export that failed (a full disk) or was interrupted (Ctrl-C) while it wrote its
    files left them half-written, and the next export there was refused as "not empty": the
    user had to delete it by hand (found in review). An export directory is complete or not
    there; a complete one is still never overwritten."""
    run = write_bundle(tmp_path / "run")
    plan = plan_for(run, f"1E+1P+1D:{PROMPT}")
    out = tmp_path / "exports" / "case"

    def fail(*args: object, **kwargs: object) -> None:
        raise failure

    with monkeypatch.context() as patched:
        patched.setattr(files_module.shutil, "copyfile", fail)  # the model, after the scripts
        with pytest.raises(type(failure)):
            write_export(plan, out, REPAIR)
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())
    assert sorted(p.name for p in out.parent.iterdir()) in ([], ["case"])
    write_export(plan, out, REPAIR)
    assert (out / "run.sh").is_file() and (out / "vllm-proxy").is_dir()
    assert [p.name for p in out.parent.iterdir()] == ["case"]
    with pytest.raises(BadInput, match="is not empty"):
        write_export(plan, out, REPAIR)


def test_an_out_that_is_not_empty_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch
) -> None:
    """The rename at the end refuses a non-empty --out too, but only after every file (a
    copied model among them) was written beside it: the refusal comes first."""
    plan = plan_for(write_bundle(tmp_path / "run"), f"1E+1P+1D:{PROMPT}")
    out = tmp_path / "exports" / "case"
    out.mkdir(parents=True)
    (out / "mine").write_text("keep")

    def written(*args: object) -> list[Path]:
        raise AssertionError("the export was written before --out was found not empty")

    monkeypatch.setattr(files_module, "write_files", written)
    with pytest.raises(BadInput, match="is not empty"):
        write_export(plan, out, REPAIR)
    assert [p.name for p in out.parent.iterdir()] == ["case"]
    assert (out / "mine").read_text() == "keep"


def test_an_export_racing_another_into_the_same_out_is_refused_and_keeps_the_others(
    tmp_path: Path, monkeypatch
) -> None:
    """Two exports to one --out, both past the emptiness check: the one that renames its
    staging directory second meets a non-empty directory. It gets the one-line refusal, not
    an OSError traceback, and the first one's files stay."""
    plan = plan_for(write_bundle(tmp_path / "run"), f"1E+1P+1D:{PROMPT}")
    out = tmp_path / "exports" / "case"
    real = files_module.write_files

    def racing(*args: Any) -> list[Path]:
        written = real(*args)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ISSUE.md").write_text("the other export's")
        return written

    monkeypatch.setattr(files_module, "write_files", racing)
    with pytest.raises(BadInput, match="is not empty"):
        write_export(plan, out, REPAIR)
    assert [p.name for p in out.iterdir()] == ["ISSUE.md"]
    assert [p.name for p in out.parent.iterdir()] == ["case"]


def test_the_cli_writes_the_export_beside_the_run(tmp_path: Path, capsys) -> None:
    bundle = write_bundle(tmp_path / "run")
    assert main(["export", str(bundle)]) == 0
    out = bundle / "exports" / "vllm-0.32.0-1E-1P-1D-m-image-error"
    assert {p.name for p in out.iterdir()} >= {
        "run.sh",
        "serve.sh",
        "check.py",
        "cpu_repair.py",
        "request.json",
        "expected.json",
        "ISSUE.md",
        "model",
        "vllm-proxy",
    }
    assert "cpu_env" in (out / "cpu_repair.py").read_text()  # the harness's repairs, copied
    printed = capsys.readouterr().out
    assert f"bash {out}/run.sh" in printed


def test_the_exported_model_leaves_out_the_directorys_hidden_files(tmp_path: Path) -> None:
    """`model/` is the model's files only: a hub snapshot's or a clone's hidden entries (the
    `.complete` marker, a `.git` with its history) are no part of the model, and shipped they
    made the export as large as the history and handed it to whoever the issue reaches."""
    model = write_model(tmp_path / "m")
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    bundle = write_bundle(tmp_path / "run", model=model)
    assert main(["export", str(bundle)]) == 0
    shipped = bundle / "exports" / "vllm-0.32.0-1E-1P-1D-m-image-error" / "model"
    files = sorted(p.relative_to(shipped).as_posix() for p in shipped.rglob("*"))
    assert files == ["config.json", "model.safetensors"]


def test_run_sh_of_a_run_that_could_not_read_its_vllm_version_compares_none(
    tmp_path: Path,
) -> None:
    """A run that could not read its served vLLM's version recorded none ("unknown"): compared
    with that, run.sh would say on every run that the export was recorded with "vllm unknown"
    and a different outcome may be the other release. It compares nothing then."""
    run = write_bundle(tmp_path / "run")
    info = json.loads((run / "run.json").read_text())
    del info["served_vllm"]["version"]
    (run / "run.json").write_text(json.dumps(info))
    out = tmp_path / "export"
    write_export(plan_for(run), out, REPAIR)
    run_sh = (out / "run.sh").read_text()
    assert "RECORDED_VLLM" not in run_sh and "the installed vllm is" not in run_sh, run_sh


def test_the_exported_scripts_are_executable(tmp_path: Path) -> None:
    """run.sh and serve.sh, and check.py and cpu_repair.py with their `#!/usr/bin/env
    python3`, run by name (`./check.py --state DIR`) as a developer handed them would."""
    bundle = write_bundle(tmp_path / "run")
    assert main(["export", str(bundle)]) == 0
    out = bundle / "exports" / "vllm-0.32.0-1E-1P-1D-m-image-error"
    for name in ("run.sh", "serve.sh", "check.py", "cpu_repair.py"):
        assert os.access(out / name, os.X_OK), f"{name} is not executable"
    assert (out / "check.py").read_text().startswith("#!/usr/bin/env python3\n")


# -- ISSUE.md ----------------------------------------------------------------------------------


def issue_fields(text: str) -> dict[str, str]:
    """Heading -> body of each `## ` section; the environment's `- Key: value` lines too."""
    sections = {}
    for chunk in re.split(r"^(?=## )", text, flags=re.M)[1:]:
        heading, _, body = chunk.partition("\n")
        sections[heading.strip()] = body.strip()
    return sections


@pytest.mark.parametrize("verdict", ["ERROR", "MISMATCH", "MATCH"])
def test_issue_md_has_every_field_of_an_upstream_report(tmp_path: Path, verdict: str) -> None:
    out = write(tmp_path, verdict=verdict)
    text = (out / "ISSUE.md").read_text()
    assert text.startswith(TITLE_PREFIX) and len(text.splitlines()[0]) > len(TITLE_PREFIX) + 20
    sections = issue_fields(text)
    assert [f for f in ISSUE_FIELDS if f not in sections] == []
    assert all(sections[f] for f in ISSUE_FIELDS), "an empty section"
    environment = dict(line[2:].split(": ", 1) for line in sections["## Environment"].splitlines())
    assert set(ENVIRONMENT_KEYS) <= set(environment)
    assert environment["vLLM"].startswith("0.32.0+cpu")
    assert "ExampleConnector" in environment["KV connector"]
    assert "disagg_epd_proxy.py" in environment["Proxy"]
    assert "bash run.sh" in sections["## How to reproduce"]
    assert "cpu_repair.py" in sections["## How to reproduce"]
    assert " ".join(map(str, BASELINE_IDS)) in sections["## What was expected"]
    assert "--kv-transfer-config" in sections["## The commands"]


def test_issue_md_environment_says_the_dtype_every_instance_computed_in(tmp_path: Path) -> None:
    """A T4's `run --dtype float16` exported: ISSUE.md's Environment (vLLM, devices, model,
    connectors) did not say the dtype, which changes the ids as much as the GPU model does;
    only the long command lines further down named `--dtype float16`."""
    out = write(tmp_path, dtype="float16")
    sections = issue_fields((out / "ISSUE.md").read_text())
    environment = dict(line[2:].split(": ", 1) for line in sections["## Environment"].splitlines())
    assert environment["Dtype"] == "float16 (every instance's --dtype, the baseline's too)"
    assert "--dtype float16" in sections["## The commands"]
    assert "--dtype float16" in (out / "serve.sh").read_text()


def test_issue_md_names_a_small_model_of_the_users_own_as_it_is(tmp_path: Path) -> None:
    """Every model directory of at most 64 MiB is shipped, a user's own small checkpoint too:
    ISSUE.md called each "a tiny random Qwen2.5-VL generated by the harness", and an upstream
    report then named a model that never ran (found in review)."""
    model = tmp_path / "my-llava"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}'
    )
    (model / "model.safetensors").write_bytes(b"\0" * 2048)
    out = write(tmp_path, model=model)
    sections = issue_fields((out / "ISSUE.md").read_text())
    environment = dict(line[2:].split(": ", 1) for line in sections["## Environment"].splitlines())
    assert "LlavaForConditionalGeneration" in environment["Model"]
    assert "generated by the harness" not in environment["Model"]
    assert "shipped in `model/`" in environment["Model"]


def test_issue_md_names_the_harnesss_tiny_model_as_the_harnesss(tmp_path: Path) -> None:
    """The tiny model's cache directory (`fixtures.tiny_model`) is a random model the harness
    generated: ISSUE.md says so, not that a user's own checkpoint ran."""
    from fixtures.tiny_model import CACHE_DIR_PREFIX

    model = write_model(tmp_path / f"{CACHE_DIR_PREFIX}0123abcd")
    out = write(tmp_path, model=model)
    sections = issue_fields((out / "ISSUE.md").read_text())
    environment = dict(line[2:].split(": ", 1) for line in sections["## Environment"].splitlines())
    assert "a tiny random Qwen2.5-VL generated by the harness" in environment["Model"]


def test_issue_md_of_an_error_names_the_dead_instance_and_its_assertion(tmp_path: Path) -> None:
    out = write(tmp_path, verdict="ERROR", scenario="epd-media-in-decode-tail")
    text = (out / "ISSUE.md").read_text()
    title = text.splitlines()[0]
    assert "D dies on a request of 1 image + 3 words of text" in title
    assert "Expected number of multimodal embeddings to match" in title
    happened = issue_fields(text)["## What happened"]
    assert "instance 1E+1P+1D/decode0 exited with code 0" in happened
    assert (
        "matrix scenario epd-media-in-decode-tail expects ERROR"
        in (issue_fields(text)["## How it was found"])
    )


def test_issue_md_of_a_mismatch_names_the_first_divergence(tmp_path: Path) -> None:
    text = (write(tmp_path, verdict="MISMATCH") / "ISSUE.md").read_text()
    assert "first difference at generated token 1" in text.splitlines()[0]
    assert "generated tokens differ at position 1" in issue_fields(text)["## What happened"]


def test_issue_md_cuts_a_long_comparison_to_its_first_lines_and_says_how_many(
    tmp_path: Path,
) -> None:
    """An upstream report quotes the evidence, not a whole dump of it: a comparison of a few
    hundred lines is cut to its first MAX_EVIDENCE_LINES and says how long it was."""
    run = write_bundle(tmp_path / "run", verdict="MISMATCH")
    summary = json.loads((run / "summary.json").read_text())
    summary["cases"][0]["explanation"] = "\n".join(f"token {i} differs" for i in range(300))
    (run / "summary.json").write_text(json.dumps(summary))
    happened = issue_fields(render_issue(plan_for(run)))["## What happened"]
    assert "token 59 differs" in happened
    assert "token 60 differs" not in happened
    assert "... (300 lines in all)" in happened


def test_issue_md_names_the_reference_a_case_differs_from(tmp_path: Path) -> None:
    """A case judged against its exact reference 1P+1D differs from 1P+1D serving, not from
    monolithic serving: the title sent upstream names the comparison the run made."""
    plan = plan_for(write_exact_reference_bundle(tmp_path / "run"))
    assert plan.case.reference == "1P+1D"
    title = render_issue(plan).splitlines()[0]
    assert "output differs from 1P+1D serving for" in title, title
    monolithic = render_issue(plan_for(write_bundle(tmp_path / "b", verdict="MISMATCH")))
    assert "output differs from monolithic serving for" in monolithic.splitlines()[0]


def test_issue_md_of_a_run_without_a_noise_floor_says_any_difference_is_a_mismatch(
    tmp_path: Path,
) -> None:
    """A run that measured no noise (a floor of 0, as on CPU) leaves check.py no room for
    drift; ISSUE.md said a near tie within a floor of 0 nats was DRIFT, which check.py never
    calls it."""
    text = (write(tmp_path, verdict="MISMATCH") / "ISSUE.md").read_text()
    assert "the run measured no noise (a floor of 0), so any difference is a MISMATCH" in text
    assert "DRIFT, numeric noise" not in text


def issue_title(run: Path, summary: dict, out: Path) -> str:
    """The title of ISSUE.md exported to `out` from the 1P+1D case of `run`, whose
    summary.json is first rewritten as `summary`."""
    (run / "summary.json").write_text(json.dumps(summary))
    write_export(plan_for(run, f"1P+1D:{PROMPT}"), out, REPAIR)
    return (out / "ISSUE.md").read_text().splitlines()[0]


def test_issue_md_of_a_stream_framed_wrong_with_equal_tokens_says_so(tmp_path: Path) -> None:
    """vLLM's toy P/D proxy streams as application/json with the right ids: a MISMATCH whose
    title said "output differs from monolithic serving", a difference there is none of (found
    in review, on a real `run --stream --proxy vllm --topology 1P+1D`)."""
    run = write_bundle(tmp_path / "run", topology="1P+1D", verdict="MISMATCH")
    summary = json.loads((run / "summary.json").read_text())
    case = summary["cases"][0]
    case["divergence"] = None
    case["explanation"] = "identical: generated tokens equal (4/4)"
    case["detail"] = (
        "stream framing broken: served as application/json, not text/event-stream; "
        "identical: generated tokens equal (4/4); declared upstream failure: the toy proxy"
    )
    case["guards"] = {"stream_framing": {"ok": False, "evidence": "stream framing broken: ..."}}
    title = issue_title(run, summary, tmp_path / "export")
    assert "output differs" not in title, title
    assert "is framed wrong (served as application/json, not text/event-stream)" in title
    assert title.endswith("its tokens equal monolithic serving's"), title


def test_issue_md_of_a_stream_framed_wrong_whose_tokens_differ_says_they_differ(
    tmp_path: Path,
) -> None:
    """Broken framing and a token difference both: the title names the difference, never
    "its tokens equal monolithic serving's" of tokens that do not."""
    run = write_bundle(tmp_path / "run", topology="1P+1D", verdict="MISMATCH")
    summary = json.loads((run / "summary.json").read_text())
    case = summary["cases"][0]
    assert case["divergence"]["index"] == 1
    case["detail"] = (
        "stream framing broken: served as application/json, not text/event-stream; "
        f"{case['explanation']}"
    )
    case["guards"] = {"stream_framing": {"ok": False, "evidence": "stream framing broken: ..."}}
    title = issue_title(run, summary, tmp_path / "export")
    assert "tokens equal" not in title, title
    assert "output differs from monolithic serving" in title, title
    assert title.endswith("(first difference at generated token 1)"), title


@pytest.mark.parametrize(
    "client_line",
    [
        'ServerFailedError: Error code: 500 - {"error": "boom"}',  # the harness's client
        "APIError: Internal Server Error",  # the openai client's, in runs before it went
    ],
)
def test_the_error_headline_skips_generic_engine_errors(client_line: str) -> None:
    error = (
        f"{client_line}\n"
        "(EngineCore pid=1) ERROR EngineDeadError: EngineCore encountered an issue\n"
        "(EngineCore pid=1) ERROR AssertionError: Expected number of multimodal embeddings\n"
    )
    assert error_headline(error) == "Expected number of multimodal embeddings"
    assert error_headline("nothing here") == ""


def test_the_error_headline_is_the_messages_first_sentence_cut_to_a_title() -> None:
    """A title holds the exception's first sentence (`expected 3, got 2. Check the mm
    processor ...` continues with advice a title has no room for), at most HEADLINE_CHARS."""
    line = "ERROR ValueError: Expected 3 embeddings, got 2. Check the processor. Or the model."
    assert error_headline(line) == "Expected 3 embeddings, got 2"
    assert error_headline("ValueError: " + "x" * 500) == "x" * HEADLINE_CHARS


def test_a_framing_detail_not_in_the_judges_form_is_not_copied_into_the_title() -> None:
    """broken_framing reads the problems out of `stream framing broken: PROBLEMS`; a detail in
    another form (an older run's, another verdict's) gives the plain name, not the detail."""
    record = {
        "guards": {STREAM_CHECK: {"ok": False}},
        "detail": "generated tokens differ at 3 (long detail of another check)",
    }
    assert broken_framing(record) == "stream framing broken"
    record["detail"] = STREAM_BROKEN + "served as application/json"
    assert broken_framing(record) == "served as application/json"


def test_describe_request_counts_media_and_words() -> None:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url"},
                    {"type": "image_url"},
                    {"type": "video_url"},
                    {"type": "text", "text": "two words"},
                ],
            }
        ]
    }
    assert describe_request(body) == "2 images + 1 video + 2 words of text"


def test_describe_request_names_audio_as_audio() -> None:
    """An issue's title said "a request of 1 audio_url + 1 input_audio + ..." (found in
    review): part types, where images and videos are named as media."""
    content = [{"type": "audio_url"}, {"type": "input_audio"}, {"type": "text", "text": "hi"}]
    body = {"messages": [{"role": "user", "content": content}]}
    assert describe_request(body) == "2 audio clips + 1 words of text"


def test_describe_request_names_typeless_media() -> None:
    """vLLM's typeless parts (`{"audio_url": "file://..."}`, which the export inlines) were
    described as "1 ?" (found in review): a part is named by its media key when it has no
    type."""
    content = [
        {"audio_url": "data:audio/wav;base64,UklGRg=="},
        {"image_url": "data:image/png;base64,iVBO"},
        {"type": "text", "text": "hi"},
    ]
    body = {"messages": [{"role": "user", "content": content}]}
    assert describe_request(body) == "1 audio clip + 1 image + 1 words of text"


# -- check.py ----------------------------------------------------------------------------------


def test_check_py_needs_only_the_standard_library() -> None:
    tree = ast.parse(Path(check.__file__).read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported - set(sys.stdlib_module_names) - {"__future__"} == set()


def test_first_difference() -> None:
    assert check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert check.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert check.first_difference([1, 2, 3], [1, 2]) == 2


def answer(status: int | None, payload: object) -> check.Answer:
    return check.Answer("http://x/v1/chat/completions", status, json.dumps(payload), 0.1)


def response(prompt: list[int], tokens: list[int]) -> dict:
    top = [{"token": "token_id:99", "logprob": -0.1}]
    content = [{"token": f"token_id:{t}", "logprob": -0.1, "top_logprobs": top} for t in tokens]
    return {
        "prompt_token_ids": prompt,
        "choices": [
            {"token_ids": tokens, "logprobs": {"content": content}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens)},
    }


EXPECTED = {
    "check": "tokens",
    "prompt_token_ids": [1, 2, 3],
    "token_ids": [7, 8, 9, 10],
    "top_logprobs": [[[7, -0.5]], [[8, -0.5], [5, -2.0]], [[9, -0.5]], [[10, -0.5]]],
}


def judge(*args, **kwargs) -> tuple[str, int, str]:
    """check.py's judgment of one answer, as (verdict, exit code, evidence)."""
    judged = check.judgment(*args, **kwargs)
    return judged.verdict, judged.code, judged.detail


def test_check_judges_match_mismatch_and_prompt_difference(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    verdict, code, detail = judge(
        EXPECTED, answer(200, response([1, 2, 3], [7, 8, 9, 10])), [], tmp_path
    )
    assert (verdict, code) == ("MATCH", 0)
    verdict, code, detail = judge(
        EXPECTED, answer(200, response([1, 2, 3], [7, 5, 9, 10])), [], tmp_path
    )
    assert (verdict, code) == ("MISMATCH", 1)
    assert "generated token ids differ at position 1" in detail and "expected 8, got 5" in detail
    assert "expected top-k there: 8: -0.500, 5: -2.000" in detail
    assert "received top-k there: 99: -0.100" in detail
    verdict, code, detail = judge(
        EXPECTED, answer(200, response([1, 2, 4], [7, 8, 9, 10])), [], tmp_path
    )
    assert (verdict, code) == ("MISMATCH", 1) and "prompt token ids differ at position 2" in detail


@pytest.mark.parametrize("status", [500, 503, 404, 201])
def test_check_calls_any_answer_but_http_200_an_error_whatever_its_body(
    tmp_path: Path, monkeypatch, status: int
) -> None:
    """An HTTP error is an ERROR (exit 2) said by its status, as the harness fails it, even
    when its body carries the expected ids: read as an answer, it was a MATCH (exit 0)."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    verdict, code, detail = judge(
        EXPECTED, answer(status, response([1, 2, 3], [7, 8, 9, 10])), [], tmp_path
    )
    assert (verdict, code) == ("ERROR", 2), detail
    assert f"-> HTTP {status} after" in detail


@pytest.mark.parametrize("flag", ["--save-reference", "--reference"])
def test_check_refuses_a_reference_flag_of_a_probe_export_before_serve_sh_is_needed(
    tmp_path: Path, monkeypatch, capsys, flag: str
) -> None:
    """A probe's export checks no token ids, so it has no reference to keep or judge against;
    said only once serve.sh's state could be read, the refusal first sent the user to start
    serve.sh ("is serve.sh serving?"), minutes, to be told so then (found in review)."""
    here = tmp_path / "export"
    here.mkdir()
    (here / "request.json").write_text(json.dumps({"messages": []}))
    (here / "expected.json").write_text(json.dumps({"check": "survives", "what": "a probe"}))
    monkeypatch.setattr(check, "__file__", str(here / "check.py"))
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps({"reference": "baseline"}))
    no_state = here / "work" / "state"  # serve.sh never ran
    assert check.main(["--state", str(no_state), flag, str(kept)]) == check.EXIT_ERROR
    err = capsys.readouterr().err
    assert "this export checks no token ids" in err and "serve.sh serving" not in err, err


@pytest.mark.parametrize(
    "mode, flag, says",
    [
        ("case", "--save-reference", "serve.sh serves the case, not the reference"),
        ("reference", "--reference", "serve.sh serves the reference, not the case"),
    ],
)
def test_check_refuses_to_keep_or_judge_against_a_reference_the_wrong_side_serves(
    tmp_path: Path, monkeypatch, capsys, mode: str, flag: str, says: str
) -> None:
    """`--save-reference` while serve.sh serves the case would take the case's answer for the
    reference's (or keep nothing, exit 0, for `--reference` to fail on later); `--reference`
    while it serves the reference would judge the reference against itself. Each is refused
    before anything is sent: exit 2, one line naming the cause."""
    here = tmp_path / "export"
    state = here / "work" / "state"
    state.mkdir(parents=True)
    (here / "request.json").write_text(json.dumps({"messages": []}))
    (here / "expected.json").write_text(
        json.dumps({**EXPECTED, "what": "a case", "reference": "baseline"})
    )
    (state / "endpoints.tsv").write_text(
        f"mode\t{mode}\nentry\thttp://127.0.0.1:9\n"
        "instance\tdecode0\tdecode\thttp://127.0.0.1:9\t\tnone.log\n"
    )
    kept = tmp_path / "kept.json"
    if flag == "--reference":
        kept.write_text(json.dumps({"reference": "baseline"}))
    sent = []
    monkeypatch.setattr(check, "__file__", str(here / "check.py"))

    def post_json(url: str, *args: object) -> check.Answer:
        sent.append(url)
        return check.Answer(url, None, "refused", 0.0)

    monkeypatch.setattr(check, "post_json", post_json)
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    assert check.main(["--state", str(state), flag, str(kept)]) == check.EXIT_ERROR
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert sent == []


def test_check_reproduces_a_failure_where_it_was_recorded_as_repro_does() -> None:
    """`epd-harness repro`'s `another_failure` and `parted_elsewhere`, restated in check.py:
    the same verdict showing elsewhere is another failure; ids parting at another position
    are the same one, the position said; an export that recorded no where is judged on the
    verdict, as before."""
    generated = {"verdict": "MISMATCH", "ids": "generated ids", "position": 1}
    parted = check.parting(EXPECTED, response([1, 2, 3], [7, 5, 9, 10]))
    assert parted == ("generated ids", 1)
    assert check.reproduction(generated, "MISMATCH", (), parted) == "reproduced"
    later = check.parting(EXPECTED, response([1, 2, 3], [7, 8, 9, 11]))
    assert check.reproduction(generated, "MISMATCH", (), later) == (
        "reproduced (the ids part at position 3 now, at position 1 in the recording)"
    )
    prompt = check.parting(EXPECTED, response([1, 2, 4], [7, 8, 9, 10]))
    assert check.reproduction(generated, "MISMATCH", (), prompt) == (
        "NOT reproduced (prompt ids, same count now, generated ids in the recording)"
    )
    assert check.reproduction({"verdict": "MISMATCH"}, "MISMATCH", (), prompt) == "reproduced"
    died = {"verdict": "ERROR", "died": "decode0"}
    assert check.reproduction(died, "ERROR", ("decode0",), None) == "reproduced"
    assert check.reproduction(died, "ERROR", (), None) == (
        "NOT reproduced (no instance died now, decode0 in the recording)"
    )
    assert check.reproduction({"verdict": "ERROR", "died": None}, "ERROR", ("pd0",), None) == (
        "NOT reproduced (pd0 died now, no instance in the recording)"
    )
    assert check.reproduction({"verdict": "ERROR"}, "ERROR", ("pd0",), None) == "reproduced"
    assert check.reproduction(died, "MATCH", (), None) == "NOT reproduced"


def test_check_names_a_prompt_of_another_length_another_count_as_the_harness_does() -> None:
    """The harness's signature counts prompt ids of another length (here one fewer: the
    media placeholders sized differently) as "prompt ids, another count"; so recorded, the
    same parting here is the recorded failure, and one of the same length is not."""
    shorter = check.parting(EXPECTED, response([1, 2], [7, 8, 9, 10]))
    assert shorter == ("prompt ids, another count", 2)
    recorded = {"verdict": "MISMATCH", "ids": "prompt ids, another count", "position": 2}
    assert check.reproduction(recorded, "MISMATCH", (), shorter) == "reproduced"
    same = check.parting(EXPECTED, response([1, 2, 4], [7, 8, 9, 10]))
    assert check.reproduction(recorded, "MISMATCH", (), same) == (
        "NOT reproduced (prompt ids, same count now, prompt ids, another count in the recording)"
    )


def test_check_reproduces_a_prompt_parting_an_export_recorded_as_prompt_ids() -> None:
    """An export that recorded the parting as "prompt ids" (no count) is reproduced by prompt
    ids parting here, of either count; generated ids parting are another failure."""
    recorded = {"verdict": "MISMATCH", "ids": "prompt ids", "position": 2}
    for prompt in ([1, 2, 4], [1, 2]):
        parted = check.parting(EXPECTED, response(prompt, [7, 8, 9, 10]))
        assert check.reproduction(recorded, "MISMATCH", (), parted) == "reproduced", prompt
    generated = check.parting(EXPECTED, response([1, 2, 3], [7, 5, 9, 10]))
    assert check.reproduction(recorded, "MISMATCH", (), generated).startswith("NOT reproduced")


@pytest.mark.parametrize(
    "payload",
    [
        {"choices": [{"message": {"content": "hi"}}]},
        {"prompt_token_ids": [1, 2, 3], "choices": [{"token_ids": None}]},
    ],
    ids=["no-ids", "null-ids"],
)
def test_check_calls_an_answer_without_token_ids_an_error_as_the_harness_does(
    tmp_path: Path, monkeypatch, payload: dict
) -> None:
    """A vLLM that ignores return_token_ids (another release than the recorded one: run.sh
    says so and goes on) answers without ids. The harness fails that answer as no answer
    (parse_chat_response: ERROR); check.py called it a MISMATCH, exit 1 "a difference", and a
    recorded MISMATCH "reproduced"."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    verdict, code, detail = judge(EXPECTED, answer(200, payload), [], tmp_path)
    assert (verdict, code) == ("ERROR", 2), detail
    assert "was return_token_ids honoured?" in detail


@pytest.mark.parametrize(
    "prompt, tokens, field",
    [
        ([1, 2, 3], [7.0, 8, 9, 10], "token_ids"),
        ([1.0, 2, 3], [7, 8, 9, 10], "prompt_token_ids"),
        ([1, 2, 3], [7, 8, 9, True], "token_ids"),
        ([1, 2, 3], [7, "8", 9, 10], "token_ids"),
    ],
    ids=["float-generated", "float-prompt", "bool", "string"],
)
def test_check_calls_unstreamed_ids_that_are_not_integers_an_error_as_the_harness_does(
    tmp_path: Path, monkeypatch, prompt: list, tokens: list, field: str
) -> None:
    """The harness fails an answer whose ids are not integers (parse_chat_response's
    integer_ids: ERROR), as check.py's stream reader does; its unstreamed judgment compared
    them loosely, so a JSON answer with 7.0 for 7 (or true for 1) MATCHed, exit 0, and
    `--save-reference` kept such ids truncated to integers."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    verdict, code, detail = judge(EXPECTED, answer(200, response(prompt, tokens)), [], tmp_path)
    assert (verdict, code) == ("ERROR", 2), detail
    assert f"{field} is" in detail and "not a list of integers" in detail
    # nor is it kept as a reference answer (int() made 7.9 the id 7)
    assert check.reference_answer(response(prompt, tokens), "baseline", {}) is None


def two_choices(body: dict) -> None:
    body["choices"].append({**body["choices"][0], "index": 1})


def no_finish_reason(body: dict) -> None:
    del body["choices"][0]["finish_reason"]


def fewer_log_probs(body: dict) -> None:
    del body["choices"][0]["logprobs"]["content"][-1]


def log_probs_of_other_ids(body: dict) -> None:
    body["choices"][0]["logprobs"]["content"].reverse()


def usage_of_other_ids(body: dict) -> None:
    body["usage"] = {"prompt_tokens": 3, "completion_tokens": 3}


def content_not_a_string(body: dict) -> None:
    body["choices"][0]["message"] = {"role": "assistant", "content": 5}


def message_not_an_object(body: dict) -> None:
    body["choices"][0]["message"] = "hi"


def finish_reason_null(body: dict) -> None:
    body["choices"][0]["finish_reason"] = None


def cached_tokens_a_boolean(body: dict) -> None:
    body["usage"]["prompt_tokens_details"] = {"cached_tokens": True}


def finish_not_a_string(body: dict) -> None:
    body["choices"][0]["finish_reason"] = 5


def cached_tokens_not_an_integer(body: dict) -> None:
    body["usage"]["prompt_tokens_details"] = {"cached_tokens": "3"}


def top_log_probs_not_of_token_ids(body: dict) -> None:
    body["choices"][0]["logprobs"]["content"][0]["top_logprobs"] = [{"token": "hi", "logprob": -1}]


def no_usage(body: dict) -> None:
    del body["usage"]


def usage_without_count(body: dict) -> None:
    body["usage"] = {"prompt_tokens": 3}


@pytest.mark.parametrize(
    "mangle, problem",
    [
        (two_choices, "the answer has 2 choices (one expected)"),
        (no_finish_reason, "the answer did not finish: finish_reason null"),
        (fewer_log_probs, "log-probs are not of its ids: 4 token ids, 3 log-prob entries"),
        (log_probs_of_other_ids, "log-probs are not of its ids: entry 0 is of token 10"),
        (usage_of_other_ids, "usage counts 3 completion tokens, its token_ids 4"),
        (no_usage, "the answer's usage has no completion_tokens"),
        (usage_without_count, "the answer's usage has no completion_tokens"),
        (content_not_a_string, "the answer's choices[0].message.content is 5, not a string"),
        (message_not_an_object, 'the answer\'s choices[0].message is "hi", not an object'),
        (finish_not_a_string, "the answer's choices[0].finish_reason is 5, not a string"),
        (cached_tokens_not_an_integer, 'cached_tokens is "3", not an integer'),
        (top_log_probs_not_of_token_ids, "choices[0].logprobs.content[0] is {"),
        (finish_reason_null, "the answer did not finish: finish_reason null"),
        (cached_tokens_a_boolean, "cached_tokens is true, not an integer"),
    ],
    ids=[
        "two-choices",
        "no-finish",
        "fewer-log-probs",
        "log-probs-of-others",
        "usage",
        "no-usage",
        "usage-without-count",
        "content-number",
        "message-string",
        "finish-number",
        "cached-string",
        "top-log-probs-not-ids",
        "finish-null",
        "cached-boolean",
    ],
)
def test_check_calls_an_unstreamed_answer_the_harness_refuses_an_error(
    tmp_path: Path, monkeypatch, mangle, problem: str
) -> None:
    """The harness refuses these unstreamed answers as broken (parse_chat_response: ERROR);
    check.py judged their ids as if whole, here equal ones: a MATCH, exit 0."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    body = response([1, 2, 3], [7, 8, 9, 10])
    assert judge(EXPECTED, answer(200, body), [], tmp_path)[:2] == ("MATCH", 0)
    mangle(body)
    verdict, code, detail = judge(EXPECTED, answer(200, body), [], tmp_path)
    assert (verdict, code) == ("ERROR", 2), detail
    assert problem in detail


# EXPECTED with a near tie at position 1, a 0.05-nat floor and a policy that passes DRIFT.
NEAR_TIE_EXPECTED = {
    **EXPECTED,
    "top_logprobs": [[[7, -0.5]], [[8, -0.69], [5, -0.70]], [[9, -0.5]], [[10, -0.5]]],
    "token_logprobs": [-0.5, -0.69, -0.5, -0.5],
    "noise_floor_nats": 0.05,
    "policy": "pd-drift",
    "drift_passes": True,
}


def flipped(first_logprob: float = -0.5, prompt: tuple[int, ...] = (1, 2, 3)) -> check.Answer:
    """NEAR_TIE_EXPECTED's answer with the tie at position 1 resolved the other way."""
    tops = [[(7, first_logprob)], [(5, -0.692), (8, -0.698)], [(9, -0.5)], [(10, -0.5)]]
    return answer(200, answer_body(tops, list(prompt)))


def answer_body(tops: list[list[tuple[int, float]]], prompt: list[int]) -> dict[str, Any]:
    """An unstreamed answer generating each position's first top id, with those top-k."""
    content = [
        {
            "token": f"token_id:{top[0][0]}",
            "logprob": top[0][1],
            "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in top],
        }
        for top in tops
    ]
    ids = [top[0][0] for top in tops]
    return {
        "prompt_token_ids": prompt,
        "choices": [
            {"token_ids": ids, "logprobs": {"content": content}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)},
    }


def test_check_judges_drift_as_the_harness_does(tmp_path: Path, monkeypatch) -> None:
    """A near tie at position 1 flipped within the run's 0.05-nat floor after an agreeing
    prefix is DRIFT (passing or not by the case's policy); without a floor, or after a prefix
    whose log-probs moved more than it, the same ids are a MISMATCH."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    expected = NEAR_TIE_EXPECTED
    verdict, code, detail = judge(expected, flipped(), [], tmp_path)
    assert (verdict, code) == ("DRIFT", 0), detail
    assert "pd-drift policy passes it" in detail and "noise floor 0.05 nats" in detail
    exact = {**expected, "policy": "exact", "drift_passes": False}
    assert judge(exact, flipped(), [], tmp_path)[:2] == ("DRIFT", 1)
    no_floor = {**expected, "noise_floor_nats": 0.0}
    assert judge(no_floor, flipped(), [], tmp_path)[:2] == ("MISMATCH", 1)
    assert judge(expected, flipped(-0.6), [], tmp_path)[:2] == ("MISMATCH", 1)


def test_check_reads_no_drift_from_a_near_tie_moved_beyond_the_floor(
    tmp_path: Path, monkeypatch
) -> None:
    """As the harness's judge (`_divergence_delta`): the flipped near tie, but both tokens 2.3
    nats below where the expected answer put them, moved beyond any noise within the floor:
    a MISMATCH, not a DRIFT the pd-drift policy passes (exit 0)."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    tops = [[(7, -0.5)], [(5, -2.992), (8, -2.998)], [(9, -0.5)], [(10, -0.5)]]
    verdict, code, detail = judge(
        NEAR_TIE_EXPECTED, answer(200, answer_body(tops, [1, 2, 3])), [], tmp_path
    )
    assert (verdict, code) == ("MISMATCH", 1), detail
    assert "log-prob delta at the divergence 2.308" in detail


def test_check_reads_no_drift_from_a_gap_beyond_the_floor_of_either_sign(
    tmp_path: Path, monkeypatch
) -> None:
    """As the harness's judge (`max(abs(gap))`): the expected answer picked 8 though its own
    top-k put 5 0.06 nats above it, beyond the 0.05-nat floor. Both tokens moved within the
    floor and the received gap is 0.01, but a gap of either sign beyond the floor is no near
    tie: a MISMATCH, not a DRIFT the pd-drift policy passes (exit 0)."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    expected = {
        **NEAR_TIE_EXPECTED,
        "top_logprobs": [[[7, -0.5]], [[8, -0.74], [5, -0.68]], [[9, -0.5]], [[10, -0.5]]],
        "token_logprobs": [-0.5, -0.74, -0.5, -0.5],
    }
    tops = [[(7, -0.5)], [(5, -0.70), (8, -0.71)], [(9, -0.5)], [(10, -0.5)]]
    verdict, code, detail = judge(expected, answer(200, answer_body(tops, [1, 2, 3])), [], tmp_path)
    assert (verdict, code) == ("MISMATCH", 1), detail
    assert "expected gap -0.060, received gap 0.010" in detail


def relabelled(answer: check.Answer, positions: tuple[int, ...]) -> check.Answer:
    """`answer` with the log-prob entries at `positions` made another token's (its id + 100),
    their log-probs and top-k kept: a batched answer handed another request's log-probs."""
    body = json.loads(answer.text)
    content = body["choices"][0]["logprobs"]["content"]
    for position in positions:
        token = int(content[position]["token"].split(":")[1])
        content[position]["token"] = f"token_id:{token + 100}"
    return check.Answer(answer.url, answer.status, json.dumps(body), answer.seconds)


@pytest.mark.parametrize("positions", [(0,), (1,), (0, 1, 2, 3)])
def test_check_reads_no_drift_from_log_probs_of_other_tokens(
    tmp_path: Path, monkeypatch, positions: tuple[int, ...]
) -> None:
    """As the harness's judge (harness.judge.compare `_logprob_at`, `_top_at`): a log-prob
    entry whose token is not the id generated there is no evidence of closeness, in the
    agreeing prefix (0) or at the divergence (1). Read as if it were, the same numbers made
    the flipped near tie a DRIFT that the pd-drift policy passes (exit 0). An unstreamed
    answer's log-probs of other tokens are, as in the harness (parse_chat_response), a broken
    answer: an ERROR."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    assert judge(NEAR_TIE_EXPECTED, flipped(), [], tmp_path)[:2] == ("DRIFT", 0)
    verdict, code, detail = judge(NEAR_TIE_EXPECTED, relabelled(flipped(), positions), [], tmp_path)
    assert (verdict, code) == ("ERROR", 2), detail
    assert "log-probs are not of its ids" in detail


@pytest.mark.parametrize("received", [math.nan, -math.inf])
def test_check_reads_no_drift_past_a_prefix_log_prob_that_is_not_finite(
    tmp_path: Path, monkeypatch, received: float
) -> None:
    """As the harness's judge (`_prefix_delta`): a prefix position whose log-prob delta is not
    finite (a NaN, or -inf on both sides) agreed by no measure. `max` dropped a NaN that came
    after a finite delta, as if its position had agreed, and the near tie after it passed as
    DRIFT (exit 0)."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    expected = {
        **NEAR_TIE_EXPECTED,
        "token_ids": [7, 9, 8, 10],
        "top_logprobs": [[[7, -0.5]], [[9, -math.inf]], [[8, -0.69], [5, -0.70]], [[10, -0.5]]],
        "token_logprobs": [-0.5, -math.inf, -0.69, -0.5],
    }
    tops = [[(7, -0.5)], [(9, received)], [(5, -0.692), (8, -0.698)], [(10, -0.5)]]
    body = answer_body(tops, [1, 2, 3])
    finite = json.loads(json.dumps(body))
    finite["choices"][0]["logprobs"]["content"][1]["logprob"] = -0.5
    agreeing = {**expected, "token_logprobs": [-0.5, -0.5, -0.69, -0.5]}
    assert judge(agreeing, answer(200, finite), [], tmp_path)[:2] == ("DRIFT", 0)
    verdict, code, detail = judge(expected, answer(200, body), [], tmp_path)
    assert (verdict, code) == ("MISMATCH", 1), detail
    assert "prefix log-prob delta n/a" in detail


def test_a_saved_reference_keeps_no_log_probs_of_other_tokens() -> None:
    """`--save-reference` keeps the reference's log-probs as `--reference` judges drift with
    them: an entry of another token than the id generated there is kept as none (null)."""
    body = json.loads(relabelled(flipped(), (0,)).text)
    kept = check.reference_answer(body, "baseline", {"messages": []})
    assert kept is not None
    assert kept["token_logprobs"][0] is None and kept["top_logprobs"][0] is None
    assert kept["token_logprobs"][1] == -0.692 and kept["top_logprobs"][1] == [
        (5, -0.692),
        (8, -0.698),
    ]


def test_check_never_calls_a_difference_after_other_prompt_ids_drift(
    tmp_path: Path, monkeypatch
) -> None:
    """As the harness's reports (harness.judge.compare.Divergence.drift_not_applicable): the
    near tie that is DRIFT after equal prompt ids is a MISMATCH after other ones, and the
    evidence says the prompts differ, with no drift line claiming otherwise."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    assert judge(NEAR_TIE_EXPECTED, flipped(), [], tmp_path)[0] == "DRIFT"
    verdict, code, detail = judge(NEAR_TIE_EXPECTED, flipped(prompt=(1, 2, 4)), [], tmp_path)
    assert (verdict, code) == ("MISMATCH", 1)
    assert "prompt token ids differ at position 2" in detail and "drift: yes" not in detail


def events(*chunks: object, done: bool = True) -> str:
    """A server-sent event stream of `chunks` (JSON objects, or raw strings as they are)."""
    lines = [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks]
    return "".join(lines) + ("data: [DONE]\n\n" if done else "")


def stream_chunks(prompt: list[int], tokens: list[int]) -> list[dict]:
    """vLLM's chunks with return_token_ids: the role chunk carries the prompt ids, each later
    chunk a generated id and its log-probs, the last one the usage."""
    whole = response(prompt, tokens)["choices"][0]["logprobs"]["content"]
    chunks: list[dict] = [{"prompt_token_ids": prompt, "choices": [{"delta": {"role": "a"}}]}]
    chunks += [
        {"choices": [{"token_ids": [t], "logprobs": {"content": [whole[i]]}}]}
        for i, t in enumerate(tokens)
    ]
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens)}
    chunks.append({"choices": [], "usage": usage})
    return chunks


def streamed(prompt: list[int], tokens: list[int], done: bool = True) -> str:
    return events(*stream_chunks(prompt, tokens), done=done)


def test_check_reads_a_streamed_answer_from_its_events(tmp_path: Path, monkeypatch) -> None:
    """A case the run streamed is sent streamed (found in review: it was sent unstreamed, and
    check.py could not have read the answer)."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])

    def judged(text: str) -> tuple[str, int, str]:
        sent = check.Answer("http://x/v1/chat/completions", 200, text, 0.1)
        return judge(EXPECTED, sent, [], tmp_path, streamed=True)

    assert judged(streamed([1, 2, 3], [7, 8, 9, 10]))[:2] == ("MATCH", 0)
    verdict, code, detail = judged(streamed([1, 2, 3], [7, 5, 9, 10]))
    assert (verdict, code) == ("MISMATCH", 1) and "expected 8, got 5" in detail
    assert "received top-k there: 99: -0.100" in detail
    verdict, code, detail = judged(streamed([1, 2, 3], [7, 8, 9, 10], done=False))
    assert (verdict, code, detail) == ("MISMATCH", 1, "the stream ended without [DONE]")
    verdict, code, detail = judged(events({"error": {"message": "engine dead"}}))
    assert (verdict, code) == ("ERROR", 2) and "engine dead" in detail
    assert judged(events("not json"))[:2] == ("ERROR", 2)  # no prompt ids: no answer


def broken_or_parted(tmp_path: Path, monkeypatch, capsys, record: dict[str, Any], text: str) -> str:
    """What check.py says of a streamed case's failure the harness recorded as `record`
    (its summary.json entry, recorded as the exporter records it), answered with `text`."""
    from harness.run.export.expectation import where_it_failed

    here = tmp_path / "export"
    state = here / "work" / "state"
    state.mkdir(parents=True)
    (here / "request.json").write_text(json.dumps({"messages": [], "stream": True}))
    recorded = {"verdict": record["verdict"], **where_it_failed(record["verdict"], record)}
    (here / "expected.json").write_text(
        json.dumps({**EXPECTED, "what": "a case", "reference": "baseline", "recorded": recorded})
    )
    (state / "endpoints.tsv").write_text(
        "mode\tcase\nentry\thttp://127.0.0.1:9\n"
        "instance\tdecode0\tdecode\thttp://127.0.0.1:9\t\tnone.log\n"
    )
    monkeypatch.setattr(check, "__file__", str(here / "check.py"))
    monkeypatch.setattr(
        check, "post_json", lambda url, *args: check.Answer(url, 200, text, 0.1, check.EVENT_STREAM)
    )
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    assert check.main(["--state", str(state)]) == check.EXIT_DIFFERENCE
    said = [line for line in capsys.readouterr().out.splitlines() if "recorded" in line]
    assert len(said) == 1, said
    return said[0].split("recorded MISMATCH: ", 1)[1]


def test_check_reproduces_a_broken_stream_as_repro_does_not_as_generated_ids(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A stream whose framing broke is that failure whatever its ids did: the harness's
    signature (`signature_of`, which `epd-harness repro`'s `another_failure` compares) says
    "stream framing", not "generated ids". Recorded and read as generated ids, check.py said
    "reproduced" of generated ids parting in a well-framed stream where the framing had
    broken, and of a broken framing where generated ids had parted; repro says NOT reproduced
    of both (found in review)."""
    broken = {
        "verdict": "MISMATCH",
        "detail": STREAM_BROKEN + "the stream ended without [DONE]; identical",
        "divergence": None,
        "guards": {STREAM_CHECK: {"ok": False, "evidence": "the stream ended without [DONE]"}},
    }
    parted = {
        "verdict": "MISMATCH",
        "detail": "generated tokens differ at position 1 of 4/4",
        "divergence": {"index": 1},
        "guards": {STREAM_CHECK: {"ok": True, "evidence": "framed as vLLM frames it"}},
    }
    cut = streamed([1, 2, 3], [7, 8, 9, 10], done=False)
    other = streamed([1, 2, 3], [7, 5, 9, 10])
    cases = [(broken, cut), (broken, other), (parted, cut), (parted, other)]
    said = []
    for number, (record, text) in enumerate(cases):
        said.append(broken_or_parted(tmp_path / str(number), monkeypatch, capsys, record, text))
    assert said == [
        "reproduced",
        "NOT reproduced (generated ids now, stream framing in the recording)",
        "NOT reproduced (stream framing now, generated ids in the recording)",
        "reproduced",
    ]


@pytest.mark.parametrize(
    "text, problem",
    [
        (streamed([1, 2, 3], [7, 8, 9, 10]) + "data: {}\n\n", "an event after [DONE]"),
        (
            events(
                *stream_chunks([1, 2, 3], [7, 8, 9, 10])[:2],
                "not json",
                *stream_chunks([1, 2, 3], [7, 8, 9, 10])[2:],
            ),
            "event 3 is not JSON",
        ),
        (
            events(
                *stream_chunks([1, 2, 3], [7, 8, 9, 10])[:2],
                "[8]",
                *stream_chunks([1, 2, 3], [7, 8, 9, 10])[2:],
            ),
            "event 3 is not a JSON object",
        ),
    ],
    ids=["after-done", "not-json", "not-an-object"],
)
def test_check_calls_a_stream_with_a_stray_event_a_difference_as_the_harness_does(
    tmp_path: Path, monkeypatch, text: str, problem: str
) -> None:
    """The harness keeps an event after [DONE], or one that does not parse as a JSON object,
    as a framing problem of a stream that carried its answer (harness/outcomes/stream.py):
    a MISMATCH, as check.py's own reader says of `[DONE]` not last. check.py called it an
    ERROR, exit 2, and a recorded MISMATCH NOT reproduced."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    verdict, code, detail = judged_stream(text, tmp_path)
    assert (verdict, code) == ("MISMATCH", 1), detail
    assert problem in detail


def test_check_reads_an_event_of_two_data_lines_as_one_event_as_the_harness_does(
    tmp_path: Path, monkeypatch
) -> None:
    """An SSE event's `data:` lines are one datum, joined by newlines (the harness's
    `event_data`): two chunks sent in one event do not parse, a framing problem (MISMATCH).
    check.py read each `data:` line as an event of its own and said MATCH."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    chunks = stream_chunks([1, 2, 3], [7, 8, 9, 10])
    joined = f"data: {json.dumps(chunks[1])}\ndata: {json.dumps(chunks[2])}\n\n"
    text = events(chunks[0], done=False) + joined + events(*chunks[3:])
    verdict, code, detail = judged_stream(text, tmp_path)
    assert (verdict, code) == ("MISMATCH", 1), detail
    assert "event 2 is not JSON" in detail


def first_token_choice(**fields: object) -> list[dict]:
    """The stream of EXPECTED's answer with `fields` of its first token chunk's (event 2's)
    choice replaced."""
    chunks = stream_chunks([1, 2, 3], [7, 8, 9, 10])
    chunks[1]["choices"][0].update(fields)
    return chunks


def first_token_chunk(**fields: object) -> list[dict]:
    """The stream of EXPECTED's answer with `fields` of its first token chunk (event 2)
    replaced."""
    chunks = stream_chunks([1, 2, 3], [7, 8, 9, 10])
    chunks[1].update(fields)
    return chunks


def judged_stream(text: str, tmp_path: Path) -> tuple[str, int, str]:
    sent = check.Answer("http://x/v1/chat/completions", 200, text, 0.1)
    return judge(EXPECTED, sent, [], tmp_path, streamed=True)


@pytest.mark.parametrize(
    "chunks, problem",
    [
        (first_token_chunk(choices=[None]), "choices[0] is null, not an object"),
        (first_token_chunk(choices={}), "choices is {}, not a list"),
        (first_token_choice(delta="t8"), 'choices[0].delta is "t8", not an object'),
        (first_token_choice(delta={"content": 8}), "choices[0].delta.content is 8, not a"),
        (first_token_choice(token_ids=5), "choices[0].token_ids is 5, not a list of integers"),
        (first_token_choice(token_ids=["8"]), 'choices[0].token_ids is ["8"], not a list of'),
        (first_token_choice(token_ids=[True]), "choices[0].token_ids is [true], not a list of"),
        (first_token_choice(logprobs=[None]), "choices[0].logprobs is [null], not an object"),
        (first_token_choice(logprobs={"content": 1}), "choices[0].logprobs.content is 1, not a"),
        (first_token_choice(logprobs={"content": [None]}), "choices[0].logprobs.content[0] is"),
        (first_token_choice(finish_reason=1), "choices[0].finish_reason is 1, not a string"),
    ],
    ids=[
        "choice-null",
        "choices-object",
        "delta-string",
        "content-number",
        "ids-number",
        "ids-strings",
        "ids-booleans",
        "logprobs-list",
        "logprob-entries-number",
        "logprob-entry-null",
        "finish-number",
    ],
)
def test_check_calls_a_malformed_stream_chunk_a_difference_naming_its_event(
    tmp_path: Path, monkeypatch, chunks: list[dict], problem: str
) -> None:
    """As the harness's reader (harness/outcomes/stream.py): a chunk of another shape than
    vLLM's made check.py raise (AttributeError, TypeError: a traceback, exit 1 from Python,
    read as a reproduced MISMATCH) or read booleans as ids; it is a framing problem naming its
    event, the chunk is not read, and the answer is a MISMATCH, exit 1."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    verdict, code, detail = judged_stream(events(*chunks), tmp_path)
    assert (verdict, code) == ("MISMATCH", 1), detail
    assert f"event 2: {problem}" in detail


@pytest.mark.parametrize("finish", ["abort", "error"])
@pytest.mark.parametrize("streamed", [False, True], ids=["unstreamed", "streamed"])
def test_check_calls_an_answer_that_did_not_finish_an_error_as_the_harness_does(
    tmp_path: Path, monkeypatch, finish: str, streamed: bool
) -> None:
    """The harness fails an answer ended by an abort or an engine error as no answer
    (harness/outcomes/chat.py's `unfinished`: ERROR); check.py compared its ids, as short as
    the end made them: here equal ones, a MATCH, exit 0."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    if streamed:
        chunks = stream_chunks([1, 2, 3], [7, 8, 9, 10])
        chunks[-2]["choices"][0]["finish_reason"] = finish
        verdict, code, detail = judged_stream(events(*chunks), tmp_path)
    else:
        body = response([1, 2, 3], [7, 8, 9, 10])
        body["choices"][0]["finish_reason"] = finish
        verdict, code, detail = judge(EXPECTED, answer(200, body), [], tmp_path)
    assert (verdict, code) == ("ERROR", 2), detail
    assert f'finish_reason "{finish}"' in detail


def stream_without_finish(chunks: list[dict]) -> None:
    del chunks[-2]["choices"][0]["finish_reason"]


def stream_chunk_of_two_choices(chunks: list[dict]) -> None:
    chunks[1]["choices"].append({"index": 1, "delta": {"content": ""}})


def stream_log_probs_of_another_id(chunks: list[dict]) -> None:
    chunks[1]["choices"][0]["logprobs"] = chunks[2]["choices"][0]["logprobs"]


def stream_usage_of_other_ids(chunks: list[dict]) -> None:
    chunks[-1]["usage"]["completion_tokens"] = 3


def stream_without_usage(chunks: list[dict]) -> None:
    del chunks[-1]


def stream_prompt_ids_later(chunks: list[dict]) -> None:
    chunks[1]["prompt_token_ids"] = chunks[0].pop("prompt_token_ids")


def stream_of_another_choice(chunks: list[dict]) -> None:
    for chunk in chunks:
        for choice in chunk["choices"]:
            choice["index"] = 1


def stream_of_two_choices_interleaved(chunks: list[dict]) -> None:
    chunks[2]["choices"][0]["index"] = 1


def stream_usage_before_the_last_token(chunks: list[dict]) -> None:
    chunks.insert(-2, chunks.pop())


def stream_usage_twice(chunks: list[dict]) -> None:
    chunks.append(dict(chunks[-1]))


def stream_chunk_after_the_finish(chunks: list[dict]) -> None:
    chunks[-3]["choices"][0]["finish_reason"] = chunks[-2]["choices"][0].pop("finish_reason")


def stream_of_two_completions(chunks: list[dict]) -> None:
    for number, chunk in enumerate(chunks):
        chunk["id"] = "chatcmpl-a" if number < 2 else "chatcmpl-b"


def stream_usage_of_another_prompt(chunks: list[dict]) -> None:
    chunks[-1]["usage"]["prompt_tokens"] = 2


def stream_cached_tokens_not_an_integer(chunks: list[dict]) -> None:
    chunks[-1]["usage"]["prompt_tokens_details"] = {"cached_tokens": "3"}


def stream_role_again(chunks: list[dict]) -> None:
    chunks[1]["choices"][0]["delta"] = {"role": "a"}


def stream_without_role(chunks: list[dict]) -> None:
    del chunks[0]["choices"][0]["delta"]["role"]


def stream_of_a_boolean_choice_index(chunks: list[dict]) -> None:
    chunks[1]["choices"][0]["index"] = False


def stream_cached_tokens_a_boolean(chunks: list[dict]) -> None:
    chunks[-1]["usage"]["prompt_tokens_details"] = {"cached_tokens": True}


def stream_without_log_probs(chunks: list[dict]) -> None:
    chunks[1]["choices"][0]["logprobs"] = {"content": []}


def stream_chunk_without_choices(chunks: list[dict]) -> None:
    chunks.insert(1, {"choices": []})


def stream_role_later(chunks: list[dict]) -> None:
    del chunks[0]["choices"][0]["delta"]["role"]
    chunks[1]["choices"][0]["delta"] = {"role": "a"}


@pytest.mark.parametrize(
    "mangle, problem",
    [
        (stream_without_finish, "0 finish_reason(s) (one expected)"),
        (stream_chunk_of_two_choices, "event 2 has 2 choices (one expected)"),
        (stream_log_probs_of_another_id, "event 2: log-prob entry 0 is of token 8, its id is 7"),
        (stream_usage_of_other_ids, "usage counts 3 completion tokens, the stream carried 4"),
        (stream_without_usage, "no usage chunk"),
        (stream_prompt_ids_later, "event 2 carries prompt_token_ids, not the first chunk"),
        (stream_role_again, "2 role chunks (one expected)"),
        (stream_without_role, "0 role chunks (one expected)"),
        (stream_role_later, "event 2 carries the role, not the first chunk"),
        (stream_of_another_choice, "event 1: choices[0].index is 1, not 0"),
        (stream_of_two_choices_interleaved, "event 3: choices[0].index is 1, not 0"),
        (stream_usage_before_the_last_token, "event 6 comes after the usage chunk"),
        (stream_usage_twice, "event 7 is a second usage chunk"),
        (stream_chunk_after_the_finish, "event 5 comes after finish_reason"),
        (stream_of_two_completions, "chunks of 2 completions"),
        (stream_usage_of_another_prompt, "usage counts 2 prompt tokens, the stream's prompt"),
        (stream_cached_tokens_not_an_integer, 'cached_tokens is "3", not an integer'),
        (stream_of_a_boolean_choice_index, "event 2: choices[0].index is false, not 0"),
        (stream_chunk_without_choices, "event 2 has 0 choices (one expected)"),
        (stream_cached_tokens_a_boolean, "cached_tokens is true, not an integer"),
        (stream_without_log_probs, "event 2: 1 token id(s) but 0 log-prob entries"),
    ],
    ids=[
        "no-finish",
        "two-choices",
        "log-probs-of-another",
        "usage",
        "no-usage",
        "prompt-later",
        "role-again",
        "no-role",
        "role-later",
        "another-choice",
        "two-choices-interleaved",
        "usage-early",
        "usage-twice",
        "after-finish",
        "two-completions",
        "usage-of-another-prompt",
        "cached-string",
        "boolean-index",
        "no-choices",
        "cached-boolean",
        "no-log-probs",
    ],
)
def test_check_calls_a_stream_the_harness_finds_framed_wrong_a_difference(
    tmp_path: Path, monkeypatch, mangle, problem: str
) -> None:
    """The harness keeps each of these as a framing problem of the stream
    (harness/outcomes/stream.py: a MISMATCH whatever its ids); check.py read the ids alone,
    here equal ones: a MATCH, exit 0."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    chunks = stream_chunks([1, 2, 3], [7, 8, 9, 10])
    assert judged_stream(events(*chunks), tmp_path)[:2] == ("MATCH", 0)
    mangle(chunks)
    verdict, code, detail = judged_stream(events(*chunks), tmp_path)
    assert (verdict, code) == ("MISMATCH", 1), detail
    assert problem in detail


def test_check_reads_usage_on_token_chunks_as_token_chunks(tmp_path: Path, monkeypatch) -> None:
    """vLLM's `continuous_usage_stats` puts a usage on every chunk that has choices: those are
    token chunks still (as the harness's stream reader takes them), and the stream is whole;
    only the last chunk, with no choices, is the usage chunk."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    chunks = stream_chunks([1, 2, 3], [7, 8, 9, 10])
    for number, chunk in enumerate(chunks[1:-1], start=1):
        chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": number}
    verdict, code, detail = judged_stream(events(*chunks), tmp_path)
    assert (verdict, code) == ("MATCH", 0), detail


def test_check_reads_no_drift_without_a_noise_floor_even_from_an_exact_tie(
    tmp_path: Path, monkeypatch
) -> None:
    """A run that measured no noise floor (0) leaves no room for drift: even a tie resolved
    the other way at equal log-probs, after an equal prefix, is a MISMATCH, as the harness
    judges it; read as within a floor of 0 it passed as DRIFT (exit 0 under pd-drift)."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    expected = {
        **NEAR_TIE_EXPECTED,
        "top_logprobs": [[[7, -0.5]], [[8, -0.69], [5, -0.69]], [[9, -0.5]], [[10, -0.5]]],
        "noise_floor_nats": 0,
    }
    tops = [[(7, -0.5)], [(5, -0.69), (8, -0.69)], [(9, -0.5)], [(10, -0.5)]]
    verdict, code, detail = judge(expected, answer(200, answer_body(tops, [1, 2, 3])), [], tmp_path)
    assert (verdict, code) == ("MISMATCH", 1), detail
    assert "no room for drift" in detail


def test_check_calls_a_stream_whose_last_event_is_unterminated_a_difference(
    tmp_path: Path, monkeypatch
) -> None:
    """The harness keeps an event the stream ends without its blank line as a framing problem
    (an SSE client, the openai one among them, drops it: here the [DONE]); check.py read
    the text line by line, and called the stream whole, a MATCH."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    text = streamed([1, 2, 3], [7, 8, 9, 10])
    assert judged_stream(text, tmp_path)[:2] == ("MATCH", 0)
    verdict, code, detail = judged_stream(text.removesuffix("\n\n"), tmp_path)
    assert (verdict, code) == ("MISMATCH", 1), detail
    assert "without the blank line that ends an event" in detail


def test_check_calls_a_malformed_chunk_among_whole_ones_a_mismatch_not_a_match(
    tmp_path: Path, monkeypatch
) -> None:
    """The ids the other chunks carried equal the expected ones; the stream is still broken."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    whole = stream_chunks([1, 2, 3], [7, 8, 9, 10])
    text = events(whole[0], {"choices": [None]}, *whole[1:])
    verdict, code, detail = judged_stream(text, tmp_path)
    assert (verdict, code) == ("MISMATCH", 1)
    assert "event 2: choices[0] is null, not an object" in detail


def test_check_calls_unreadable_streamed_prompt_ids_an_error_saying_so(
    tmp_path: Path, monkeypatch
) -> None:
    """The harness fails such a stream (StreamFailed: ERROR): no prompt ids, no answer."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    chunks = stream_chunks([1, 2, 3], [7, 8, 9, 10])
    chunks[0]["prompt_token_ids"] = ["1", "2", "3"]
    verdict, code, detail = judged_stream(events(*chunks), tmp_path)
    assert (verdict, code) == ("ERROR", 2)
    assert 'event 1: prompt_token_ids is ["1", "2", "3"], not a list of integers' in detail


def test_check_calls_a_stream_without_prompt_ids_an_error_as_the_harness_does(
    tmp_path: Path, monkeypatch
) -> None:
    """The harness fails a stream that carried no prompt_token_ids at all (StreamFailed:
    ERROR, "was return_token_ids honoured?"), as one whose prompt ids it cannot read; check.py
    called it a MISMATCH, exit 1, and a recorded ERROR NOT reproduced."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    chunks = stream_chunks([1, 2, 3], [7, 8, 9, 10])
    del chunks[0]["prompt_token_ids"]
    verdict, code, detail = judged_stream(events(*chunks), tmp_path)
    assert (verdict, code) == ("ERROR", 2), detail
    assert "the stream carried no prompt_token_ids" in detail


def test_check_calls_a_stream_served_as_json_a_difference_as_the_harness_does(
    tmp_path: Path, monkeypatch
) -> None:
    """The harness fails a streamed answer whose content type is not text/event-stream
    (harness/outcomes/stream.py: vLLM's toy P/D proxy serves application/json); check.py read
    only the events, so the export of that case said MATCH, exit 0 (found in review)."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    text = streamed([1, 2, 3], [7, 8, 9, 10])

    def judged(content_type: str | None) -> tuple[str, int, str]:
        sent = check.Answer("http://x/v1/chat/completions", 200, text, 0.1, content_type)
        return judge(EXPECTED, sent, [], tmp_path, streamed=True)

    assert judged("text/event-stream; charset=utf-8")[:2] == ("MATCH", 0)
    assert judged(None)[:2] == ("MATCH", 0)  # not known: judged on the events alone
    verdict, code, detail = judged("application/json")
    assert (verdict, code) == ("MISMATCH", 1)
    assert detail.startswith("served as application/json, not text/event-stream"), detail
    verdict, code, detail = judged("")
    assert (verdict, code) == ("MISMATCH", 1) and "served as no content-type" in detail


def test_check_says_drift_does_not_apply_to_a_stream_whose_framing_is_broken(
    tmp_path: Path, monkeypatch
) -> None:
    """As the harness's reports (harness.judge.compare.Divergence.drift_not_applicable): the
    near tie that is DRIFT streamed whole is a MISMATCH streamed without [DONE], and its
    evidence read "drift: yes" beside the verdict (found in review)."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    body = json.loads(flipped().text)
    choice = body["choices"][0]
    chunks = [{"prompt_token_ids": body["prompt_token_ids"], "choices": [{"delta": {"role": "a"}}]}]
    chunks += [
        {"choices": [{"token_ids": [t], "logprobs": {"content": [entry]}}]}
        for t, entry in zip(choice["token_ids"], choice["logprobs"]["content"])
    ]
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    usage = {"prompt_tokens": 3, "completion_tokens": len(choice["token_ids"])}
    chunks.append({"choices": [], "usage": usage})

    def judged(text: str) -> tuple[str, int, str]:
        sent = check.Answer("http://x/v1/chat/completions", 200, text, 0.1)
        return judge(NEAR_TIE_EXPECTED, sent, [], tmp_path, streamed=True)

    assert judged(events(*chunks))[:2] == ("DRIFT", 0)
    verdict, code, detail = judged(events(*chunks, done=False))
    assert (verdict, code) == ("MISMATCH", 1)
    assert "drift: no (not applicable: the stream framing is broken" in detail
    assert "drift: yes" not in detail


@pytest.mark.parametrize(
    "scenario, run_streams, streams, unlike",
    [
        ("epd-streamed", False, True, "after the scenario's earlier requests"),
        ("ec-concurrent-requests", False, False, "in flight together with its other requests"),
        ("ec-rerun-on-kept-storage", True, True, "again on the storage a first session left"),
        ("epd-media-in-decode-tail", False, False, None),
    ],
)
def test_a_case_is_exported_as_the_run_sent_it_and_says_what_it_does_not_redo(
    tmp_path: Path, scenario: str, run_streams: bool, streams: bool, unlike: str | None
) -> None:
    """Streamed when the run or the scenario streamed (requests.json holds the body before
    streaming); what one request alone cannot redo is said in ISSUE.md."""
    from harness.run.scenarios import get_scenario

    topology = get_scenario(scenario).topology
    bundle_dir = write_bundle(tmp_path / "run", topology, "MISMATCH", scenario=scenario)
    run = json.loads((bundle_dir / "run.json").read_text())
    (bundle_dir / "run.json").write_text(json.dumps({**run, "stream": run_streams}))
    plan = plan_for(bundle_dir)
    assert plan.request.get("stream", False) is streams
    assert (plan.request.get("stream_options") == {"include_usage": True}) is streams
    issue = render_issue(plan)
    if unlike is None:
        assert plan.sent_unlike is None and "Not as the run sent it" not in issue
    else:
        assert f"Not as the run sent it: scenario {scenario} sent it {unlike}" in issue


def test_check_calls_a_dead_instance_an_error_naming_it(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "decode0.log"
    log.write_text("starting\nAssertionError: Expected number of multimodal embeddings\nbye\n")
    (tmp_path / "decode0.exit").write_text("0\n")
    dead = check.Instance("decode0", "decode", "http://127.0.0.1:1", None, str(log))
    alive = check.Instance("prefill0", "prefill", "http://127.0.0.1:2", None, str(log))
    monkeypatch.setattr(check, "healthy", lambda url: url.endswith(":2"))
    verdict, code, detail = judge(
        EXPECTED, answer(502, {"error": "bad gateway"}), [alive, dead], tmp_path
    )
    assert (verdict, code) == ("ERROR", 2)
    assert detail.startswith("decode0 died during the request")
    assert "decode0 (decode, http://127.0.0.1:1) exited with code 0" in detail
    assert "AssertionError: Expected number of multimodal embeddings" in detail
    assert "prefill0" not in detail.split("\n", 1)[0]


@pytest.mark.parametrize(
    "alive, state",
    [
        (False, "exited"),
        (True, "is running but its /health does not answer 200"),
        (None, "is running but its /health does not answer 200"),
    ],
)
def test_check_says_whether_a_down_instance_exited_or_still_runs(
    tmp_path: Path, monkeypatch, alive: bool | None, state: str
) -> None:
    """Without serve.sh's exit file the report rests on the process: one that is gone
    "exited", one that runs (or is not ours to signal) hangs without answering /health. Said
    the other way round, an upstream developer looks for a crash in a server that hangs."""
    log = tmp_path / "decode0.log"
    log.write_text("stuck\n")
    instance = check.Instance("decode0", "decode", "http://127.0.0.1:1", 7, str(log))
    monkeypatch.setattr(check, "healthy", lambda url: False)
    monkeypatch.setattr(check, "process_alive", lambda pid: alive)
    monkeypatch.setattr(check, "EXIT_WAIT_S", 0.0)
    report = check.down_report(instance, tmp_path)
    assert report is not None
    assert report.startswith(f"decode0 (decode, http://127.0.0.1:1) {state}; evidence"), report


def test_check_knows_a_live_process_from_a_gone_one() -> None:
    """A running pid is alive; no pid is unknown, not gone: read as gone, an instance whose
    endpoints.tsv line has no pid "exited" while it hangs."""
    assert check.process_alive(os.getpid()) is True
    assert check.process_alive(None) is None


def test_check_names_an_instance_that_goes_down_only_after_a_failed_answer(
    tmp_path: Path, monkeypatch
) -> None:
    """vLLM answers a request its dead engine failed with a 500, and its API server still
    answers /health a moment before it goes down: after a failed answer check.py looks again
    (DEATH_GRACE_S) before it says nobody died, or the death went unnamed."""
    log = tmp_path / "decode0.log"
    log.write_text("ERROR EngineCore failed: no embeddings\n")
    (tmp_path / "decode0.exit").write_text("0\n")
    dying = check.Instance("decode0", "decode", "http://127.0.0.1:1", None, str(log))
    checks: list[str] = []

    def healthy(url: str) -> bool:  # still up at the first look after the answer, then down
        checks.append(url)
        return len(checks) == 1

    monkeypatch.setattr(check, "healthy", healthy)
    verdict, code, detail = judge(
        EXPECTED,
        answer(500, {"error": {"message": "EngineCore encountered an issue"}}),
        [dying],
        tmp_path,
    )
    assert (verdict, code) == ("ERROR", 2)
    assert detail.startswith("decode0 died during the request"), detail
    assert "decode0 (decode, http://127.0.0.1:1) exited with code 0" in detail


def test_check_judges_a_probe_by_refusal_and_survival(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    probe = {"check": "refused-and-alive", "send_to": "decode0"}
    assert judge(probe, answer(400, {}), [], tmp_path)[:2] == ("MATCH", 0)
    assert judge(probe, answer(200, {}), [], tmp_path)[:2] == ("MISMATCH", 1)
    assert judge(probe, answer(500, {}), [], tmp_path)[:2] == ("ERROR", 2)


def test_an_errors_evidence_is_cut_to_exceptions_and_exits() -> None:
    error = "\n".join(
        [
            "InternalServerError: Error code: 502",
            "--- 1E+1P+1D/decode0 logged during the request ---",
            "(Worker pid=1) ERROR [x.py:1] Traceback (most recent call last):",
            '(Worker pid=1) ERROR [x.py:1]   File "/site/vllm/worker.py", line 3, in run',
            "(Worker pid=1) ERROR [x.py:1] AssertionError: Expected number of embeddings",
            "(Worker pid=1) ERROR [x.py:1] AssertionError: Expected number of embeddings",
            'INFO:     127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
            "(APIServer pid=2) INFO [core_client.py:7] [shutdown] MPClient: complete",
            "instance 1E+1P+1D/decode0 exited with code 0; last lines of d.log:",
        ]
    )
    assert condensed_error(error) == [
        "InternalServerError: Error code: 502",
        "--- 1E+1P+1D/decode0 logged during the request ---",
        "(Worker pid=1) ERROR [x.py:1] AssertionError: Expected number of embeddings",
        'INFO:     127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
        "instance 1E+1P+1D/decode0 exited with code 0; last lines of d.log:",
    ]


def test_a_probe_names_only_the_connector_its_consumer_runs(tmp_path: Path) -> None:
    plan = plan_for(write_bundle(tmp_path / "run"), probe=UNKNOWN_UUID_PROBE)
    text = render_issue(plan)
    assert "EPD 1E+1P+1D (ExampleConnector): " in text.splitlines()[0]
    assert "- EC connector: ECExampleConnector (not used by this case)" in text
    assert "the request goes straight to decode0" in text


def test_a_topology_without_an_encoder_names_no_ec_connector(tmp_path: Path) -> None:
    """1P+1D's prefill runs no EC connector, yet was counted an EC consumer by its role:
    the title read `EPD 1P+1D (ExampleConnector, ECExampleConnector)` (found in review)."""
    plan = plan_for(write_bundle(tmp_path / "run", topology="1P+1D", verdict="MISMATCH"))
    text = render_issue(plan)
    assert "EPD 1P+1D (ExampleConnector): output differs" in text.splitlines()[0], text
    assert "- EC connector: ECExampleConnector (not used by this case)" in text
    assert "- KV connector: ExampleConnector\n" in text


def test_check_cuts_a_log_to_exception_messages_and_its_tail() -> None:
    log = "\n".join(
        [
            "loading",
            "(Worker) ERROR Traceback (most recent call last):",
            '(Worker) ERROR   File "/site/vllm/utils.py", line 701, in sanity_check',
            "(Worker) ERROR AssertionError: Expected number of multimodal embeddings",
            "(Worker) ERROR AssertionError: Expected number of multimodal embeddings",
            '"POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
            "Shutting down",
        ]
    )
    lines = check.evidence(log).splitlines()
    picked = lines[: lines.index("...")]
    assert picked == [
        "(Worker) ERROR AssertionError: Expected number of multimodal embeddings",
        '"POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
    ]
    assert lines[-1] == "Shutting down"  # then the log's last lines


def test_checks_log_tail_leaves_out_nanobinds_leak_report_and_says_so() -> None:
    """Real vLLM (an exported probe of 1E+1P+1D): the tail of a dead D's evidence was its
    shutdown and nanobind's report of what Triton leaked at exit, as every vLLM process where
    Triton is installed prints it; the shutdown lines are what show how it ended."""
    log = "\n".join(
        [
            "(EngineCore) ERROR AssertionError: Expected number of multimodal embeddings",
            "INFO:     Application shutdown complete.",
            "nanobind: leaked 1207 instances!",
            ' - leaked instance 0x7f39d5a3d0a8 of type "triton._C.libtriton.ir.attribute"',
            "nanobind: leaked 514 functions!",
            ' - leaked function "create_fdiv"',
            " - ... skipped remainder",
            "nanobind: this is likely caused by a reference counting issue in the binding code.",
            "See https://nanobind.readthedocs.io/en/latest/refleaks.html",
        ]
    )
    lines = check.evidence(log).splitlines()
    assert lines[lines.index("...") + 1 :] == [
        "INFO:     Application shutdown complete.",
        "[7 lines of nanobind's leak report at exit left out]",
    ], lines


def test_the_baseline_is_rendered_with_the_runs_flags_when_it_came_from_the_cache(
    tmp_path: Path,
) -> None:
    plan = plan_for(write_bundle(tmp_path / "run"))  # the synthetic run started no baseline
    assert plan.baseline is not None and plan.baseline.name == "baseline0"
    words = [shell_word(arg) for arg in plan.baseline.argv]
    assert words[:3] == ['"${VLLM}"', "serve", '"${MODEL}"']
    assert words[words.index("--port") + 1] == '"${BASELINE0_PORT}"'
    assert not any("transfer-config" in word for word in words)
    serve = render_serve_sh(plan)
    assert "  baseline) ;;" not in serve and "  case|reference|baseline) ;;" in serve
    probe = plan_for(write_bundle(tmp_path / "probe"), probe=UNKNOWN_UUID_PROBE)
    assert probe.baseline is None and "  case) ;;" in render_serve_sh(probe)


@pytest.mark.parametrize("pre_pool_layout", [False, True])
def test_a_matrix_case_is_exported_from_either_session_layout(
    tmp_path: Path, pre_pool_layout: bool
) -> None:
    """The pool serves a matrix scenario on the sweep's `<topology>/`; older bundles kept the
    matrix's own `matrix-<topology>/`: both give every instance's command."""
    out = write(tmp_path, scenario="epd-media-in-decode-tail", pre_pool_layout=pre_pool_layout)
    serve = (out / "serve.sh").read_text()
    for instance in ("ENCODER0", "PREFILL0", "DECODE0"):
        assert f'"http://${{HOST}}:${{{instance}_PORT}}"' in serve


def test_issue_md_names_no_path_of_the_recording_host(tmp_path: Path) -> None:
    """ISSUE.md of a real export carried the recording host's run directory twice: the
    harness's `--run-dir /work/redcase-runs/jpeg` under "How it was found", and a dead
    instance's log `/work/redcase-runs/kill/1P-1D/1P-1D__decode0.log` under "What happened".
    Paths nobody upstream can open; the run's own name says the same."""
    bundle = write_bundle(tmp_path / "run", verdict="ERROR", scenario="epd-media-in-decode-tail")
    run = json.loads((bundle / "run.json").read_text())
    run["harness_argv"] = ["epd-harness", "run", "--run-dir", str(bundle)]
    (bundle / "run.json").write_text(json.dumps(run))
    log = bundle / "1E-1P-1D" / "1E-1P-1D__decode0.log"
    for name in ("summary.json", "responses.json"):
        text = (bundle / name).read_text().replace("/x/decode0.log", str(log))
        (bundle / name).write_text(text)
    out = tmp_path / "export"
    write_export(plan_for(bundle, f"1E+1P+1D:{PROMPT}"), out, {"cpu_repair.py": "#\n"})
    issue = (out / "ISSUE.md").read_text()
    assert str(tmp_path) not in issue
    assert "--run-dir run`" in issue
    assert "(its log: run/1E-1P-1D/1E-1P-1D__decode0.log)" in issue


# -- a scenario's earlier requests, sent first -------------------------------------------------

KILLS_PREFILL = "epd-kv-lookup-miss-kills-prefill"


@pytest.mark.parametrize(
    "scenario, prompt, earlier, run_streams",
    [
        (KILLS_PREFILL, "m-text-at-block-plus-one", ("m-text-stores-the-lookup-key",), False),
        (
            "ec-same-image-across-kwargs",
            "m-kwargs-image-36-tokens",
            ("m-kwargs-image-plain", "m-kwargs-image-16-tokens"),
            False,
        ),
        ("epd-streamed", "m-text-only", ("m-one-image", "m-video-mp4"), False),  # it streams
        ("ec-same-image-across-requests", "m-repeat-b", ("m-repeat-a",), True),  # --stream
    ],
)
def test_a_later_case_carries_its_scenarios_earlier_requests_as_the_run_sent_them(
    tmp_path: Path, scenario: str, prompt: str, earlier: tuple[str, ...], run_streams: bool
) -> None:
    """An export of epd-kv-lookup-miss-kills-prefill's second case sent its request alone to
    fresh servers, where P has no folder of the shorter key to find and lives: vLLM alone
    could not show the ERROR, and ISSUE.md said only "Not as the run sent it". The earlier
    requests travel as `before/NN-<prompt>.json`, in the scenario's order: requests.json's
    bodies as they are (keys in their order), streamed as the run streamed the case, each
    and the case's under a cache salt of its own, as the run sent each; ISSUE.md says which."""
    from harness.run.export.request import CASE_SALT
    from harness.run.scenarios import get_scenario
    from harness.spec.prompts import CACHE_SALT, streaming_request

    root = write_scenario_bundle(tmp_path / "run", scenario, prompt)
    run = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**run, "stream": run_streams}))
    recorded = json.loads((root / "requests.json").read_text())
    plan = plan_for(root)
    files = [f"before/{n:02d}-{name}.json" for n, name in enumerate(earlier, start=1)]
    assert [(e.prompt, e.file) for e in plan.before] == list(zip(earlier, files))
    streams = run_streams or get_scenario(scenario).stream
    out = tmp_path / "export"
    write_export(plan, out, REPAIR)
    salts = []
    for name, file in zip(earlier, files):
        text = (out / file).read_text()
        sent = json.loads(text)
        salts.append(sent.pop(CACHE_SALT))
        as_run = streaming_request(recorded[name]) if streams else recorded[name]
        assert json.dumps(sent) == json.dumps(as_run), file  # its keys in their order too
        assert text == json.dumps({**as_run, CACHE_SALT: salts[-1]}, indent=1) + "\n"
    case = json.loads((out / "request.json").read_text())
    assert case[CACHE_SALT] == CASE_SALT and len({*salts, CASE_SALT}) == len(earlier) + 1
    assert sorted(p.name for p in (out / "before").iterdir()) == [f[7:] for f in files]
    assert plan.sent_unlike is None
    issue = (out / "ISSUE.md").read_text()
    said = "request" if len(earlier) == 1 else "requests"
    assert (
        f"Sent as the run sent it: after scenario {scenario}'s earlier {said} "
        f"{', '.join(earlier)} on the same servers, which `check.py` sends first (`before/`)"
    ) in issue
    assert "Not as the run sent it" not in issue
    assert all(f"| `{file}` |" in issue for file in files)
    assert f"So `check.py` first sends `{files[0]}` ({earlier[0]}: " in issue
    requests = "request" if len(earlier) == 1 else f"{len(earlier)} requests"
    assert f"check.py first sends the {requests} in before/" in (out / "run.sh").read_text()
    assert "Each file carries a `cache_salt` of its own: without one" in issue
    assert "each under a cache salt of its own, as the run's found nothing" in issue
    # A fuzz follow-up went under its earlier turn's salt (its bundle says so): ISSUE.md too.
    import dataclasses

    from harness.run.export.issue import salts_said

    turns = dataclasses.replace(
        plan,
        request={**plan.request, CACHE_SALT: "epd-fuzz-unsalted"},
        before=tuple(
            dataclasses.replace(e, body={**e.body, CACHE_SALT: "epd-fuzz-unsalted"})
            for e in plan.before
        ),
    )
    assert salts_said(turns).startswith(
        "The files under the `cache_salt` 'epd-fuzz-unsalted' share it, as the run sent"
    )
    issue = render_issue(turns)
    assert "under the cache salt 'epd-fuzz-unsalted' they shared in the run." in issue


def test_the_first_prompt_of_a_scenario_carries_no_earlier_request(tmp_path: Path) -> None:
    """The run sent it first: the export sends it alone, as today, and claims nothing."""
    plan = plan_for(
        write_scenario_bundle(tmp_path / "run", KILLS_PREFILL, "m-text-stores-the-lookup-key")
    )
    assert (plan.before, plan.sent_after, plan.sent_unlike) == ((), None, None)
    assert "cache_salt" not in plan.request
    out = tmp_path / "export"
    write_export(plan, out, REPAIR)
    assert not (out / "before").exists()
    issue = (out / "ISSUE.md").read_text()
    assert "Sent as the run sent it" not in issue and "Not as the run sent it" not in issue
    assert "check.py first sends" not in (out / "run.sh").read_text()


@pytest.mark.parametrize(
    "scenario, prompt, unlike",
    [
        ("ec-concurrent-requests", "m-concurrent-b", "in flight together with its other requests"),
        ("ec-idle-over-keepalive", "m-idle-b", "with idle gaps longer than the servers'"),
    ],
)
def test_a_concurrent_or_idle_gap_case_carries_no_earlier_request_and_says_so(
    tmp_path: Path, scenario: str, prompt: str, unlike: str
) -> None:
    plan = plan_for(write_scenario_bundle(tmp_path / "run", scenario, prompt))
    assert plan.before == () and plan.sent_after is None
    out = tmp_path / "export"
    write_export(plan, out, REPAIR)
    assert not (out / "before").exists()
    issue = (out / "ISSUE.md").read_text()
    assert f"Not as the run sent it: scenario {scenario} sent it {unlike}" in issue
    assert "this sends it alone to servers started for it" in issue
    assert "Sent as the run sent it" not in issue


def test_a_probe_carries_no_earlier_request(tmp_path: Path) -> None:
    """A probe sends one crafted request to one instance: no scenario's stage is its question."""
    root = write_scenario_bundle(tmp_path / "run", KILLS_PREFILL, "m-text-at-block-plus-one")
    plan = plan_for(root, probe=UNKNOWN_UUID_PROBE)
    assert plan.before == () and "cache_salt" not in plan.request
    assert plan.sent_after is None, plan.sent_after
    assert "which `check.py` sends first" not in render_issue(plan)


def test_an_earlier_body_the_run_lacks_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    root = write_scenario_bundle(tmp_path / "run", KILLS_PREFILL, "m-text-at-block-plus-one")
    requests = json.loads((root / "requests.json").read_text())
    del requests["m-text-stores-the-lookup-key"]
    (root / "requests.json").write_text(json.dumps(requests))
    line = one_line_refusal(capsys, ["export", str(root)])
    assert line.endswith(
        "requests.json has no body for 'm-text-stores-the-lookup-key', which scenario "
        f"{KILLS_PREFILL} sent before the case on the same servers: the stage the case was "
        "sent on cannot be set again"
    ), line
    assert not (root / "exports").exists()


def test_check_reads_the_earlier_requests_in_name_order(tmp_path: Path) -> None:
    """`before/NN-<prompt>.json`, 01 first; a file that holds no request body is an error
    naming it; none there, nothing first."""
    assert check.read_before(tmp_path) == []
    (tmp_path / "before").mkdir()
    (tmp_path / "before/02-b.json").write_text('{"n": 2}')
    (tmp_path / "before/01-a.json").write_text('{"n": 1}')
    assert check.read_before(tmp_path) == [
        ("before/01-a.json", {"n": 1}),
        ("before/02-b.json", {"n": 2}),
    ]
    (tmp_path / "before/03-c.json").write_text("[]")
    with pytest.raises(ValueError, match="03-c.json holds no JSON object"):
        check.read_before(tmp_path)


def test_check_calls_an_earlier_answer_none_only_when_a_client_could_read_none() -> None:
    """What an earlier request is answered is not judged; an HTTP error, no answer, or a
    stream that reports an error is no answer."""
    assert check.unanswered(answer(200, {"choices": []}), streamed=False) is None
    assert "HTTP 500" in str(check.unanswered(answer(500, {"error": "x"}), streamed=False))
    assert "no answer" in str(check.unanswered(answer(None, "refused"), streamed=False))
    whole = events(*stream_chunks([1, 2], [7, 8]))
    assert check.unanswered(check.Answer("u", 200, whole, 0.1), streamed=True) is None
    failed = events({"error": {"message": "engine dead"}})
    assert "the stream reported an error" in str(
        check.unanswered(check.Answer("u", 200, failed, 0.1), streamed=True)
    )


def test_the_policy_and_floor_are_read_where_the_run_writes_them(tmp_path: Path) -> None:
    """Found in review: the export read `reference_policy` and `noise_floor_nats` at the top of
    summary.json, where only hand-made bundles had them; a run writes them under its `run`
    (`write_summary_json`, as `Sweep.write_outputs` passes them), so a CPU run under
    --reference-policy pd-drift exported a check.py that fails the DRIFT the harness passed."""
    from harness.judge.policy import PD_DRIFT
    from harness.report.text import write_summary_json
    from harness.run.export.expectation import noise_floor, reference_policy
    from harness.run.repro import Bundle

    run = write_bundle(tmp_path / "run")
    cases = json.loads((run / "summary.json").read_text())["cases"]
    (run / "run.json").write_text(json.dumps({"platform_profile": "cpu"}))
    summary = {"reference_policy": PD_DRIFT, "noise_floor_nats": 0.05}
    write_summary_json(run / "summary.json", [], summary)
    document = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**document, "cases": cases}))
    bundle = Bundle.load(run)
    assert reference_policy(bundle).name == PD_DRIFT
    assert noise_floor(bundle, {}) == 0.05
    # A fuzz run's: in run.json's `fuzz` (its settings), a bundle of each failure group too.
    write_summary_json(run / "summary.json", [], {"fuzz_group": {}})
    document = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**document, "cases": cases}))
    fuzz = {"platform_profile": "cpu", "fuzz": {"reference_policy": PD_DRIFT}}
    (run / "run.json").write_text(json.dumps(fuzz))
    assert reference_policy(Bundle.load(run)).name == PD_DRIFT


def test_under_pd_drift_drift_passes_against_the_baseline_never_against_an_exact_reference(
    tmp_path: Path,
) -> None:
    """pd-drift lets a P->D topology DRIFT against the monolithic baseline only; against its
    exact reference (1E+1P+1D vs 1P+1D) the judge asked for the same ids. expected.json's
    `drift_passes` is what check.py passes a DRIFT by: true there passed what the harness
    judged a MISMATCH."""

    def pd_drift(run: Path) -> Path:
        summary = json.loads((run / "summary.json").read_text())
        summary["run"] = {"reference_policy": "pd-drift", "noise_floor_nats": 0.05}
        (run / "summary.json").write_text(json.dumps(summary))
        return run

    exact = plan_for(pd_drift(write_exact_reference_bundle(tmp_path / "exact")))
    assert (exact.expected["reference"], exact.expected["policy"]) == ("1P+1D", "pd-drift")
    assert exact.expected["drift_passes"] is False
    monolithic = plan_for(pd_drift(write_bundle(tmp_path / "baseline", verdict="MISMATCH")))
    assert monolithic.expected["reference"] == "baseline"
    assert monolithic.expected["drift_passes"] is True


def test_a_drift_records_which_ids_parted_and_where_as_a_mismatch_does() -> None:
    """check.py's "reproduced" compares where a DRIFT parted too (`where_it_failed`): without
    `ids` and `position` a DRIFT at another position, or of the prompt ids, reproduced it."""
    from harness.run.export.expectation import where_it_failed

    record = {
        "verdict": "DRIFT",
        "detail": "generated tokens differ at position 2 of 4/4, within the noise floor",
        "divergence": {"index": 2},
    }
    assert where_it_failed("DRIFT", record) == {"ids": "generated ids", "position": 2}


@pytest.mark.parametrize("floor", [math.inf, math.nan, -0.1, "0.05", True])
def test_a_recorded_noise_floor_that_is_no_measurement_is_refused_naming_its_file(
    tmp_path: Path, floor: Any
) -> None:
    """expected.json's noise floor is check.py's drift tolerance: an infinite one passes every
    near tie, so one that is no finite number of nats 0 or more is refused, not exported."""
    run = write_bundle(tmp_path / "run", verdict="MISMATCH")
    summary = json.loads((run / "summary.json").read_text())
    summary["run"] = {"reference_policy": "pd-drift", "noise_floor_nats": floor}
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(BadInput, match=r"summary\.json: noise_floor_nats is .*not a measured"):
        plan_for(run)


def test_the_noise_floor_is_the_tolerance_the_case_was_judged_with_before_the_runs(
    tmp_path: Path,
) -> None:
    """The case's divergence records the tolerance the judge used (a batched answer's, larger
    than the run's single-request floor): check.py must judge with that one, not the run's."""
    from harness.run.export.expectation import noise_floor
    from harness.run.repro import Bundle

    run = write_bundle(tmp_path / "run", verdict="MISMATCH")
    summary = json.loads((run / "summary.json").read_text())
    summary["run"] = {"reference_policy": "pd-drift", "noise_floor_nats": 0.05}
    (run / "summary.json").write_text(json.dumps(summary))
    bundle = Bundle.load(run)
    assert noise_floor(bundle, {"divergence": {"index": 1, "tolerance": 0.2}}) == 0.2
    assert noise_floor(bundle, {"divergence": {"index": 1}}) == 0.05


def test_the_unknown_uuid_probe_refuses_a_case_of_other_than_one_image(tmp_path: Path) -> None:
    """The probe sends one image as a metadata-only part under a never-encoded uuid: a case of
    two images (or the encoder's answer for two) has no one image to send so, and probing its
    first alone would leave the second as raw media beside it. Refused, naming the count."""
    from types import SimpleNamespace

    from harness.run.export.probe import encoder_metadata, unknown_uuid_body

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text = {"type": "text", "text": "Describe."}
    case = SimpleNamespace(prompt="two_images")
    for images in ([], [image, image]):
        body = {"messages": [{"role": "user", "content": [*images, text]}]}
        with pytest.raises(BadInput, match=f"exactly one image; two_images has {len(images)}"):
            unknown_uuid_body(body, {"image_grid_thw": [[1, 4, 4]]}, case)  # type: ignore[arg-type]

    taps = [
        {
            "role": "encoder",
            "ec_transfer_params": {h: {"metadata": {"image_grid_thw": [[1, 4, 4]]}}},
        }
        for h in ("hash-a", "hash-b")
    ]
    (tmp_path / "responses.json").write_text(json.dumps({"1E+1PD": {"p": {"taps": taps}}}))
    bundle = SimpleNamespace(path=tmp_path)
    with pytest.raises(BadInput, match="the bundle's taps hold 2"):
        encoder_metadata(bundle, "1E+1PD", "p")  # type: ignore[arg-type]


def test_a_case_against_an_exact_reference_has_no_monolithic_baseline_to_serve(
    tmp_path: Path,
) -> None:
    """`run.sh baseline` serves the monolithic reference; a case judged against 1P+1D has
    none, and 1P+1D's first instance (its prefill) is no baseline to start under that name."""
    plan = plan_for(write_exact_reference_bundle(tmp_path / "run"))
    assert plan.reference is not None and plan.reference.name == "1P+1D"
    assert plan.baseline is None
    monolithic = plan_for(write_bundle(tmp_path / "baseline-run"))
    assert monolithic.baseline is not None and monolithic.baseline.role == "baseline"


def test_a_body_keeps_its_own_cache_salt_and_asks_for_two_log_probs_at_least() -> None:
    """A request the run sent under its own `cache_salt` goes under that one (what it shared
    with the run's other requests is the question); and top-1 log-probs are no ask for
    check.py's drift rule, which reads the other token's."""
    from harness.run.export.request import asks_for_logprobs, own_salt

    assert own_salt({"cache_salt": "runs-own"}, "epd-export-case")["cache_salt"] == "runs-own"
    assert own_salt({}, "epd-export-case")["cache_salt"] == "epd-export-case"
    assert asks_for_logprobs({"logprobs": True, "top_logprobs": 2})
    assert not asks_for_logprobs({"logprobs": True, "top_logprobs": 1})


@pytest.mark.parametrize("left", ["both files", "one file", "harness proxy"])
def test_the_export_takes_the_runs_proxy_files_only_while_they_are_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, left: str
) -> None:
    """The proxy files of a `--proxy vllm` run are its own while its files directory still
    holds both; once a cleaner took one (or the run used the harness's proxy) the release's
    are fetched, not an export shipped without a proxy."""
    from types import SimpleNamespace

    from harness.cli import export as export_cli
    from harness.preflight.upstream_proxy import PROXY_FILES, ProxyFiles

    files_dir = tmp_path / "proxy-files"
    for name in PROXY_FILES:
        (files_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (files_dir / name).write_text("# stand-in\n")
    if left == "one file":
        (files_dir / PROXY_FILES[1]).unlink()
    kind = "harness" if left == "harness proxy" else "vllm"
    fetched: list[str] = []

    def fetch(version: str, cache: Path, interpreter: object = None) -> ProxyFiles:
        fetched.append(version)
        return ProxyFiles(tmp_path / "fetched", f"vllm-{version}.tar.gz")

    monkeypatch.setattr(export_cli, "cached_or_fetched", fetch)
    bundle = SimpleNamespace(
        run={
            "served_vllm": {"version": "0.32.0+cpu"},
            "proxy": {"kind": kind, "files_dir": str(files_dir), "origin": "the run's"},
        }
    )
    upstream = export_cli.upstream_proxy(bundle)  # type: ignore[arg-type]
    if left == "both files":
        assert (upstream.directory, upstream.origin, fetched) == (files_dir, "the run's", [])
    else:
        assert (upstream.directory, fetched) == (tmp_path / "fetched", ["0.32.0+cpu"])


FAILED_KV_GUARD = {"kv_transfer": {"ok": False, "evidence": "D cached_tokens=0 (taps)"}}


def test_a_vacuous_kv_case_exports_its_kv_guard_for_check_py_to_hold(tmp_path: Path) -> None:
    """Found on real vLLM: a fuzz's known VACUOUS case (D loads none of P's KV at k*block+1
    prompt tokens) exported, and check.py, judging ids alone, said MATCH and "NOT
    reproduced". expected.json now carries the KV guard the run judged under ExampleConnector's
    rule (D's cached_tokens, which the answer's usage shows), and ISSUE.md says check.py holds
    it; under NIXL's rule (D's /metrics) and where the run judged no KV guard there is none."""
    from harness.spec.connectors import KvRule, expected_kv_tokens

    out = write(tmp_path / "a", verdict="VACUOUS", guards=FAILED_KV_GUARD)
    expected = json.loads((out / "expected.json").read_text())
    minimum = expected_kv_tokens(KvRule.BLOCK_ALIGNED_PREFIX, len(PROMPT_IDS), 32)
    assert expected["kv_transfer"] == {
        "min_cached_tokens": minimum,
        "rule": "block-aligned prefix",
        "block_size": 32,
        "recorded": "D cached_tokens=0 (taps)",
    }
    assert (
        f"`cached_tokens` in the answer's usage must reach {minimum}"
        in (out / "ISSUE.md").read_text()
    )
    nixl = write(
        tmp_path / "b", verdict="VACUOUS", guards=FAILED_KV_GUARD, kv_connector="NixlConnector"
    )
    assert "kv_transfer" not in json.loads((nixl / "expected.json").read_text())
    unguarded = write(tmp_path / "c", verdict="MISMATCH")
    assert "kv_transfer" not in json.loads((unguarded / "expected.json").read_text())
    assert "KV guard" not in (unguarded / "ISSUE.md").read_text()


KV_GUARD = {"min_cached_tokens": 64, "rule": "block-aligned prefix", "block_size": 32}


def cached(payload: dict, tokens: int | None) -> dict:
    """`payload` (an answer) with D's cached_tokens in its usage (None: no details)."""
    if tokens is not None:
        payload["usage"]["prompt_tokens_details"] = {"cached_tokens": tokens}
    return payload


def test_check_holds_the_kv_guard_where_expected_json_has_it(tmp_path: Path, monkeypatch) -> None:
    """Equal ids with D's cached_tokens below the block-aligned prefix are the harness's
    VACUOUS, exit 1, in an unstreamed and a streamed answer alike; at or above it a MATCH that
    says the guard held; an answer without cached_tokens proves no transfer either. Ids that
    differ stay the difference they are; without `kv_guard` (the reference served alone)
    nothing is held."""
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    right = [1, 2, 3], [7, 8, 9, 10]

    def judged(payload: dict, streamed: bool = False, guard=KV_GUARD) -> tuple[str, int, str]:
        text = json.dumps(payload)
        if streamed:
            chunks = stream_chunks(payload["prompt_token_ids"], payload["choices"][0]["token_ids"])
            chunks[-1]["usage"] = payload["usage"]
            text = events(*chunks)
        sent = check.Answer("http://x/v1/chat/completions", 200, text, 0.1)
        return judge(EXPECTED, sent, [], tmp_path, streamed=streamed, kv_guard=guard)

    for streamed in (False, True):
        verdict, code, detail = judged(cached(response(*right), 32), streamed)
        assert (verdict, code) == ("VACUOUS", 1), (streamed, detail)
        assert detail == (
            "tokens equal but the KV guard failed: D cached_tokens=32 (the answer's usage), "
            "expected >= 64 by the block-aligned prefix rule (prompt 3 tokens, block 32): D "
            "did not load the KV P stored"
        )
        verdict, code, detail = judged(cached(response(*right), 64), streamed)
        assert (verdict, code) == ("MATCH", 0) and "the KV guard held" in detail, detail
    assert judged(cached(response(*right), None))[:2] == ("VACUOUS", 1)
    assert judged(cached(response([1, 2, 3], [7, 5, 9, 10]), 0))[:2] == ("MISMATCH", 1)
    assert judged(cached(response(*right), 0), guard=None)[:2] == ("MATCH", 0)
    # A prompt of one block or less leaves nothing to move: the harness's guard fails it
    # (check_kv_transfer: expected > 0), and so does check.py's.
    nothing_to_move = {**KV_GUARD, "min_cached_tokens": 0}
    assert judged(cached(response(*right), 0), guard=nothing_to_move)[:2] == ("VACUOUS", 1)


def test_check_does_not_hold_the_kv_guard_on_servers_that_answered_the_request_before(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Found in review: check.py run a second time against the same serve.sh (by hand, as
    ISSUE.md offers) sends request.json under the same cache_salt, D takes the prompt from its
    own prefix cache and counts it in cached_tokens: the known VACUOUS (D loads none of P's
    KV) read 'the KV guard held', MATCH, 'recorded VACUOUS: NOT reproduced'. The harness calls
    such a guard not checkable; check.py says it does not judge it there, and why."""
    here = tmp_path / "export"
    state = here / "work" / "state"
    state.mkdir(parents=True)
    (here / "request.json").write_text(json.dumps({"messages": []}))
    expected = {
        **EXPECTED,
        "what": "a case",
        "reference": "baseline",
        "kv_transfer": KV_GUARD,
        "recorded": {"verdict": "VACUOUS"},
    }
    (here / "expected.json").write_text(json.dumps(expected))
    (state / "endpoints.tsv").write_text(
        "mode\tcase\nentry\thttp://127.0.0.1:9\n"
        "instance\tdecode0\tdecode\thttp://127.0.0.1:9\t\tnone.log\n"
    )
    d_cached = iter([0, 64])  # D computed the prompt itself, then found it in its own cache

    def post_json(url: str, *args: object) -> check.Answer:
        answer = cached(response([1, 2, 3], [7, 8, 9, 10]), next(d_cached))
        return check.Answer(url, 200, json.dumps(answer), 0.1)

    monkeypatch.setattr(check, "__file__", str(here / "check.py"))
    monkeypatch.setattr(check, "post_json", post_json)
    monkeypatch.setattr(check, "dead_instances", lambda *args: [])
    assert check.main(["--state", str(state)]) == check.EXIT_DIFFERENCE
    assert "recorded VACUOUS: reproduced" in capsys.readouterr().out
    assert check.main(["--state", str(state)]) == check.EXIT_MATCH
    out = capsys.readouterr().out
    assert "the KV guard held" not in out, out
    assert (
        "check.py: the KV guard is not judged: these servers answered request.json before, "
        "and D counts what its own prefix cache holds of the prompt (the harness's guard is "
        "not checkable then); start serve.sh again to judge it"
    ) in out, out


def test_a_vacuous_case_on_a_guard_check_py_cannot_see_says_so(tmp_path: Path) -> None:
    """A VACUOUS case whose failed guard was read at the harness's taps (an EC guard, or the
    KV guard under NIXL's rule) is recorded as such: ISSUE.md says check.py cannot hold it,
    and check.py's equal ids say why the failure is not reproduced, not a bare "NOT
    reproduced". A guard check.py holds (the KV guard it carries) is not among them."""
    ec = {"consumer_embeds": {"ok": False, "evidence": "raw media reached prefill0"}}
    out = write(tmp_path / "a", verdict="VACUOUS", guards={**ec, **FAILED_KV_GUARD})
    recorded = json.loads((out / "expected.json").read_text())["recorded"]
    assert recorded["unjudged_guards"] == ["consumer_embeds"]
    assert "It cannot hold consumer_embeds" in (out / "ISSUE.md").read_text()
    nixl = write(
        tmp_path / "b", verdict="VACUOUS", guards=FAILED_KV_GUARD, kv_connector="NixlConnector"
    )
    recorded = json.loads((nixl / "expected.json").read_text())["recorded"]
    assert recorded["unjudged_guards"] == ["kv_transfer"]
    assert check.reproduction(recorded, "MATCH", (), None) == (
        "NOT reproduced, and check.py cannot show it: the recorded VACUOUS rests on "
        "kv_transfer, which the harness read from the instances (its taps between them and "
        "the proxy, D's /metrics); check.py sees only the answer"
    )
    held = write(tmp_path / "c", verdict="VACUOUS", guards=FAILED_KV_GUARD)
    assert "unjudged_guards" not in json.loads((held / "expected.json").read_text())["recorded"]
    assert check.reproduction({"verdict": "VACUOUS"}, "MATCH", (), None) == "NOT reproduced"


def test_check_py_is_given_the_guards_the_harness_judged_and_only_those(tmp_path: Path) -> None:
    """What expected.json hands check.py of the guards: the KV guard's minimum from the
    prompt the case sent (24 tokens, block 8: 16, the block-aligned prefix short of the last
    token); no KV guard the run could not check (D's own prefix-cache hit: check.py would call
    it VACUOUS where the harness did not); no guard it could not check among those a VACUOUS
    rests on; and none of a case that is no VACUOUS, whose ISSUE.md would otherwise explain a
    VACUOUS never recorded. Mutants of each survived the tests above."""
    small = write(tmp_path / "a", verdict="VACUOUS", guards=FAILED_KV_GUARD, block_size=8)
    assert len(PROMPT_IDS) == 24
    assert (
        json.loads((small / "expected.json").read_text())["kv_transfer"]["min_cached_tokens"] == 16
    )
    unchecked = {"ok": False, "not_checkable": True, "evidence": "not checkable: D's own cache"}
    out = write(tmp_path / "b", verdict="MATCH", guards={"kv_transfer": unchecked})
    assert "kv_transfer" not in json.loads((out / "expected.json").read_text())
    out = write(
        tmp_path / "c",
        verdict="VACUOUS",
        guards={**FAILED_KV_GUARD, "consumer_embeds": unchecked},
    )
    assert "unjudged_guards" not in json.loads((out / "expected.json").read_text())["recorded"]
    ec = {"consumer_embeds": {"ok": False, "evidence": "raw media reached prefill0"}}
    out = write(tmp_path / "d", verdict="MISMATCH", guards=ec)
    assert "unjudged_guards" not in json.loads((out / "expected.json").read_text())["recorded"]
    assert "cannot hold" not in (out / "ISSUE.md").read_text()
    # A VACUOUS resting on two guards check.py cannot see names both, in ISSUE.md and in
    # check.py's line (mutants naming the first alone survived).
    two = {**ec, "encoder_output": {"ok": False, "evidence": "no embeddings from encoder0"}}
    out = write(tmp_path / "e", verdict="VACUOUS", guards=two)
    recorded = json.loads((out / "expected.json").read_text())["recorded"]
    assert recorded["unjudged_guards"] == ["consumer_embeds", "encoder_output"]
    assert (
        "It cannot hold consumer_embeds, encoder_output, on which" in (out / "ISSUE.md").read_text()
    )
    assert "rests on consumer_embeds, encoder_output, which" in check.reproduction(
        recorded, "MATCH", (), None
    )


def test_a_cpu_ray_export_says_the_run_spread_its_instances_over_nodes(tmp_path: Path) -> None:
    """Real vLLM (`run --launcher ray` on CPU): E, P and D ran on nodes 127.0.0.2-4, and the
    export said nothing of it, as the nodes were read off the devices and a CPU run pins
    none. The nodes are the instances'; no device is said where none was pinned."""
    run = write_bundle(tmp_path / "run")
    commands = sorted((run / safe_name("1E+1P+1D")).glob("*0.cmd.json"))
    for number, path in enumerate(commands, start=2):
        command = json.loads(path.read_text())
        command["node"] = {"address": f"127.0.0.{number}", "node_id": "n", "hostname": "vm"}
        path.write_text(json.dumps(command))
    plan = plan_for(run)
    assert plan.devices == () and len(plan.nodes) == 3, plan.nodes
    issue = render_issue(plan)
    assert "spread these instances over 3 nodes (`--launcher ray`: 127.0.0." in issue, issue
    assert all(f"127.0.0.{number} (vm)" in issue for number in (2, 3, 4)), issue
    assert "runs them all on one host, so a failure" in issue, issue
