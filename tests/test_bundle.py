"""The artifact bundle (run.json, diff.md, junit.xml, report.html) from hand-built cases."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from fixtures.checkpoint_digest import model_digest
from harness import devices
from harness.devices import DevicesUsed, cpu_description
from harness.judge.compare import Verdict
from harness.judge.guards import GuardResult
from harness.judge.policy import PD_DRIFT
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.outcomes.stream import StreamRecord
from harness.provenance import harness_source
from harness.report import bundle as bundle_module
from harness.report.bundle import (
    REDACTED,
    package_providers,
    redact_argv,
    render_diff_md,
    write_bundle,
    write_diff_md,
    write_junit_xml,
    write_run_info,
)
from harness.report.html import render_report_html
from harness.report.text import CaseRecord, format_failure
from harness.spec.prompts import SKELETON_PROMPTS
from harness.spec.settings import LauncherChoice, RunSettings, ServedVllm
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.builders import chat
from harness.testing.judging import judged

pytestmark = pytest.mark.unit

SECRET = "secret123"
ENV_SECRET = "env-secret-987"
DIVERGENCE = 7
HOSTILE_TEXT = "<script>alert('pwned')</script>"


def answer(token_ids: list[int], text: str = "") -> ChatResult:
    """A result whose top-5 at every position is the generated id and four unrelated ids."""
    unrelated = [(900 + k, -3.0 - k) for k in range(4)]
    return chat(
        token_ids, prompt_ids=(1, 2, 3, 4), text=text, top=lambda _, t: [(t, -0.5), *unrelated]
    )


REFERENCE_IDS = list(range(100, 120))
CANDIDATE_IDS = REFERENCE_IDS[:DIVERGENCE] + [555] + REFERENCE_IDS[DIVERGENCE + 1 :]


def sample_run() -> tuple[list[CaseRecord], dict]:
    """MATCH, MISMATCH at DIVERGENCE, VACUOUS with a failed guard, ERROR: one of each shape."""
    reference = {
        "text": Outcome("text", answer(REFERENCE_IDS, "a plain answer")),
        "image": Outcome("image", answer(REFERENCE_IDS, "the sky is blue")),
    }
    candidate = {
        "text": Outcome("text", answer(REFERENCE_IDS, "a plain answer")),
        "image": Outcome("image", answer(CANDIDATE_IDS, f"the sky is {HOSTILE_TEXT}")),
    }
    ok_guard = GuardResult("kv_transfer", True, "cached_tokens=96 of 120")
    records = [
        judged("1E+1P+1D", "baseline", reference["text"], candidate["text"], [ok_guard]),
        judged("1E+1P+1D", "baseline", reference["image"], candidate["image"], [ok_guard]),
        judged(
            "1P+1D",
            "baseline",
            reference["text"],
            candidate["text"],
            [GuardResult("kv_transfer", False, "cached_tokens=0: D recomputed the prompt")],
        ),
        judged(
            "2E+1PD",
            "baseline",
            reference["image"],
            Outcome("image", error=f"HTTP 500 \x1b[31m{SECRET} leaked\x1b[0m\x07 {HOSTILE_TEXT}"),
            [],
        ),
    ]
    responses = {
        "baseline": {name: o.to_json() for name, o in reference.items()},
        "1E+1P+1D": {name: o.to_json() for name, o in candidate.items()},
    }
    return records, responses


def near_tie_case(
    candidate_prompt_ids: tuple[int, ...], stream: StreamRecord | None = None
) -> tuple[CaseRecord, dict]:
    """1P+1D against the baseline under pd-drift with a 0.05-nat floor: both sides 0.01 nats
    between their own token and the other's at DIVERGENCE, the prefix log-probs equal;
    `stream`: how the candidate's answer was streamed."""

    def near_tie(tokens: list[int], other: int, prompt_ids: tuple[int, ...]) -> Outcome:
        def top(i: int, t: int) -> list[tuple[int, float]]:
            return [(t, -0.5), (other, -0.51)] if i == DIVERGENCE else [(t, -0.5)]

        return Outcome("image", chat(tokens, prompt_ids=prompt_ids, top=top))

    reference = near_tie(REFERENCE_IDS, 555, (1, 2, 3, 4))
    candidate = near_tie(CANDIDATE_IDS, REFERENCE_IDS[DIVERGENCE], candidate_prompt_ids)
    candidate = dataclasses.replace(candidate, stream=stream)
    record = judged(
        "1P+1D", "baseline", reference, candidate, reference_policy=PD_DRIFT, tolerance=0.05
    )
    responses = {
        "baseline": {"image": reference.to_json()},
        "1P+1D": {"image": candidate.to_json()},
    }
    return record, responses


def test_every_report_says_drift_does_not_apply_when_the_prompt_ids_differ():
    """A MISMATCH for other prompt ids read "drift: yes" in the failure block, diff.md and
    report.html when the generated ids parted at a near-tie within the floor (found in
    review); each now says why drift does not apply. The same answers to equal prompt ids
    are the DRIFT they look like, so the case is one the drift rule would excuse."""
    same_prompt, _ = near_tie_case((1, 2, 3, 4))
    assert same_prompt.verdict is Verdict.DRIFT and "drift: yes" in format_failure(same_prompt)
    record, responses = near_tie_case((1, 2, 3, 5))
    assert record.verdict is Verdict.MISMATCH and record.divergence["drift"] is False
    for name, text in (
        ("failure block", format_failure(record)),
        ("diff.md", render_diff_md([record])),
        ("report.html", render_report_html([record], responses, {})),
    ):
        assert "drift: no (not applicable: the prompt ids differ" in text, name
        assert "drift: yes" not in text, name


def test_every_report_says_drift_does_not_apply_when_the_stream_framing_is_broken():
    """Broken framing makes the case a MISMATCH whatever the ids say, yet the evidence read
    "drift: yes" beside it when the ids parted at a near-tie within the floor (found in
    review); each report now says drift does not apply, and why. The same ids streamed
    whole are the DRIFT they look like."""
    whole = StreamRecord(content_type="text/event-stream", done_last=True)
    clean, _ = near_tie_case((1, 2, 3, 4), stream=whole)
    assert clean.verdict is Verdict.DRIFT and "drift: yes" in format_failure(clean)
    broken = dataclasses.replace(whole, problems=["chunk 3 carries prompt_token_ids again"])
    record, responses = near_tie_case((1, 2, 3, 4), stream=broken)
    assert record.verdict is Verdict.MISMATCH and record.divergence["drift"] is False
    for name, text in (
        ("failure block", format_failure(record)),
        ("diff.md", render_diff_md([record])),
        ("report.html", render_report_html([record], responses, {})),
    ):
        assert "drift: no (not applicable: the stream framing is broken" in text, name
        assert "drift: yes" not in text, name


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory with one launched instance whose command carries secrets."""
    run = tmp_path / "run"
    topology_dir = run / "1E-1P-1D"
    topology_dir.mkdir(parents=True)
    command = {
        "name": "1E+1P+1D/decode0",
        "argv": [
            "vllm",
            "serve",
            "/models/tiny",
            "--api-key",
            SECRET,
            "--max-num-batched-tokens",
            "8192",
        ],
        "env": {"HF_TOKEN": SECRET, "OMP_NUM_THREADS": "1"},
    }
    (topology_dir / "1E-1P-1D__decode0.cmd.json").write_text(json.dumps(command))
    return run


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    return model


SERVED = ServedVllm(
    "/other-venv/bin/vllm",
    "0.31.0+cpu",
    "2.9.1+cpu",
    amx_permission="not needed: no amx_tile",
    libraries=(("tokenizers", "0.22.1"), ("transformers", "4.57.1")),
    transfer_libraries=(("nixl", "1.5.0"), ("nixl-cu13", "1.5.0")),
)


def run_info(run_dir: Path, model_dir: Path) -> dict:
    settings = RunSettings(ServingConfig(model=str(model_dir)), run_dir, vllm=SERVED)
    return write_run_info(
        settings, (TOPOLOGIES["baseline"], TOPOLOGIES["1E+1P+1D"]), SKELETON_PROMPTS[:2]
    )


def test_run_json_records_versions_model_config_and_instances(run_dir, model_dir):
    run_info(run_dir, model_dir)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["served_vllm"] == {
        "executable": "/other-venv/bin/vllm",
        "version": "0.31.0+cpu",
        "torch_version": "2.9.1+cpu",
        "amx_permission": "not needed: no amx_tile",
        "libraries": [["tokenizers", "0.22.1"], ["transformers", "4.57.1"]],
        "transfer_libraries": [["nixl", "1.5.0"], ["nixl-cu13", "1.5.0"]],
        "source_tree": "",
        "source_state": "",
        "source_problem": "",
    }, "run.json records the served vLLM (and its AMX hook), not the harness interpreter's"
    harness = info["harness_packages"]["harness"]
    assert harness == {
        "distribution": "epd-harness",
        "version": importlib.metadata.version("epd-harness"),
    }
    assert set(info["harness_packages"]) == {"vllm", "torch", "transformers", "harness"}
    # The version above is the same at every commit: the commit says which harness judged.
    assert info["harness_source"] == harness_source()
    assert info["python"] and info["platform"] and info["hostname"]
    assert info["model"] == {"dir": str(model_dir), "digest": model_digest(model_dir)}
    serving = dataclasses.asdict(ServingConfig(model=str(model_dir)))
    assert info["serving"] == json.loads(json.dumps(serving))  # every field, tuples as lists
    assert [t["name"] for t in info["topologies"]] == ["baseline", "1E+1P+1D"]
    assert info["prompts"][0]["name"] == SKELETON_PROMPTS[0].name
    instance = info["instances"]["1E+1P+1D/decode0"]
    assert instance["env"] == {"HF_TOKEN": REDACTED, "OMP_NUM_THREADS": "1"}
    assert instance["argv"][3:] == ["--api-key", REDACTED, "--max-num-batched-tokens", "8192"]
    assert "cpu" in info  # the host's CPU features (None where /proc/cpuinfo cannot be read)


def test_run_json_records_eager_the_memory_shares_the_parser_check_and_the_vllm_tree(
    run_dir, model_dir, monkeypatch
):
    from harness.spec.platforms import CPU, CUDA
    from harness.spec.settings import ProxyChoice

    proxy = ProxyChoice(
        "vllm",
        Path("/src/vllm"),
        "checkout /src/vllm",
        source_commit="a" * 40,
        commit_check="matches the served vLLM's build (gaaaaaaa)",
    )
    check = {
        "parser": "vllm 0.33.0.dev1+gaaaaaaa (py)",
        "instances": ["x"],
        "judged": 1,
        "seconds": 9.5,
    }
    settings = RunSettings(
        ServingConfig(model=str(model_dir), enforce_eager=True),
        run_dir,
        vllm=SERVED,
        platform=CUDA,
        devices=(0, 1, 2, 3),
        proxy=proxy,
        argv_check=check,
    )
    # A GPU host's devices may come from nvidia-smi, a process: not in a unit test
    # (tests/test_devices.py reads a faked one).
    monkeypatch.setattr(
        bundle_module,
        "run_devices",
        lambda platform, pins, indices, elsewhere=None: DevicesUsed(
            platform, "GPU X", len(indices), indices, "t"
        ),
    )
    write_run_info(settings, (TOPOLOGIES["1E+1PD"],), SKELETON_PROMPTS[:1])
    info = json.loads((run_dir / "run.json").read_text())
    assert info["devices_used"]["model"] == "GPU X" and info["devices_used"]["count"] == 4
    assert info["serving"]["enforce_eager"] is True
    assert info["gpu_memory_shares"] == {
        "shares": {"baseline": 0.9, "encoder": 0.01, "pd": 0.7, "prefill": 0.7, "decode": 0.7},
        "device_budget": 0.9,
        "encoder_room_on_a_shared_device": 0.2,
    }
    assert info["argv_check"] == check
    assert info["proxy"]["source_commit"] == "a" * 40
    assert info["proxy"]["commit_check"].startswith("matches")
    cpu = dataclasses.replace(settings, platform=CPU, argv_check=None)
    write_run_info(cpu, (TOPOLOGIES["1E+1PD"],), SKELETON_PROMPTS[:1])
    assert json.loads((run_dir / "run.json").read_text())["gpu_memory_shares"] is None


def test_run_json_verdicts_and_report_say_which_devices_computed_the_ids(run_dir, model_dir):
    """run.json recorded the host's CPU features but not the devices a run used as one fact
    (on GPUs no model at all), and neither verdicts.txt nor report.html said what computed
    the ids: a red night read on another machine could not tell. On CPU, this host's own."""
    from harness.report.run_outputs import DEVICES_LINE, VERDICTS_FILE, write_run_outputs

    info = run_info(run_dir, model_dir)
    recorded = json.loads((run_dir / "run.json").read_text())["devices_used"]
    settings_devices = RunSettings(ServingConfig(model=str(model_dir)), run_dir).devices
    assert recorded == devices.run_devices("cpu", False, settings_devices).to_json()
    cpu = devices.host_cpu()
    if cpu is not None:  # Linux: observable here
        assert recorded["model"] == cpu["model"] and recorded["source"] == "/proc/cpuinfo"
        assert recorded["amx"] is ("amx_tile" in cpu["features"])
    assert recorded["count"] == len(settings_devices)
    line = DevicesUsed.from_json(recorded).describe()
    records, _ = sample_run()
    write_run_outputs(run_dir, records, {}, {}, info)
    first = (run_dir / VERDICTS_FILE).read_text().splitlines()[0]
    assert first == f"{DEVICES_LINE}{line}; dtype bfloat16"
    header = (run_dir / "report.html").read_text().split("</header>")[0]
    assert f"ran on {line}" in header


def test_verdicts_say_the_dtype_the_ids_were_computed_in(run_dir, model_dir):
    """The console's header and report.html named the dtype, verdicts.txt's `ran on:` line
    did not (found walking a T4 box): a float16 night read beside a bfloat16 one could not be
    told apart. A run.json written before `--dtype` existed has no dtype: the line is as it
    was then."""
    from harness.report.run_outputs import DEVICES_LINE, devices_line, write_verdicts

    info = run_info(run_dir, model_dir)
    described = DevicesUsed.from_json(info["devices_used"]).describe()
    float16 = {**info, "serving": {**info["serving"], "dtype": "float16"}}
    assert devices_line(float16) == f"{DEVICES_LINE}{described}; dtype float16"
    records, _ = sample_run()
    write_verdicts(run_dir, records, float16)
    first = (run_dir / "verdicts.txt").read_text().splitlines()[0]
    assert first == f"{DEVICES_LINE}{described}; dtype float16"
    older = {**info, "serving": {k: v for k, v in info["serving"].items() if k != "dtype"}}
    assert devices_line(older) == f"{DEVICES_LINE}{described}"
    assert devices_line({k: v for k, v in info.items() if k != "serving"}) == (
        f"{DEVICES_LINE}{described}"
    )
    assert devices_line({"serving": {"dtype": "float16"}}) is None  # no devices recorded


def test_cpu_description_names_the_features_that_pick_vllm_cpu_kernels():
    """Two hosts of "the same kind" differ in AMX, which changes vLLM-CPU's attention path."""
    cpuinfo = (
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
        "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    assert cpu_description(cpuinfo) == {
        "model": "Intel(R) Xeon(R) Processor",
        "features": ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"],
    }
    assert cpu_description("flags : fpu sse avx2\n") == {"model": None, "features": ["avx2"]}


def test_no_secret_reaches_any_file_of_the_bundle(run_dir, model_dir, monkeypatch):
    monkeypatch.setenv("EPD_TEST_API_KEY", ENV_SECRET)
    records, responses = sample_run()
    responses["1E+1P+1D"]["text"]["result"]["text"] = f"echoed {ENV_SECRET}"
    write_bundle(run_dir, records, responses, run_info(run_dir, model_dir))

    files = [p for p in run_dir.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"run.json", "diff.md", "junit.xml", "report.html"} <= names
    assert not [n for n in names if n.endswith(".tmp")]  # atomic writes left nothing behind
    for path in files:
        data = path.read_bytes()
        assert SECRET.encode() not in data, path
        assert ENV_SECRET.encode() not in data, path
    command = json.loads((run_dir / "1E-1P-1D" / "1E-1P-1D__decode0.cmd.json").read_text())
    assert command["env"]["HF_TOKEN"] == REDACTED  # rewritten in place, still valid JSON


def test_redact_argv_hides_credential_flags_only():
    argv = ["--api-key", "k1", "--hf-token=k2", "--max-num-batched-tokens", "64", "--port", "1"]
    assert redact_argv(argv) == [
        "--api-key",
        REDACTED,
        f"--hf-token={REDACTED}",
        "--max-num-batched-tokens",
        "64",
        "--port",
        "1",
    ]


def test_redact_argv_hides_the_value_of_a_secret_named_assignment_whole():
    """`--ray-instance-env HF_TOKEN=...`: an instance's `.cmd.json` and its log header are
    written with `redact_argv` at launch, before any bundle scrubs text, so it alone keeps the
    value out of them; an assignment of any other name is left as it is."""
    argv = ["--ray-instance-env", "HF_TOKEN=hf_abc", "--ray-instance-env", "UCX_TLS=tcp"]
    assert redact_argv(argv) == [
        "--ray-instance-env",
        f"HF_TOKEN={REDACTED}",
        "--ray-instance-env",
        "UCX_TLS=tcp",
    ]


def test_a_flag_that_only_mentions_tokens_keeps_its_value_in_either_form():
    """Flags are not matched by name (`--max-num-batched-tokens=64` is no credential): only a
    `NAME=VALUE` whose NAME is an environment variable's name is taken for an assignment."""
    argv = ["--max-num-batched-tokens=64", "--max-model-len=4096", "--api-key=k1"]
    assert redact_argv(argv) == [
        "--max-num-batched-tokens=64",
        "--max-model-len=4096",
        f"--api-key={REDACTED}",
    ]


def test_a_secret_in_a_run_problem_reaches_no_file_of_the_bundle(run_dir, model_dir):
    """A run problem's text (an attached proxy's refusal echoing a key) is said in diff.md,
    junit.xml and report.html's header: scrubbed there as any other text."""
    records, responses = sample_run()
    info = {**run_info(run_dir, model_dir), "problems": [f"the proxy refused key {SECRET}"]}
    write_bundle(run_dir, records, responses, info)
    for name in ("diff.md", "junit.xml", "report.html"):
        text = (run_dir / name).read_text()
        assert f"the proxy refused key {REDACTED}" in text, name
        assert SECRET not in text, name


def test_a_secret_is_scrubbed_from_the_keys_of_data_too():
    """responses.json and run.json are keyed by prompts, topologies and names: a secret there
    is as much in the artifact as in a value."""
    from harness.report.bundle import Redactor

    redactor = Redactor(["key-holding-secret"])
    assert redactor.data({"p key-holding-secret": ["key-holding-secret"]}) == {
        f"p {REDACTED}": [REDACTED]
    }


def test_a_secret_that_holds_another_is_scrubbed_whole():
    """The longer secret goes first: scrubbing the shorter one inside it first would leave the
    rest of the longer one in the artifact."""
    from harness.report.bundle import Redactor

    redactor = Redactor(["token-part", "token-part-and-its-tail"])
    assert redactor.text("saw token-part-and-its-tail") == f"saw {REDACTED}"


@pytest.mark.parametrize("name", ["DB_PASSWORD", "hf_token", "Openai_Api_Key", "my_secret"])
def test_a_credential_is_known_by_each_name_part_whatever_its_case(name):
    """docs/running.md: names containing TOKEN, KEY, SECRET or PASSWORD are redacted; a
    lower-case `hf_token` is as much a credential as `HF_TOKEN`."""
    from harness.redact import redact_env

    assert redact_env({name: "value-of-it", "HF_HOME": "/models"}) == {
        name: REDACTED,
        "HF_HOME": "/models",
    }


@pytest.mark.parametrize(
    "given",
    [
        ["--api-key", "sk-given-4711"],
        ["--hf-token=sk-given-4711"],
        ["--ray-instance-env", "HF_TOKEN=sk-given-4711"],
    ],
)
def test_a_credential_given_on_the_harness_command_line_is_scrubbed_from_free_text(
    given, tmp_path, monkeypatch
):
    """`--api-key X`, `--hf-token=X` and a secret-named `NAME=X` in the harness's own argv:
    their values are secrets to scrub from every artifact's free text (an error that echoes
    the key), not only masked in the argv recorded."""
    import sys

    from harness.report.bundle import Redactor

    monkeypatch.setattr(sys, "argv", ["epd-harness", "run", *given])
    text = Redactor.for_run(tmp_path).text("401: sk-given-4711 refused")
    assert text == f"401: {REDACTED} refused"


def ray_run_info(
    tmp_path: Path, instance_env: tuple[tuple[str, str], ...]
) -> tuple[Path, dict[str, Any]]:
    """run.json of a 1P+1D run on Ray whose launcher hands the nodes `instance_env`."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    settings = RunSettings(
        ServingConfig(model=str(tmp_path / "no-model")),
        run_dir,
        vllm=ServedVllm("/venv/bin/vllm", "0.32.0+cpu", "2.9.1+cpu"),
        launcher=LauncherChoice("ray", instance_env=instance_env),
    )
    return run_dir, write_run_info(settings, (TOPOLOGIES["1P+1D"],), SKELETON_PROMPTS[:1])


def test_a_credential_handed_to_ray_instances_stays_out_of_every_file(tmp_path, monkeypatch):
    """`--ray-instance-env HF_TOKEN=...`: found in review, its value reached run.json and
    report.html (the argv and the launcher's record)."""
    import sys

    token = "hf_handed_to_the_nodes_4242"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    argv = ["epd-harness", "run", "--launcher", "ray", "--ray-instance-env", f"HF_TOKEN={token}"]
    monkeypatch.setattr(sys, "argv", argv)
    run_dir, info = ray_run_info(tmp_path, (("HF_TOKEN", token), ("UCX_TLS", "tcp")))
    write_bundle(run_dir, [], {}, info)
    leaked = [p.name for p in run_dir.rglob("*") if p.is_file() and token in p.read_text()]
    assert leaked == []
    run = json.loads((run_dir / "run.json").read_text())
    assert run["launcher"]["instance_env"] == {"HF_TOKEN": REDACTED, "UCX_TLS": "tcp"}
    assert run["harness_argv"][-1] == f"HF_TOKEN={REDACTED}"


def test_a_credential_the_launcher_was_given_by_no_flag_stays_out_of_run_json(
    tmp_path, monkeypatch
):
    """The pytest plugin's Ray driver and a repro hand the launcher its instance environment
    without a --ray-instance-env on the command line, so nothing but the launcher's own
    record (`LauncherChoice.to_json`) knows the value is a credential to mask."""
    import sys

    token = "hf_from_no_command_line_4242"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(sys, "argv", ["pytest", "tests"])
    run_dir, info = ray_run_info(tmp_path, (("HF_TOKEN", token),))
    assert token not in (run_dir / "run.json").read_text()
    assert info["launcher"]["instance_env"] == {"HF_TOKEN": REDACTED}


def test_a_rerun_takes_a_credential_run_json_did_not_keep_from_its_environment(
    tmp_path, monkeypatch
):
    from harness.run.repro import Bundle, BundleError

    run = {"launcher": {"kind": "ray", "instance_env": {"HF_TOKEN": REDACTED, "UCX_TLS": "tcp"}}}
    bundle = Bundle(tmp_path, run, {}, [])
    monkeypatch.setenv("HF_TOKEN", "hf_here_now")
    assert bundle.launcher.instance_env == (("HF_TOKEN", "hf_here_now"), ("UCX_TLS", "tcp"))
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(BundleError, match="set HF_TOKEN in this environment"):
        bundle.launcher  # noqa: B018 - the property is what is read


def test_no_secret_reaches_summary_responses_or_verdicts(run_dir, model_dir, monkeypatch):
    """Found in review: only the bundle's four files were scrubbed; summary.json, verdicts.txt
    and responses.json (written beside them by `write_run_outputs`) kept a secret an error
    or an answer carried, though no artifact may."""
    from harness.report.run_outputs import write_run_outputs

    monkeypatch.setenv("EPD_TEST_API_KEY", ENV_SECRET)
    records, _ = sample_run()  # the ERROR case's text carries SECRET
    failed = Outcome("image", error=f"HTTP 500 {SECRET} and {ENV_SECRET}")
    write_run_outputs(
        run_dir, records, {"2E+1PD": {"image": failed}}, {}, run_info(run_dir, model_dir)
    )
    for name in ("summary.json", "verdicts.txt", "responses.json"):
        text = (run_dir / name).read_text()
        assert SECRET not in text and ENV_SECRET not in text, name


def test_a_secret_only_an_instances_command_held_stays_out_of_every_file(tmp_path):
    """Found in review: the bundle learnt the instances' secrets from their `.cmd.json` files,
    but those are written redacted at launch (`command_json`), so a secret the process's own
    environment and argv lack (the vLLM proxy's fresh ADMIN_API_KEY) was never known, and an
    error carrying it reached diff.md, junit.xml, report.html and summary.json."""
    from harness.report.run_outputs import write_run_outputs
    from harness.serve.entry import command_json
    from harness.serve.server_command import ServerCommand

    key = "admin-key-only-the-proxy-had-5150"
    run_dir = tmp_path / "run"
    log = run_dir / "1E-1P-1D" / "1E-1P-1D__vllm-proxy.log"
    log.parent.mkdir(parents=True)
    proxy = ServerCommand("1E+1P+1D/vllm-proxy", ("python", "proxy.py"), "http://h/health", log)
    proxy = dataclasses.replace(proxy, env={"ADMIN_API_KEY": key})
    log.with_suffix(".cmd.json").write_text(command_json(proxy))  # as the launch writes it
    records, _ = sample_run()
    error = Outcome("image", error=f"proxy died: registration with {key} refused")
    records[-1] = judged("2E+1PD", "baseline", Outcome("image", answer(REFERENCE_IDS)), error, [])
    write_run_outputs(run_dir, records, {}, {}, {})
    leaked = [p.name for p in run_dir.rglob("*") if p.is_file() and key in p.read_text()]
    assert leaked == []


def test_a_command_file_is_written_without_a_secret_value(tmp_path):
    """A `.cmd.json` is written at launch, long before any bundle scrubs the run: a harness
    killed mid-run leaves it as written, so no secret of its env may be in it then."""
    from harness.serve.entry import command_json
    from harness.serve.server_command import ServerCommand

    key = "admin-key-written-at-launch-6061"
    proxy = ServerCommand(
        "1E+1P+1D/vllm-proxy",
        ("python", "proxy.py"),
        "http://h/health",
        tmp_path / "p.log",
        env={"ADMIN_API_KEY": key, "NO_PROXY": "127.0.0.1"},
    )
    recorded = json.loads(command_json(proxy))
    assert recorded["env"] == {"ADMIN_API_KEY": REDACTED, "NO_PROXY": "127.0.0.1"}
    # What an instance inherits from its node is recorded too (`inherited_env`): its secret is
    # redacted there as well, and remembered for the bundle to scrub from the logs (found in
    # review: neither was checked where the file is written).
    from harness.redact import launched_secrets

    inherited = "inherited-at-launch-secret-6062"
    node_env = {"VLLM_ACCESSKEY": inherited, "VLLM_ATTENTION_BACKEND": "X"}
    recorded = json.loads(command_json(proxy, inherited=node_env))
    assert recorded["inherited_env"] == {"VLLM_ACCESSKEY": REDACTED, "VLLM_ATTENTION_BACKEND": "X"}
    assert inherited in launched_secrets()


def test_an_inherited_secret_in_a_command_file_another_process_wrote_is_redacted(tmp_path):
    """A `.cmd.json` records what its instance inherited (`inherited_env`) as well as its
    `env`; one written unredacted by another process loses the secrets of both."""
    from harness.report.bundle import Redactor, redact_command_files

    secret = "inherited-secret-value-77"
    path = tmp_path / "run" / "1P-1D" / "1P-1D__decode0.cmd.json"
    path.parent.mkdir(parents=True)
    command = {"name": "1P+1D/decode0", "argv": ["vllm"], "env": {}}
    command["inherited_env"] = {"VLLM_ACCESSKEY": secret, "VLLM_ATTENTION_BACKEND": "X"}
    path.write_text(json.dumps(command))
    assert Redactor.for_run(tmp_path / "run").text(f"saw {secret}") == f"saw {REDACTED}"
    redact_command_files(tmp_path / "run")
    recorded = json.loads(path.read_text())["inherited_env"]
    assert recorded == {"VLLM_ACCESSKEY": REDACTED, "VLLM_ATTENTION_BACKEND": "X"}


def test_a_secret_an_instances_argv_held_in_a_command_file_another_process_wrote_is_scrubbed(
    tmp_path,
):
    """A `.cmd.json` another process wrote unredacted may carry a credential on its command
    line (`--api-key VALUE`), in no environment: it is scrubbed from free text all the same."""
    from harness.report.bundle import Redactor

    secret = "argv-only-api-key-9090"
    path = tmp_path / "run" / "1P-1D" / "1P-1D__decode0.cmd.json"
    path.parent.mkdir(parents=True)
    command = {"name": "1P+1D/decode0", "argv": ["vllm", "serve", "--api-key", secret], "env": {}}
    path.write_text(json.dumps(command))
    assert Redactor.for_run(tmp_path / "run").text(f"401 for {secret}") == f"401 for {REDACTED}"


def test_a_secret_as_short_as_the_scrubbed_minimum_is_scrubbed_and_a_shorter_one_is_not():
    """MIN_SCRUBBED_LEN is the shortest value scrubbed from free text: a credential of
    exactly that length is a secret like any longer one; a shorter one is left (scrubbing
    every "1" would wreck the artifacts)."""
    from harness.redact import MIN_SCRUBBED_LEN
    from harness.report.bundle import Redactor

    shortest, shorter = "s" * MIN_SCRUBBED_LEN, "t" * (MIN_SCRUBBED_LEN - 1)
    redactor = Redactor([shortest, shorter])
    assert redactor.text(f"a {shortest} b {shorter}") == f"a {REDACTED} b {shorter}"


def test_junit_xml_has_one_testcase_per_record_and_a_failure_per_failed_policy(tmp_path):
    records, _ = sample_run()
    write_junit_xml(tmp_path, records)
    root = ET.parse(tmp_path / "junit.xml").getroot()  # parses despite the ANSI escapes
    cases = root.findall("./testsuite/testcase")
    failing = [r for r in records if not r.policy_passed]
    assert len(cases) == len(records) == 4
    assert len(root.findall("./testsuite/testcase/failure")) == len(failing) == 3
    assert root.find("testsuite").get("failures") == "3"
    assert root.get("tests") == "4"
    mismatch = cases[1]
    assert (mismatch.get("classname"), mismatch.get("name")) == ("1E+1P+1D", "image vs baseline")
    failure = mismatch.find("failure")
    assert failure.get("type") == "MISMATCH"
    assert failure.text == format_failure(records[1])
    assert cases[0].find("failure") is None
    error = cases[3].find("failure").text
    # Colour codes dropped, a bell (forbidden in XML 1.0) kept visible; scrubbing is the bundle's.
    assert f"HTTP 500 {SECRET} leaked\\x07 " in error


def test_diff_md_shows_each_failing_case_with_its_evidence(tmp_path):
    records, _ = sample_run()
    write_diff_md(tmp_path, records)
    text = (tmp_path / "diff.md").read_text()
    assert text.startswith("# EPD diff: 3 of 4 case(s) failed")
    assert f"First divergence at generated position {DIVERGENCE}" in text
    assert f"**[{REFERENCE_IDS[DIVERGENCE]}]**" in text and "**[555]**" in text
    assert "| 1 | 107 | -0.5000 | 555 | -0.5000 |" in text  # the top-k, both sides
    assert "`kv_transfer`: cached_tokens=0: D recomputed the prompt" in text
    assert "HTTP 500" in text
    assert text.count("\n## ") == 3  # the MATCH case is not in the diff


def test_diff_md_says_a_side_that_ended_at_the_divergence_ended():
    """A candidate that stopped where the reference went on: its token is `(ended)`, not
    `None`, and its ids end in the `[end]` marker at the divergence's position."""
    reference = Outcome("image", answer(REFERENCE_IDS))
    shorter = Outcome("image", answer(REFERENCE_IDS[:DIVERGENCE]))
    text = render_diff_md([judged("1P+1D", "baseline", reference, shorter, [])])
    assert "| candidate | (ended) | " in text
    candidate_row = next(line for line in text.splitlines() if line.startswith("| candidate |"))
    assert candidate_row.endswith(f"{REFERENCE_IDS[DIVERGENCE - 1]} **[end]** |")


def test_diff_md_names_the_guards_nothing_could_check_and_fences_an_error_whole():
    """A guard nothing could check is said under its own heading; an error holding a fence of
    its own (a log tail quoting Markdown) stays inside a longer one."""
    reference = Outcome("image", answer(REFERENCE_IDS))
    unchecked = GuardResult("encoder_output", False, "no EC storage in reach", checkable=False)
    failed = Outcome("image", error="HTTP 500\n```\nnot the end of the block")
    records = [
        judged(
            "1E+1P+1D", "baseline", reference, Outcome("image", answer(CANDIDATE_IDS)), [unchecked]
        ),
        judged("2E+1PD", "baseline", reference, failed, []),
    ]
    text = render_diff_md(records)
    assert "### Guards not checkable\n\n- `encoder_output`: no EC storage in reach" in text
    assert "````text\nHTTP 500\n```\nnot the end of the block\n````" in text


def test_diff_md_leaves_out_a_mismatch_that_passed_as_a_declared_failure():
    """diff.md lists what failed its policy, as the exit code and junit.xml say: a MISMATCH
    that passed as a declared release failure is no failing case of a pull request."""
    records, _ = sample_run()
    mismatch = next(r for r in records if r.verdict is Verdict.MISMATCH)
    declared = dataclasses.replace(
        mismatch, policy_passed=True, declared_failure="video-timing-before-0.31"
    )
    assert render_diff_md([records[0], declared]) == (
        "# EPD diff\n\nAll 2 case(s) passed their policy.\n"
    )


def test_diff_md_for_a_passing_run_is_a_short_note():
    records, _ = sample_run()
    assert render_diff_md(records[:1]) == "# EPD diff\n\nAll 1 case(s) passed their policy.\n"
    assert "proves nothing" in render_diff_md([])


def test_html_highlights_the_divergence_on_both_sides_and_escapes_text():
    records, responses = sample_run()
    page = render_report_html(records, responses, {})
    reference_token, candidate_token = REFERENCE_IDS[DIVERGENCE], 555
    assert (
        f'id="case-1-ref-div" title="position {DIVERGENCE}: first divergence">'
        f"{reference_token}</span>" in page
    )
    assert (
        f'id="case-1-can-div" title="position {DIVERGENCE}: first divergence">'
        f"{candidate_token}</span>" in page
    )
    assert page.count('class="t diverge"') == 2 + 1  # both sides, plus the legend's sample
    assert "<script" not in page
    assert "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;" in page
    for verdict in (Verdict.MATCH, Verdict.MISMATCH, Verdict.VACUOUS, Verdict.ERROR):
        assert f'class="badge verdict-{verdict.value.lower()}"' in page
    assert "cached_tokens=0: D recomputed the prompt" in page


def test_html_says_fail_for_a_run_without_cases_and_in_its_title_for_a_run_problem():
    """A run that judged nothing proved nothing, and one its problems failed exits 1 however
    its cases went: report.html's badge and its title (what a browser tab and an artifact
    list show) say FAIL for both, as summary.json and the exit code do."""
    empty = render_report_html([], {}, {})
    assert '<span class="status fail">FAIL</span>' in empty
    assert "<title>EPD report: FAIL</title>" in empty
    records, responses = sample_run()
    failed_by_problem = render_report_html(records[:1], responses, {"problems": ["check x"]})
    assert "<title>EPD report: FAIL</title>" in failed_by_problem
    assert "<title>EPD report: PASS</title>" in render_report_html(records[:1], responses, {})


def test_html_leads_with_the_failing_cases_expanded_and_keeps_the_passing_collapsed():
    """The page leads with what needs a person's eyes: a failing case comes first and open,
    a passing one after it and closed, each under its anchor from the verdict table."""
    records, responses = sample_run()  # records[0] a MATCH, records[1] a MISMATCH
    page = render_report_html(records[:2], responses, {})
    failing = page.index('<details class="case fail" id="case-1" open>')
    passing = page.index('<details class="case pass" id="case-0">')
    assert failing < passing


def test_html_escapes_a_prompt_name_wherever_it_is_shown():
    """A prompt's name comes from a cases file or a fuzz draw: markup in it is text in the
    verdict table and in its case's summary, never markup of the page."""
    records, responses = sample_run()
    hostile = dataclasses.replace(records[0], prompt=HOSTILE_TEXT)
    page = render_report_html([hostile], responses, {})
    assert HOSTILE_TEXT not in page
    assert page.count("&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;") >= 2


def test_html_falls_back_to_the_windows_without_responses():
    records, _ = sample_run()
    page = render_report_html(records[1:2], {}, {})
    assert 'id="case-0-ref-div"' in page and 'id="case-0-can-div"' in page


def test_run_json_and_the_report_name_each_instances_node(run_dir, model_dir):
    """An instance placed on a node of a cluster (--launcher ray) carries it from its
    .cmd.json into run.json and the report; the launcher itself is recorded too."""
    path = run_dir / "1E-1P-1D" / "1E-1P-1D__decode0.cmd.json"
    command = json.loads(path.read_text())
    node = {"address": "10.0.0.4", "node_id": "ab12", "hostname": "node-d"}
    path.write_text(json.dumps({**command, "node": node}))
    settings = RunSettings(
        ServingConfig(model=str(model_dir)),
        run_dir,
        vllm=SERVED,
        launcher=LauncherChoice("ray", ray_address="10.0.0.1:6379"),
    )
    info = write_run_info(settings, (TOPOLOGIES["1E+1P+1D"],), SKELETON_PROMPTS[:1])
    on_disk = json.loads((run_dir / "run.json").read_text())
    assert on_disk["instances"]["1E+1P+1D/decode0"]["node"] == node
    assert on_disk["launcher"]["kind"] == "ray"
    assert on_disk["launcher"]["ray_address"] == "10.0.0.1:6379"
    page = render_report_html([], {}, {**info, "instances": on_disk["instances"]})
    assert "# 1E+1P+1D/decode0 (on node 10.0.0.4, node-d)" in page


def test_run_json_says_which_instances_one_waited_for_before_its_spawn(run_dir, model_dir):
    """An instance spawned only once those before it on a shared GPU were healthy: run.json
    says so, since its startup_s counts from its own spawn, not its topology's start."""
    path = run_dir / "1E-1P-1D" / "1E-1P-1D__decode0.cmd.json"
    command = json.loads(path.read_text())
    path.write_text(json.dumps({**command, "start_after": ["1E+1P+1D/prefill0"]}))
    write_run_info(
        RunSettings(ServingConfig(model=str(model_dir)), run_dir, vllm=SERVED),
        (TOPOLOGIES["1E+1P+1D"],),
        SKELETON_PROMPTS[:1],
    )
    instances = json.loads((run_dir / "run.json").read_text())["instances"]
    assert instances["1E+1P+1D/decode0"]["start_after"] == ["1E+1P+1D/prefill0"]


def test_a_run_on_a_ray_cluster_does_not_record_this_hosts_devices_as_its_own(run_dir, model_dir):
    """With --launcher ray --ray-address the instances run on the cluster's nodes: run.json's
    `devices_used` described the harness's own host (its CPU model, its GPUs), and
    verdicts.txt, report.html and ISSUE.md then named a machine that computed none of the
    ids (found in review). It says it did not read them; a one-host rehearsal cluster runs
    here, and reads this host as a local run does."""
    from harness.spec.settings import RAY_LAUNCHER

    remote = LauncherChoice(RAY_LAUNCHER, ray_address="10.0.0.1:6379")
    settings = RunSettings(ServingConfig(model=str(model_dir)), run_dir, launcher=remote)
    write_run_info(settings, (TOPOLOGIES["1E+1PD"],), SKELETON_PROMPTS[:1])
    used = DevicesUsed.from_json(json.loads((run_dir / "run.json").read_text())["devices_used"])
    assert used.model is None and used.amx is None, used
    assert "the Ray cluster at 10.0.0.1:6379" in used.source
    assert "not read here: the instances ran on the Ray cluster at 10.0.0.1:6379" in (
        used.describe()
    )
    rehearsal = dataclasses.replace(settings, launcher=LauncherChoice(RAY_LAUNCHER))
    write_run_info(rehearsal, (TOPOLOGIES["1E+1PD"],), SKELETON_PROMPTS[:1])
    here = json.loads((run_dir / "run.json").read_text())["devices_used"]
    assert here == devices.run_devices("cpu", False, settings.devices).to_json()


@pytest.mark.parametrize(
    ("facts", "line"),
    [
        ({"fault": "corrupt-ec"}, "red on purpose: the run planted the fault corrupt-ec"),
        (
            {"fault": None, "killed": "1E+1P+1D/decode0"},
            "red on purpose: the load killed 1E+1P+1D/decode0 with its requests in flight",
        ),
        ({"fault": None}, None),
    ],
)
def test_verdicts_say_when_a_run_is_red_on_purpose(
    tmp_path: Path, facts: dict, line: str | None
) -> None:
    """A green GPU night leaves red bundles on purpose (a self-test's planted fault, a death
    under load), and the cherry-pick workflow puts every verdicts.txt into its summary page:
    their tables read as failures of the vLLM under test, with nothing to say otherwise."""
    from harness.report.run_outputs import VERDICTS_FILE, write_verdicts

    records, _ = sample_run()
    write_verdicts(tmp_path, records, facts)
    text = (tmp_path / VERDICTS_FILE).read_text()
    if line is None:
        assert "red on purpose" not in text, text
    else:
        assert text.splitlines()[0] == line, text


@pytest.mark.parametrize("planted", [{"fault": "ec-noise:0.05"}, {}])
def test_diff_md_and_report_html_say_a_run_is_red_on_purpose(
    run_dir: Path, model_dir: Path, planted: dict
) -> None:
    """`run --plant-fault ec-noise:0.05` (real vLLM, 1E+1PD): only verdicts.txt said the run was
    red on purpose; its diff.md ("1 of 1 case(s) failed") and report.html (FAIL) read as a
    failure of vLLM to whoever opens the bundle's artifacts first, as CI shows them."""
    records, responses = sample_run()
    write_bundle(run_dir, records, responses, {**run_info(run_dir, model_dir), **planted})
    said = "red on purpose: the run planted the fault ec-noise:0.05"
    diff = (run_dir / "diff.md").read_text()
    page = (run_dir / "report.html").read_text()
    assert (said in diff) is bool(planted), diff[:300]
    assert (said in page) is bool(planted)
    assert diff.startswith("# EPD diff: 3 of 4 case(s) failed")


def test_the_providers_of_every_installed_package_are_the_standard_librarys() -> None:
    """`package_providers` narrows `packages_distributions()` (0.4 CPU-s a process) to the
    packages a bundle names: for every top-level package of this environment, the same
    distributions in the same order."""
    everything = importlib.metadata.packages_distributions()
    assert "harness" in everything and "pytest" in everything, sorted(everything)[:20]
    assert package_providers(sorted(everything)) == everything
    assert package_providers(["no_such_package_of_epd"]) == {}


class _Dist(importlib.metadata.Distribution):
    """A distribution read from a dict of its metadata files."""

    def __init__(self, files: dict[str, str]) -> None:
        self._files = files

    def read_text(self, filename: str) -> str | None:
        return self._files.get(filename)

    def locate_file(self, path):  # pragma: no cover - never asked here
        raise NotImplementedError


def test_providers_follow_top_level_txt_else_the_py_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A declared top_level.txt wins over the files; without one, a RECORD's .py files name
    the packages (a package's modules, or a top-level module), never its data files; a
    distribution with neither RECORD nor top_level.txt provides nothing; each package lists
    its providers in the order the distributions are found."""
    dists = [
        _Dist({"METADATA": "Name: declares\n", "top_level.txt": "vllm\n",
               "RECORD": "torch/__init__.py,,\n"}),
        _Dist({"METADATA": "Name: infers\n",
               "RECORD": "torch/__init__.py,,\nvllm_data/x.json,,\ntransformers.py,,\n"}),
        _Dist({"METADATA": "Name: data-only\n", "RECORD": "vllm/kernels.so,,\nharness.txt,,\n"}),
        _Dist({"METADATA": "Name: no-files\n"}),
        _Dist({"METADATA": "Name: second-vllm\n", "RECORD": "vllm/__init__.py,,\n"}),
    ]  # fmt: skip
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter(dists))
    providers = package_providers(["vllm", "torch", "transformers", "harness", "vllm_data"])
    assert providers == {
        "vllm": ["declares", "second-vllm"],
        "torch": ["infers"],
        "transformers": ["infers"],
    }
    assert providers == {
        package: names
        for package, names in importlib.metadata.packages_distributions().items()
        if package in providers or package in {"harness", "vllm_data"}
    }


@pytest.mark.parametrize(
    "label, key",
    [("1E+1PD:ec-video-mp4", "matrix:ec-video-mp4"), ("1E+1PD:load#3", "load:1E+1PD:3")],
)
def test_html_shows_a_matrix_or_load_cases_answer_from_where_responses_json_keeps_it(
    label: str, key: str
) -> None:
    """Found in review: a matrix scenario's case is labelled `TOPOLOGY:SCENARIO` and a load's
    `TOPOLOGY:load#N`, while responses.json keeps their answers under `matrix:SCENARIO` and
    `load:TOPOLOGY:N`: report.html looked under the label and showed every such candidate as
    "no response recorded", its ids and the divergence in them left out."""
    records, responses = sample_run()
    record = dataclasses.replace(records[1], topology=label)
    responses = {"baseline": responses["baseline"], key: responses["1E+1P+1D"]}
    page = render_report_html([record], responses, {})
    assert "no response recorded" not in page
    assert 'id="case-0-can-div" title="position 7: first divergence">555</span>' in page


def test_junit_xml_of_a_run_failed_by_its_problems_has_a_failing_case(tmp_path):
    """A run whose every case passed but which its problems failed (an unproven pass, a fault
    that acted on nothing) exits 1; its junit.xml, which CI annotates from, showed 0 failures
    (found in review). The problems are one failing testcase of their own."""
    records, _ = sample_run()
    passing = [r for r in records if r.policy_passed]
    problems = ["problem: 1E+1P+1D:video (against baseline): guard kv_transfer not checkable"]
    write_junit_xml(tmp_path, passing, problems)
    root = ET.parse(tmp_path / "junit.xml").getroot()
    cases = root.findall("./testsuite/testcase")
    assert len(cases) == len(passing) + 1
    assert root.get("failures") == root.find("testsuite").get("failures") == "1"
    # Counted among the tests too: tests="N" failures="N+1" reads as a broken report.
    assert root.get("tests") == root.find("testsuite").get("tests") == str(len(cases))
    failure = cases[-1].find("failure")
    assert cases[-1].get("name") == "run problems"
    assert failure is not None and problems[0] in failure.text


def test_junit_xml_fails_only_what_failed_its_policy_not_every_non_match(tmp_path):
    """A MISMATCH that passed as a declared release failure exits 0, as summary.json and the
    table say: junit.xml, which CI annotates from, must not show it failed."""
    records, _ = sample_run()
    mismatch = next(r for r in records if r.verdict is Verdict.MISMATCH)
    declared = dataclasses.replace(
        mismatch, policy_passed=True, declared_failure="video-timing-before-0.31"
    )
    write_junit_xml(tmp_path, [records[0], declared])
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert root.get("failures") == "0"
    assert root.findall("./testsuite/testcase/failure") == []


def test_junit_xml_of_a_run_without_cases_has_a_failing_case(tmp_path):
    """A run that judged no case exits 1 and its summary.json says `passed: false` (it proved
    nothing); its junit.xml said tests="0" failures="0", which a CI view shows as nothing
    failed (found in review). The missing cases are one failing testcase of their own."""
    write_junit_xml(tmp_path, [])
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert root.get("failures") == root.find("testsuite").get("failures") == "1"
    (case,) = root.findall("./testsuite/testcase")
    assert "proves nothing" in case.find("failure").text


def test_junit_xml_of_a_run_failed_by_several_problems_shows_every_one(tmp_path):
    """A CI view shows a failure's text, not the run's summary.json: each problem that failed
    the run is in it, not only the first (its message names the first)."""
    records, _ = sample_run()
    passing = [r for r in records if r.policy_passed]
    problems = ["problem: an unproven pass", "problem: the planted fault acted on nothing"]
    write_junit_xml(tmp_path, passing, problems)
    root = ET.parse(tmp_path / "junit.xml").getroot()
    (failure,) = root.findall("./testsuite/testcase[@name='run problems']/failure")
    assert failure.get("message") == problems[0]
    assert failure.text.splitlines() == problems


@pytest.mark.parametrize(
    "reference_top, candidate_top, rows",
    [
        (
            [[107, -0.5], [108, -1.25], [109, -2.0]],
            [[555, -0.5], [107, -1.0]],
            ["| 1 | 107 | -0.5000 | 555 | -0.5000 |", "| 2 | 108 | -1.2500 | 107 | -1.0000 |"]
            + ["| 3 | 109 | -2.0000 |  |  |"],
        ),
        ([[107, -0.5]], None, ["| 1 | 107 | -0.5000 |  |  |"]),  # the candidate asked none
    ],
    ids=["uneven", "one-side"],
)
def test_diff_md_shows_every_rank_of_either_sides_top_k(reference_top, candidate_top, rows):
    """The top-k table runs to the longer side's last rank, each side's cells empty past its
    own; a side without log-probs leaves its cells empty, the other side's still shown."""
    records, _ = sample_run()
    mismatch = next(r for r in records if r.verdict is Verdict.MISMATCH)
    divergence = {
        **mismatch.divergence,
        "reference_top": reference_top,
        "candidate_top": candidate_top,
    }
    text = render_diff_md([dataclasses.replace(mismatch, divergence=divergence)])
    table = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert table == rows


def test_diff_md_escapes_markup_in_a_cases_detail_and_evidence():
    """diff.md is posted as a pull-request comment: a chat template's <|image_pad|> or a
    log's <stdin> in a detail is text to show, not an HTML tag GitHub drops."""
    records, _ = sample_run()
    mismatch = next(r for r in records if r.verdict is Verdict.MISMATCH)
    tagged = dataclasses.replace(mismatch, detail="ids differ after <|image_pad|> <stdin>")
    text = render_diff_md([tagged])
    assert "<|image_pad|>" not in text and "<stdin>" not in text
    assert "- detail: ids differ after &lt;" in text and "&lt;stdin&gt;" in text


def test_a_secret_in_the_env_of_a_command_file_another_process_wrote_is_scrubbed(tmp_path):
    """A `.cmd.json` another process wrote unredacted: its `env`'s credentials are scrubbed
    from free text, as its `inherited_env`'s and its argv's are."""
    from harness.report.bundle import Redactor

    secret = "env-only-hf-token-4242"
    path = tmp_path / "run" / "1P-1D" / "1P-1D__prefill0.cmd.json"
    path.parent.mkdir(parents=True)
    command = {"name": "1P+1D/prefill0", "argv": ["vllm"], "env": {"HF_TOKEN": secret}}
    path.write_text(json.dumps(command))
    assert Redactor.for_run(tmp_path / "run").text(f"403 for {secret}") == f"403 for {REDACTED}"
