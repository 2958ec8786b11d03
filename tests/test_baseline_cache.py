"""The baseline cache: keys that change with anything numerics-relevant, corrupt entries refused."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from harness.outcomes import chat as chat_module
from harness.outcomes.chat import ChatResult, PositionLogprobs
from harness.outcomes.outcome import Outcome
from harness.run import baseline_cache, baseline_launch
from harness.run.baseline import BaselineAnswers
from harness.run.baseline_cache import (
    BaselineCache,
    BaselineCacheError,
    CacheProvenance,
    baseline_key,
)
from harness.run.baseline_launch import BaselineLaunch
from harness.run.goldens import GoldenStore, golden_key
from harness.serve import client
from harness.spec.generations import GENERATIONS_BY_NAME
from harness.spec.inherited_env import numerics_env
from harness.spec.platforms import CPU, CUDA
from harness.spec.prompts import CACHE_SALT
from harness.spec.settings import RunSettings, ServedVllm
from harness.spec.topology import DTYPES, ServingConfig, serving_for
from harness.testing.builders import chat, outcome

pytestmark = pytest.mark.unit

SERVING = ServingConfig(model="/models/tiny")
SERVED = ServedVllm("/venv/bin/vllm", "0.32.0+cpu", "2.13.0+cpu")
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}
LAUNCH = BaselineLaunch.of(RunSettings(serving=SERVING, run_dir=Path("/run")), environ={})
RESULT = ChatResult(
    prompt_token_ids=(1, 2, 3),
    token_ids=(7, 8),
    text="ab",
    finish_reason="length",
    logprobs=(PositionLogprobs(7, -0.5, ((7, -0.5), (9, -1.0))),),
)


def test_key_is_stable_and_changes_with_what_changes_tokens() -> None:
    key = baseline_key(SERVED, SERVING, "digest-a", BODY, launch=LAUNCH)
    assert key == baseline_key(SERVED, SERVING, "digest-a", dict(BODY), launch=LAUNCH)
    assert key != baseline_key(SERVED, SERVING, "digest-b", BODY, launch=LAUNCH), (
        "model content must be in the key"
    )
    assert key != baseline_key(
        SERVED, dataclasses.replace(SERVING, block_size=16), "digest-a", BODY, launch=LAUNCH
    )
    assert key != baseline_key(
        SERVED,
        dataclasses.replace(SERVING, cpu_threads_per_instance=2),
        "digest-a",
        BODY,
        launch=LAUNCH,
    )
    assert key != baseline_key(SERVED, SERVING, "digest-a", {**BODY, "seed": 7}, launch=LAUNCH)


def test_key_is_the_served_vllm_and_torch_not_the_harness_interpreters() -> None:
    """Trap: the key once read the vLLM version of the harness's own interpreter, so a
    baseline of one vLLM was reused for another served through --vllm."""
    key = baseline_key(SERVED, SERVING, "d", BODY, launch=LAUNCH)
    other_vllm = dataclasses.replace(SERVED, version="0.31.0+cpu")
    other_torch = dataclasses.replace(SERVED, torch_version="2.9.1+cpu")
    assert key != baseline_key(other_vllm, SERVING, "d", BODY, launch=LAUNCH)
    assert key != baseline_key(other_torch, SERVING, "d", BODY, launch=LAUNCH)
    moved = dataclasses.replace(SERVED, executable="/elsewhere/bin/vllm")
    assert key == baseline_key(moved, SERVING, "d", BODY, launch=LAUNCH), (
        "the same version elsewhere is equal"
    )


def test_key_is_the_served_libraries_besides_torch() -> None:
    """transformers resizes the image and tokenizers makes the prompt's ids before vLLM and
    torch compute anything: a baseline served under other versions of them must not answer a
    run (the key's `libraries`; `harness.preflight.vllm.LIBRARIES`)."""
    libraries = (("tokenizers", "0.22.1"), ("transformers", "4.57.1"))
    served = dataclasses.replace(SERVED, libraries=libraries)
    key = baseline_key(served, SERVING, "d", BODY, launch=LAUNCH)
    for changed in (
        (("tokenizers", "0.22.1"), ("transformers", "4.58.0")),
        (("tokenizers", "0.21.0"), ("transformers", "4.57.1")),
        (("transformers", "4.57.1"),),
    ):
        other = dataclasses.replace(SERVED, libraries=changed)
        assert key != baseline_key(other, SERVING, "d", BODY, launch=LAUNCH), (
            f"an entry served under {dict(libraries)} answers a run under {dict(changed)}"
        )


def test_unknown_served_version_is_never_cached() -> None:
    with pytest.raises(ValueError, match="unknown vLLM version"):
        baseline_key(ServedVllm("/opt/vllm", "unknown"), SERVING, "d", BODY, launch=LAUNCH)


def test_an_editable_install_whose_code_cannot_be_identified_is_never_keyed() -> None:
    """Its version names no code (the tree may have been edited since it was installed), and
    its code state could not be read: an entry keyed without that state would answer a run of
    other code under the same version."""
    unreadable = dataclasses.replace(
        SERVED, source_tree="/src/vllm", source_state="", source_problem="git: not a repository"
    )
    with pytest.raises(ValueError, match="cannot be identified"):
        baseline_key(unreadable, SERVING, "d", BODY, launch=LAUNCH)
    readable = dataclasses.replace(unreadable, source_state="git abc + diff 0123")
    assert baseline_key(readable, SERVING, "d", BODY, launch=LAUNCH) != baseline_key(
        dataclasses.replace(readable, source_state="git abd + diff 0123"),
        SERVING,
        "d",
        BODY,
        launch=LAUNCH,
    ), "two states of the tree share an entry"


def test_key_ignores_where_the_model_lives() -> None:
    moved = dataclasses.replace(SERVING, model="/elsewhere/tiny")
    assert baseline_key(SERVED, SERVING, "d", BODY, launch=LAUNCH) == baseline_key(
        SERVED, moved, "d", BODY, launch=LAUNCH
    )


def test_store_then_load_round_trips(tmp_path: Path) -> None:
    cache = BaselineCache(tmp_path)
    assert cache.load("k", "image") is None
    with cache.locked():
        cache.store("k", Outcome(prompt="image", result=RESULT), noise_floor_nats=0.25)
    loaded = cache.load("k", "image")
    assert loaded is not None and loaded.outcome.result == RESULT
    assert loaded.outcome.prompt == "image" and loaded.noise_floor_nats == 0.25


def test_an_entry_reads_back_who_computed_it_and_what_its_batched_pass_saw(
    tmp_path: Path,
) -> None:
    """A warm run's stability line is all a user chasing a MISMATCH has of a reference it did
    not serve: what the batched pass saw, and which build computed it where and when (an
    editable install's code state too: its version names no code). Mutants that dropped the
    stored batch detail, the code state read back, and the time from the line survived."""
    served = dataclasses.replace(SERVED, source_tree="/src/vllm", source_state="git abc + diff 01")
    cache = BaselineCache(tmp_path)
    detail = "batched with another request: same ids"
    cache.store("k", Outcome("image", result=RESULT), 0.25, detail, batched=True, served=served)
    loaded = cache.load("k", "image")
    assert loaded is not None and loaded.batch_detail == detail
    assert loaded.provenance == CacheProvenance(
        vllm=SERVED.version,
        torch=SERVED.torch_version,
        vllm_source="git abc + diff 01",
        host=socket.gethostname(),
        created=loaded.provenance.created,
    )
    described = loaded.provenance.describe()
    for shown in (SERVED.version, "(git abc + diff 01)", SERVED.torch_version):
        assert shown in described, (shown, described)
    assert described.endswith(f"on {socket.gethostname()} at {loaded.provenance.created}")


def test_refreshing_reads_no_entry_an_earlier_run_stored_only_what_it_stored_itself(
    tmp_path: Path,
) -> None:
    """--refresh-baseline is how a user distrusts what the cache holds (a vLLM rebuilt in
    place, an entry computed on a broken node): an entry an earlier run stored is a miss, so
    the baseline is served again; what this run (or a worker of its session, through the
    ledger) stored afresh is read, so the refresh starts the baseline once, not per worker."""
    earlier = BaselineCache(tmp_path / "cache")
    with earlier.locked():
        earlier.store("k", Outcome("image", result=RESULT), 0.25, batched=True)
    ledger = tmp_path / "ledger"
    refreshing = BaselineCache(tmp_path / "cache", refresh=True, refresh_ledger=ledger)
    assert refreshing.load("k", "image") is None, "--refresh-baseline read a stale entry"
    with refreshing.locked():
        refreshing.store("k", Outcome("image", result=RESULT), 0.5, batched=True)
    renewed = refreshing.load("k", "image")
    assert renewed is not None and renewed.noise_floor_nats == 0.5
    worker = BaselineCache(tmp_path / "cache", refresh=True, refresh_ledger=ledger)
    stored = worker.load("k", "image")
    assert stored is not None and stored.noise_floor_nats == 0.5


def test_an_unbatched_answer_never_replaces_a_batched_one_of_the_same_body(
    tmp_path: Path,
) -> None:
    """The sweep's `text` (batched) and a matrix scenario's stage-setting request (not) are one
    body under two names: whichever was stored last won, and a worker that then wanted the
    batched one missed and started the baseline again (the fake GPU night's third start)."""
    cache = BaselineCache(tmp_path)
    with cache.locked():
        cache.store("k", Outcome("text", result=RESULT), 0.25, "batched", batched=True)
        cache.store("k", Outcome("stage", result=RESULT), 0.0, "control only", batched=False)
    kept = cache.load("k", "text")
    assert kept is not None and kept.batched and kept.noise_floor_nats == 0.25
    with cache.locked():
        cache.store("u", Outcome("stage", result=RESULT), 0.0, "control only", batched=False)
        cache.store("u", Outcome("text", result=RESULT), 0.25, "batched", batched=True)
    upgraded = cache.load("u", "text")
    assert upgraded is not None and upgraded.batched, "a batched answer replaces an unbatched one"
    refreshing = BaselineCache(tmp_path, refresh=True)
    with refreshing.locked():
        refreshing.store("k", Outcome("stage", result=RESULT), 0.0, "control only", batched=False)
    renewed = refreshing.load("k", "stage")
    assert renewed is not None and not renewed.batched, "--refresh-baseline replaces the old"


def test_a_second_worker_waits_for_the_lock_the_first_holds(tmp_path: Path) -> None:
    """The lock is what makes a parallel worker wait while the first computes the baseline,
    then read what it stored, rather than start a baseline of its own. Mutants that took no
    lock, or a shared one, survived. (Two opens of the lock file lock each other as two
    processes do: flock belongs to the open file.)"""
    first, second = BaselineCache(tmp_path), BaselineCache(tmp_path)
    entered, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with second.locked():
            entered.set()
            release.wait(10)

    with first.locked():
        waiter = threading.Thread(target=hold_the_lock)
        waiter.start()
        assert not entered.wait(0.5), "a second worker took the lock the first holds"
    assert entered.wait(10), "the lock was not handed on once released"
    release.set()
    waiter.join(10)


def test_failed_outcomes_are_not_stored(tmp_path: Path) -> None:
    cache = BaselineCache(tmp_path)
    cache.store("k", Outcome(prompt="image", error="boom"))
    assert cache.load("k", "image") is None


@pytest.mark.parametrize("stored", ["{not json", "[]", "null", '"an answer"'])
def test_corrupt_entry_is_an_error_naming_the_file(tmp_path: Path, stored: str) -> None:
    """JSON that is no object (a list, null, a string) is as corrupt as JSON that does not
    parse: the same one line naming the file, never a traceback from reading its fields."""
    (tmp_path / "k.json").write_text(stored)
    with pytest.raises(BaselineCacheError, match=r"corrupt baseline cache entry .*k\.json"):
        BaselineCache(tmp_path).load("k", "image")


@pytest.mark.parametrize("floor", [math.inf, math.nan, -0.25, "0.25", True, None], ids=repr)
def test_a_stored_noise_floor_that_is_no_measurement_is_a_corrupt_entry(
    tmp_path: Path, floor: object
) -> None:
    """The floor is the tolerance every comparison with this answer is judged under: read as
    stored, an inf (a hand-edited or damaged file) made every near-tie a DRIFT, and a NaN, a
    negative floor, a string or a boolean stood in for a measured one. Such an entry is refused
    as any corrupt entry is, naming the file and the field."""
    cache = BaselineCache(tmp_path)
    cache.store("k", Outcome(prompt="image", result=RESULT), noise_floor_nats=0.25)
    entry = json.loads(cache.path("k").read_text())
    cache.path("k").write_text(json.dumps({**entry, "noise_floor_nats": floor}))
    with pytest.raises(
        BaselineCacheError, match=r"corrupt baseline cache entry .*k\.json: noise_floor_nats"
    ):
        cache.load("k", "image")


@pytest.mark.parametrize("batched", ["false", "true", 0, 1, None, [False]], ids=repr)
def test_a_stored_batched_flag_that_is_no_boolean_is_a_corrupt_entry(
    tmp_path: Path, batched: object
) -> None:
    """`batched` says whether the batched pass measured the answer (an answer that only had
    the control must not pass for one that was batched); read with bool(), a stored "false"
    read True. A non-boolean is refused as any corrupt entry is, naming the file and field."""
    cache = BaselineCache(tmp_path)
    cache.store("k", Outcome(prompt="image", result=RESULT), noise_floor_nats=0.25)
    entry = json.loads(cache.path("k").read_text())
    cache.path("k").write_text(json.dumps({**entry, "batched": batched}))
    with pytest.raises(
        BaselineCacheError, match=r"corrupt baseline cache entry .*k\.json: batched"
    ):
        cache.load("k", "image")


# -- the baseline's launch: argv, environment (rendered and inherited), device ----------------

RUN_BODY = {"model": "epd-model", "messages": [{"role": "user", "content": "hi"}], "seed": 1}


def run_settings(tmp_path: Path, **fields: Any) -> RunSettings:
    serving = serving_for(CPU, "/not-a-dir-model", max_model_len=4096)
    return RunSettings(serving=serving, run_dir=tmp_path / "run", vllm=SERVED, **fields)


def test_a_numerics_env_var_the_baseline_inherits_changes_the_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every instance, the baseline included, is launched with os.environ plus its additions
    (harness/serve/launch.py: env={**os.environ, **command.env}). A variable that picks other
    kernels (VLLM_ATTENTION_BACKEND, VLLM_CPU_*, ONEDNN_*, CUBLAS_WORKSPACE_CONFIG, ...)
    changes the baseline's answer, so a baseline cached without it must not answer a run with
    it: otherwise EPD (served with it) is judged against a baseline served without it (found
    in review)."""
    answers = BaselineAnswers(run_settings(tmp_path), BaselineCache(tmp_path / "cache"))
    for name in ("VLLM_ATTENTION_BACKEND", "ONEDNN_DEFAULT_FPMATH_MODE", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    plain = answers.cache_key(RUN_BODY)
    for name, value in (
        ("VLLM_ATTENTION_BACKEND", "FLASHINFER"),
        ("ONEDNN_DEFAULT_FPMATH_MODE", "BF16"),
        ("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
    ):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert answers.cache_key(RUN_BODY) != plain, (
                f"the baseline served under {name}={value} hits the entry of one served without it"
            )


def test_the_cpu_capability_torch_is_told_to_use_changes_the_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATEN_CPU_CAPABILITY makes torch run its default / AVX2 / AVX-512 kernels whatever the
    CPU has, and those round differently: on an AVX-512 host, float32 softmax, exp, gelu,
    layer_norm and sums came out with other bits under `default` (measured, torch 2.13.0+cpu),
    and the tiny model built under it differs (fixtures/tiny_model.py). The device in the key
    is read from /proc/cpuinfo, the same with or without the variable, and ATEN_ was no
    prefix of the rule: a baseline served under one capability answered a run under another."""
    answers = BaselineAnswers(run_settings(tmp_path), BaselineCache(tmp_path / "cache"))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    plain = answers.cache_key(RUN_BODY)
    keys = {plain}
    for capability in ("default", "avx2", "avx512"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        keys.add(answers.cache_key(RUN_BODY))
    assert len(keys) == 4, "a baseline served under one ATEN_CPU_CAPABILITY answers another"


def test_the_isa_fbgemm_is_told_to_use_changes_the_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATEN_CPU_CAPABILITY's sibling one library down: FBGEMM_ENABLE_INSTRUCTIONS makes torch's
    FBGEMM (its int8 and fp16-weight GEMMs) run the kernels of the named ISA whatever the CPU
    has, and before VNNI its u8 x i8 GEMM saturates pairs of products in int16 where VNNI's
    accumulates in int32: other numbers for the same inputs. /proc/cpuinfo (the key's device)
    cannot show it, and FBGEMM_ was no prefix of the rule (found in review of format 7)."""
    answers = BaselineAnswers(run_settings(tmp_path), BaselineCache(tmp_path / "cache"))
    monkeypatch.delenv("FBGEMM_ENABLE_INSTRUCTIONS", raising=False)
    keys = {answers.cache_key(RUN_BODY)}
    for isa in ("AVX2", "AVX512", "AVX512_E1"):
        monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", isa)
        keys.add(answers.cache_key(RUN_BODY))
    assert len(keys) == 4, "a baseline served under one FBGEMM_ENABLE_INSTRUCTIONS answers another"


def test_the_model_in_the_key_is_the_served_files_content_whoever_built_them(
    tmp_path: Path,
) -> None:
    """The tiny model's cache directory is named by what builds it (its source, torch,
    tokenizers), not by transformers' version or the CPU capability it was built under, so a
    checkpoint built elsewhere may be served (fixtures/tiny_model.py). The baseline cache must
    then follow the bytes served, never the directory's name: one bfloat16 step in a weight
    (what a build under another ATEN_CPU_CAPABILITY gives) is another key; the version string
    transformers stamps into config.json is not."""
    model = tmp_path / "models" / "tiny-qwen25vl-0123456789ab"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"hidden_size": 128, "transformers_version": "5.19.0"}')
    (model / "model.safetensors").write_bytes(bytes(range(64)))
    (model / ".complete").write_text("key\n")

    def key() -> str:
        settings = dataclasses.replace(
            run_settings(tmp_path),
            serving=serving_for(CPU, str(model), max_model_len=4096),
        )
        return BaselineAnswers(settings, BaselineCache(tmp_path / "cache")).cache_key(RUN_BODY)

    built_here = key()
    (model / "config.json").write_text('{"transformers_version": "5.20.0", "hidden_size": 128}')
    assert key() == built_here, "the writer's transformers version is no part of the model"
    (model / "model.safetensors").write_bytes(bytes(range(63)) + b"\x40")
    assert key() != built_here, "other weights under the same directory name shared a key"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("VLLM_LOGGING_LEVEL", "DEBUG"),
        ("VLLM_PORT", "23456"),
        ("VLLM_HOST_IP", "10.0.0.7"),
        ("VLLM_NIXL_SIDE_CHANNEL_PORT", "25001"),
        ("VLLM_CACHE_ROOT", "/tmp/run-17/vllm-cache"),
        ("VLLM_API_KEY", "secret"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-4711"),
        ("TORCH_CPP_LOG_LEVEL", "INFO"),
        ("NCCL_DEBUG", "INFO"),
        ("CUDA_VISIBLE_DEVICES", "3"),
        ("TMPDIR", "/tmp/pytest-of-root/pytest-12"),
        ("EPD_HARNESS_PORT_DIR", "/tmp/ports-9"),
        ("HF_TOKEN", "hf_secret"),
    ],
)
def test_what_differs_from_run_to_run_for_no_numeric_reason_keeps_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """The other direction: ports, hosts, paths, caches, log levels, usage statistics and
    credentials differ between runs and hosts without changing a token. Keyed, the cache would
    never hit (harness.run.baseline_launch: the rule)."""
    answers = BaselineAnswers(run_settings(tmp_path), BaselineCache(tmp_path / "cache"))
    monkeypatch.delenv(name, raising=False)
    plain = answers.cache_key(RUN_BODY)
    monkeypatch.setenv(name, value)
    assert answers.cache_key(RUN_BODY) == plain, f"{name}={value} changed the key"


def test_the_numerics_env_rule() -> None:
    environ = {
        "VLLM_CPU_OMP_THREADS_BIND": "0-3",
        "VLLM_ATTENTION_BACKEND": "TORCH_SDPA",
        "OMP_NUM_THREADS": "4",
        "KMP_AFFINITY": "granularity=fine",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "LD_PRELOAD": "/usr/lib/libtcmalloc.so",
        "VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE": "163840",  # TOKENS is not the word TOKEN
        "VLLM_LOGGING_CONFIG_PATH": "/etc/log.json",
        "VLLM_RPC_BASE_PATH": "/tmp/rpc",
        "PATH": "/usr/bin",
        "HOME": "/root",
    }
    assert sorted(numerics_env(environ)) == [
        "KMP_AFFINITY",
        "LD_PRELOAD",
        "MKL_ENABLE_INSTRUCTIONS",
        "OMP_NUM_THREADS",
        "VLLM_ATTENTION_BACKEND",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE",
    ]


def test_the_rendered_launch_keys_protocol_platform_and_device_not_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--protocol decides whether the baseline is rendered with --trust-request-mm-kwargs;
    a cache directory shared between hosts must not hand one CPU's (or GPU's) answers to
    another; where the run and the model live is no part of the key."""
    base = run_settings(tmp_path)
    launch = BaselineLaunch.of(base, environ={})
    assert "--trust-request-mm-kwargs" in launch.argv
    older = BaselineLaunch.of(
        dataclasses.replace(base, protocol=GENERATIONS_BY_NAME["by-hash"]), environ={}
    )
    assert "--trust-request-mm-kwargs" not in older.argv
    key = baseline_key(SERVED, base.serving, "d", RUN_BODY, launch=launch)
    assert key != baseline_key(SERVED, base.serving, "d", RUN_BODY, launch=older)
    elsewhere = dataclasses.replace(launch, device="cpu: Intel Xeon 8480+ (avx2, amx_tile)")
    assert key != baseline_key(SERVED, base.serving, "d", RUN_BODY, launch=elsewhere)
    assert launch.device.startswith("cpu: ")

    moved = dataclasses.replace(
        base,
        run_dir=tmp_path / "another-run",
        serving=dataclasses.replace(
            base.serving, model="/elsewhere/model", allowed_local_media_path="/media"
        ),
    )
    assert BaselineLaunch.of(moved, environ={}) == launch
    # A GPU host's model may come from nvidia-smi, a process: not in a unit test.
    monkeypatch.setattr(baseline_launch, "device_model", lambda platform: "cuda: test")
    cuda = dataclasses.replace(base, platform=CUDA, devices=(3,))
    rendered = dict(BaselineLaunch.of(cuda, environ={}).env)
    assert rendered["CUDA_VISIBLE_DEVICES"] == "DEVICE", "which GPU is no part of the key"


# -- the batched pass and the provenance of an entry ------------------------------------------


class NoisyWhenBatched:
    """A baseline whose answers alone are identical, but whose log-probs move by 0.05 nats in
    another batch shape (the batched pass is a request's third send)."""

    inherited_envs: list[dict[str, str]] = []  # none recorded: this process's

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}

    def send(self, name: str, body: dict[str, Any]) -> Outcome:
        name = name.removesuffix("-partner")
        self.sent[name] = self.sent.get(name, 0) + 1
        shift = 0.05 if self.sent[name] >= 3 else 0.0
        return Outcome(name, chat((5, 6), top=lambda i, t: [(t, -0.5 - shift), (t + 1, -3.0)]))


def test_an_entry_stored_without_the_batched_pass_does_not_stand_in_for_a_batched_one(
    tmp_path: Path,
) -> None:
    """The pytest session answers its scenarios' prompts as baseline-only (control only, no
    batched pass: batch_probes = the sweep's prompts) and stores them; `epd-harness run
    --scenario ...` batches every prompt (batch_probes None). Fed from that cache, the run's
    noise floor (the drift tolerance) lacked the batched pass it would have measured fresh
    (found in review). Such an entry is now a miss for a run that batches the prompt; the
    answer computed then is stored batched, and serves the next run."""
    cache = BaselineCache(tmp_path / "cache")
    bodies = {"sweep": {**RUN_BODY, "seed": 1}, "scenario": {**RUN_BODY, "seed": 2}}

    first = BaselineAnswers(run_settings(tmp_path), cache)
    first.add(bodies)
    first.batch_probes = {"sweep"}  # the pytest session: scenario prompts are baseline-only
    first.answer_on(NoisyWhenBatched())  # type: ignore[arg-type]
    assert (first.sources["sweep"]["batched"], first.sources["scenario"]["batched"]) == (
        True,
        False,
    )

    fresh = BaselineAnswers(run_settings(tmp_path), None)
    fresh.add({"scenario": bodies["scenario"]})
    fresh.answer_on(NoisyWhenBatched())  # type: ignore[arg-type]
    assert fresh.noise_floor == pytest.approx(0.05)

    control_only = BaselineAnswers(run_settings(tmp_path), cache)
    control_only.add({"scenario": bodies["scenario"]})
    control_only.batch_probes = {"sweep"}  # another session: wants no batched pass of it
    control_only.load_stored()
    assert not control_only.missing(), "an unbatched entry serves a run that batches nothing"

    warm = BaselineAnswers(run_settings(tmp_path), cache)
    warm.add({"scenario": bodies["scenario"]})  # `run --scenario`: every prompt a probe
    warm.load_stored()
    assert warm.missing() == ["scenario"], "a control-only entry stood in for a batched one"
    warm.answer_on(NoisyWhenBatched())  # type: ignore[arg-type]
    assert warm.noise_floor == pytest.approx(fresh.noise_floor)

    again = BaselineAnswers(run_settings(tmp_path), cache)
    again.add({"scenario": bodies["scenario"]})
    again.load_stored()
    assert not again.missing() and again.noise_floor == pytest.approx(fresh.noise_floor)


class RecordingBaseline:
    """A baseline that answers every request alike and keeps every body it was sent."""

    inherited_envs: list[dict[str, str]] = []  # none recorded: this process's

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def send(self, name: str, body: dict[str, Any]) -> Outcome:
        with self._lock:
            self.sent.append(body)
        return Outcome(name.removesuffix("-partner"), chat((5, 6), top=lambda i, t: [(t, -0.5)]))

    def salts(self) -> list[str | None]:
        return [body.get(CACHE_SALT) for body in self.sent]


def test_every_baseline_send_is_computed_cold_and_keyed_on_the_unsalted_body(
    tmp_path: Path,
) -> None:
    """Every EPD case goes under a cache salt of its own, the baseline's sends went unsalted:
    its control (the same request again) was served from its own prefix cache, and a prompt
    sharing leading blocks with an earlier one was partly cached. On a GPU a cache hit runs
    other kernel shapes than a cold prefill, so a near tie could flip into a spurious
    UNSTABLE_BASELINE or MISMATCH (found in review). Each send now has a salt of its own; the
    cache and the goldens stay keyed on the body as rendered, so a warm run still finds them."""
    cache, goldens = BaselineCache(tmp_path / "cache"), GoldenStore(tmp_path / "goldens")
    bodies = {"a": {**RUN_BODY, "seed": 1}, "b": {**RUN_BODY, "seed": 2}}
    answers = BaselineAnswers(run_settings(tmp_path), cache, goldens)
    answers.add(bodies)
    baseline = RecordingBaseline()
    answers.answer_on(baseline)  # type: ignore[arg-type]

    # each alone, each alone again, each batched beside its partner: 2 x 4 sends
    assert len(baseline.sent) == 8
    assert all(baseline.salts()), "a baseline send went without a cache salt"
    assert len(set(baseline.salts())) == len(baseline.sent), "two sends shared a salt"
    unsalted = [{k: v for k, v in body.items() if k != CACHE_SALT} for body in baseline.sent]
    assert all(body in bodies.values() for body in unsalted), "the salt changed the request"
    assert answers.bodies == bodies, "the salt leaked into the recorded bodies"
    launch = BaselineLaunch.of(answers.settings)
    for name, body in bodies.items():
        key = baseline_key(SERVED, answers.settings.serving, answers.digest(), body, launch=launch)
        assert answers.sources[name]["key"] == key
        assert (cache.directory / f"{key}.json").is_file()
        golden = golden_key(answers.settings.serving, answers.digest(), body, launch)
        assert (goldens.directory / golden).is_dir()

    before = len(baseline.sent)
    answers.calibrate_batched(baseline, [("request 1", "a"), ("request 2", "a")], 2)  # type: ignore[arg-type]
    assert len(baseline.sent) == before + 2
    assert all(baseline.salts()) and len(set(baseline.salts())) == len(baseline.sent)


def test_run_json_says_which_cache_entry_answered_for_the_baseline(tmp_path: Path) -> None:
    """A warm run's artifacts named no cache directory, key or the entry's provenance (which
    vLLM build, torch, host and when computed it: the entry stored none of these), and the
    verdict table and report.html did not say the baseline was not served. A user chasing a
    MISMATCH could not tell that its reference was weeks old (found in review)."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.prompts import SKELETON_PROMPTS
    from harness.spec.topology import TOPOLOGIES

    cache = BaselineCache(tmp_path / "cache")
    text = next(p for p in SKELETON_PROMPTS if p.name == "text")
    run = run_settings(tmp_path)
    sweep = Sweep(
        SweepSpec(topologies=(TOPOLOGIES["1E+1PD"],), prompts=(text,)), run, baseline_cache=cache
    )
    key = sweep.baseline.cache_key(sweep.bodies["text"])
    detail = "batched with another request: same ids"
    cache.store(key, outcome("text", (4, 5)), 0.0, detail, batched=True, served=SERVED)
    assert sweep.serve_baseline()["text"].result.token_ids == (4, 5)  # a hit: nothing started

    entry = json.loads((cache.directory / f"{key}.json").read_text())
    assert {"vllm", "torch", "host", "created", "format", "batched"} <= set(entry)
    assert (entry["vllm"], entry["torch"]) == (SERVED.version, SERVED.torch_version)
    recorded = json.loads((run.run_dir / "run.json").read_text())["baseline_sources"]["text"]
    assert recorded["source"] == "baseline cache" and recorded["key"] == key
    assert recorded["cache_dir"] == str(cache.directory)
    assert recorded["entry"]["host"] == entry["host"] == socket.gethostname()
    summary = json.loads((run.run_dir / "summary.json").read_text())["run"]
    assert str(cache.path(key)) in summary["baseline_stability"]["text"][1]
    assert summary["baseline_sources"]["text"]["key"] == key
    for shown in ("verdicts.txt", "report.html"):
        text_shown = (run.run_dir / shown).read_text()
        assert "from the baseline cache" in text_shown and entry["created"] in text_shown, shown


def test_an_entry_of_an_older_format_is_never_read(tmp_path: Path) -> None:
    """Entries of format 5 hold no provenance and no batched flag: the format is in the key,
    so they are misses (recomputed), never a crash."""
    answers = BaselineAnswers(run_settings(tmp_path), BaselineCache(tmp_path / "cache"))
    answers.add({"text": RUN_BODY})
    material_format = baseline_cache.CACHE_FORMAT
    key = answers.cache_key(RUN_BODY)
    old = {"format": 5, "result": RESULT.to_json(), "noise_floor_nats": 0.0, "batch_detail": ""}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(baseline_cache, "CACHE_FORMAT", 5)
        old_key = answers.cache_key(RUN_BODY)
    assert old_key != key and baseline_cache.CACHE_FORMAT == material_format
    answers.cache.directory.mkdir(parents=True)
    (answers.cache.directory / f"{old_key}.json").write_text(json.dumps(old))
    answers.load_stored()
    assert answers.missing() == ["text"]


def test_the_answer_parsers_code_is_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry holds the answer as harness.outcomes.chat / harness.serve.client parsed it;
    once that code changes, a fresh baseline would hold something else."""
    key = baseline_key(SERVED, SERVING, "d", BODY, launch=LAUNCH)
    monkeypatch.setattr(baseline_cache, "answer_parser_digest", lambda: "another parser")
    assert baseline_key(SERVED, SERVING, "d", BODY, launch=LAUNCH) != key


@pytest.mark.parametrize("parser", [chat_module, client], ids=lambda m: m.__name__)
def test_a_change_to_either_answer_parser_changes_its_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parser: ModuleType
) -> None:
    """harness.serve.client reads the HTTP answer (ids, log-probs, prompt ids) before
    harness.outcomes.chat makes it a ChatResult: a change to either must retire the entries
    the code before stored. Mutants that hashed only the first module, or left client out of
    `ANSWER_PARSERS`, survived."""
    before = baseline_cache.answer_parser_digest()
    edited = tmp_path / "edited.py"
    edited.write_bytes(Path(str(parser.__file__)).read_bytes() + b"# parsed otherwise\n")
    monkeypatch.setattr(parser, "__file__", str(edited))
    baseline_cache.answer_parser_digest.cache_clear()
    try:
        assert baseline_cache.answer_parser_digest() != before, f"{parser.__name__} is unhashed"
    finally:
        monkeypatch.undo()
        baseline_cache.answer_parser_digest.cache_clear()


def test_the_key_is_the_bodys_content_not_the_order_of_its_fields() -> None:
    """One request is one entry whatever order its fields come in: the sweep renders a body
    in its own order, requests.json keeps it with its fields sorted (`write_json_atomic`), and
    a key that followed the order would make them two entries, each a baseline start."""
    reordered = dict(reversed(list(BODY.items())))
    assert list(reordered) != list(BODY)
    assert baseline_key(SERVED, SERVING, "d", reordered, launch=LAUNCH) == baseline_key(
        SERVED, SERVING, "d", BODY, launch=LAUNCH
    )


class CacheLines(logging.Handler):
    """The baseline's "[baseline] cache ..." lines, as the CLI prints them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("[baseline] cache "):
            self.lines.append(message)


@contextlib.contextmanager
def cache_lines() -> Iterator[CacheLines]:
    """The baseline's cache lines logged within, at INFO whatever level the logger had."""
    lines = CacheLines()
    logger = logging.getLogger("harness.run.baseline")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


@pytest.mark.parametrize("stored_meanwhile", [False, True])
def test_a_baseline_started_for_a_miss_prints_one_cache_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored_meanwhile: bool
) -> None:
    """Found walking the CLI: `load` printed "[baseline] cache DIR: 0 hit(s), N to compute"
    twice: the cache was read to decide whether the baseline must start, and read again
    under its lock before starting it (a parallel worker may have stored the answers), each
    read saying so. The second read speaks only when it found what a parallel run stored."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.prompts import SKELETON_PROMPTS

    cache = BaselineCache(tmp_path / "cache")
    text = next(p for p in SKELETON_PROMPTS if p.name == "text")
    sweep = Sweep(
        SweepSpec((), (), baseline_only_prompts=(text,)),
        run_settings(tmp_path),
        baseline_cache=cache,
    )
    started: list[str] = []

    def start_and_serve(wave, slots) -> None:  # the baseline, answering without a process
        started.extend(s.topology.name for s in slots)
        for name in sweep.baseline.missing():
            sweep.baseline.outcomes[name] = outcome(name, (4, 5))

    monkeypatch.setattr(sweep, "_start_and_serve", start_and_serve)
    if stored_meanwhile:  # a parallel worker stores the answer while this one waits for the lock
        locked = sweep.baseline.locked

        @contextlib.contextmanager
        def store_then_lock():
            key = sweep.baseline.cache_key(sweep.bodies["text"])
            cache.store(key, outcome("text", (4, 5)), 0.0, "d", batched=True, served=SERVED)
            with locked():
                yield

        monkeypatch.setattr(sweep.baseline, "locked", store_then_lock)
    with cache_lines() as lines:
        assert sweep.serve_baseline()["text"].result.token_ids == (4, 5)
    assert started == ([] if stored_meanwhile else ["baseline"])
    first = f"[baseline] cache {cache.directory}: 0 hit(s), 1 to compute"
    meanwhile = f"[baseline] cache {cache.directory}: 1 hit(s) stored meanwhile by a parallel run"
    assert lines.lines[0] == first, lines.lines
    if stored_meanwhile:
        assert len(lines.lines) == 2 and lines.lines[1].startswith(meanwhile), lines.lines
    else:
        assert len(lines.lines) == 1, lines.lines


def test_the_read_again_under_the_lock_says_nothing_of_what_the_first_read_found(
    tmp_path: Path,
) -> None:
    """The read again (under the lock, before the baseline starts for what missed) looks up
    only what is still missing: had it read every request again, the hit of the first read
    was counted once more and printed as "1 hit(s) stored meanwhile by a parallel run" when
    no parallel run stored anything."""
    cache = BaselineCache(tmp_path / "cache")
    bodies = {"hit": {**RUN_BODY, "seed": 1}, "miss": {**RUN_BODY, "seed": 2}}
    answers = BaselineAnswers(run_settings(tmp_path), cache)
    answers.add(bodies)
    key = answers.cache_key(bodies["hit"])
    cache.store(key, outcome("hit", (4, 5)), 0.0, "d", batched=True, served=SERVED)
    with cache_lines() as lines:
        answers.load_stored()
        answers.load_stored(again=True)
    assert answers.missing() == ["miss"]
    first = f"[baseline] cache {cache.directory}: 1 hit(s) (the oldest computed "
    assert len(lines.lines) == 1 and lines.lines[0].startswith(first), lines.lines


def test_two_dtypes_never_share_a_baseline() -> None:
    """A float16 baseline (a T4's) must not answer for a bfloat16 run, nor the reverse: the
    dtype is in the key through the serving flags and through the baseline's own argv."""
    launched, flagged = set(), set()
    for dtype in DTYPES:
        serving = serving_for(CPU, "/models/tiny", dtype=dtype)
        launch = BaselineLaunch.of(RunSettings(serving=serving, run_dir=Path("/run")), environ={})
        assert launch.argv[launch.argv.index("--dtype") + 1] == dtype
        launched.add(baseline_key(SERVED, serving, "d", BODY, launch=launch))
        # The serving flags alone tell them apart, whatever the launch says.
        flagged.add(baseline_key(SERVED, serving, "d", BODY, launch=LAUNCH))
    assert len(launched) == len(flagged) == len(DTYPES)


def test_a_baseline_served_on_a_ray_clusters_node_is_not_keyed_by_this_hosts_device(
    tmp_path: Path,
) -> None:
    """With --launcher ray --ray-address the baseline runs on a node of the cluster, whose CPU
    (or GPU) this host's /proc/cpuinfo (or nvidia-smi) does not show: keyed by this host's
    device, an entry a local run stored answered the cluster's run (and the other way round),
    one device's answers judged as another's (found in review). The one-host rehearsal's nodes
    are this host: its device is this host's."""
    from harness.spec.settings import RAY_LAUNCHER, LauncherChoice

    local = BaselineLaunch.of(run_settings(tmp_path), environ={})
    cluster = BaselineLaunch.of(
        run_settings(tmp_path, launcher=LauncherChoice(RAY_LAUNCHER, "head:6379")), environ={}
    )
    other = BaselineLaunch.of(
        run_settings(tmp_path, launcher=LauncherChoice(RAY_LAUNCHER, "other:6379")), environ={}
    )
    rehearsal = BaselineLaunch.of(
        run_settings(tmp_path, launcher=LauncherChoice(RAY_LAUNCHER)), environ={}
    )
    key = baseline_key(SERVED, SERVING, "d", BODY, launch=local)
    assert key != baseline_key(SERVED, SERVING, "d", BODY, launch=cluster)
    assert "head:6379" in cluster.device and cluster.device != other.device
    assert rehearsal.device == local.device
    assert golden_key(SERVING, "d", BODY, local) != golden_key(SERVING, "d", BODY, cluster)


class FailsWhenBatched(NoisyWhenBatched):
    """Answers alone, twice alike; no answer in the batched pass (a timeout under the pair)."""

    def send(self, name: str, body: dict[str, Any]) -> Outcome:
        answer = super().send(name, body)
        if self.sent[name.removesuffix("-partner")] >= 3:
            return Outcome(answer.prompt, error="timed out after 120 s")
        return answer


def test_an_answer_whose_batched_pass_got_no_answer_is_not_stored_as_batched(
    tmp_path: Path,
) -> None:
    """The batched pass measured nothing when it got no answer: stored as batched, the entry
    stood in for one that had it, and every later run that batches the prompt took a noise
    floor without the batched pass a fresh baseline measures (found in review)."""
    cache = BaselineCache(tmp_path / "cache")
    bodies = {"sweep": {**RUN_BODY, "seed": 1}}
    first = BaselineAnswers(run_settings(tmp_path), cache)
    first.add(bodies)
    first.answer_on(FailsWhenBatched())  # type: ignore[arg-type]
    assert first.stability["sweep"].stable and "no answer in the batched pass" in (
        first.stability["sweep"].detail
    )
    assert first.sources["sweep"]["batched"] is False

    warm = BaselineAnswers(run_settings(tmp_path), cache)
    warm.add(bodies)
    warm.load_stored()
    assert warm.missing() == ["sweep"], "an entry the batched pass never measured stood in"
    warm.answer_on(NoisyWhenBatched())  # type: ignore[arg-type]
    assert warm.noise_floor == pytest.approx(0.05)


def test_a_file_media_replaced_in_place_changes_the_baseline_and_golden_keys(
    tmp_path: Path,
) -> None:
    """A file:// URL names media, it is not the media: a --media-dir whose file was replaced
    under the same name (another video) must not reuse the old file's baseline or golden."""
    image = tmp_path / "cat.png"
    image.write_bytes(b"first image")
    body = {
        **BODY,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": f"file://{image}"}}],
            }
        ],
    }
    before = baseline_key(SERVED, SERVING, "d", body, launch=LAUNCH)
    golden_before = golden_key(SERVING, "d", body, LAUNCH)
    assert before == baseline_key(SERVED, SERVING, "d", body, launch=LAUNCH)
    image.write_bytes(b"another image")
    assert baseline_key(SERVED, SERVING, "d", body, launch=LAUNCH) != before
    assert golden_key(SERVING, "d", body, LAUNCH) != golden_before


def test_each_file_a_request_reads_is_in_its_key_not_only_the_first(tmp_path: Path) -> None:
    """Two images read from files: replacing the second under its name must change the key
    as replacing the first does."""
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    first.write_bytes(b"first image")
    second.write_bytes(b"second image")
    parts = [{"type": "image_url", "image_url": {"url": f"file://{p}"}} for p in (first, second)]
    body = {**BODY, "messages": [{"role": "user", "content": parts}]}
    before = baseline_key(SERVED, SERVING, "d", body, launch=LAUNCH)
    second.write_bytes(b"another second image")
    assert baseline_key(SERVED, SERVING, "d", body, launch=LAUNCH) != before


class DisagreesWithItself(NoisyWhenBatched):
    """Answers `flaky` with other ids the second time (a nondeterministic baseline), every
    other request alike each time."""

    def send(self, name: str, body: dict[str, Any]) -> Outcome:
        answer = super().send(name, body)
        if name.removesuffix("-partner") == "flaky" and self.sent["flaky"] == 2:
            return Outcome("flaky", chat((5, 9), top=lambda i, t: [(t, -0.5), (t + 1, -3.0)]))
        return answer


def test_a_baseline_that_disagrees_with_itself_is_no_reference_and_is_never_stored(
    tmp_path: Path,
) -> None:
    """The control (each request sent twice, alone) is what makes UNSTABLE_BASELINE: a request
    the baseline answered two ways must judge its cases as unstable, not as MISMATCH against
    whichever answer came first, and its answer must not be cached or kept as a golden, where
    every later run would take it for a reference; the steady one beside it is both."""
    cache, goldens = BaselineCache(tmp_path / "cache"), GoldenStore(tmp_path / "goldens")
    bodies = {"flaky": {**RUN_BODY, "seed": 1}, "steady": {**RUN_BODY, "seed": 2}}
    answers = BaselineAnswers(run_settings(tmp_path), cache, goldens)
    answers.add(bodies)
    answers.answer_on(DisagreesWithItself())  # type: ignore[arg-type]

    assert answers.reference("flaky").stable is False
    assert answers.reference("steady").stable is True
    assert "flaky" not in answers.sources and "steady" in answers.sources
    stored = {path.stem for path in cache.directory.glob("*.json")}
    assert stored == {answers.sources["steady"]["key"]}, "an unstable answer was cached"
    assert not (goldens.directory / answers.golden_key("flaky")).exists()
    assert (goldens.directory / answers.golden_key("steady")).is_dir()

    warm = BaselineAnswers(run_settings(tmp_path), cache)
    warm.add(bodies)
    warm.load_stored()
    assert warm.missing() == ["flaky"], "the unstable answer stood in for a baseline"


class OtherPromptWhenBatched(RecordingBaseline):
    """Answers alike each time, except that in flight with others it answers from other
    prompt ids (a batch that mangled the rendered prompt): the same output ids."""

    def __init__(self) -> None:
        super().__init__()
        self.batched = False

    def send(self, name: str, body: dict[str, Any]) -> Outcome:
        answer = super().send(name, body)
        if self.batched and answer.result is not None:
            return Outcome(answer.prompt, chat((5, 6), prompt_ids=(9, 9, 9)))
        return answer


def test_a_calibration_answer_from_other_prompt_ids_is_changed_by_batching(
    tmp_path: Path,
) -> None:
    """Batching that changed the prompt the engine ran is a change, even where the output
    ids happen to agree: said unchanged, the load's batched answers were judged against a
    calibration that hid it (as the control does: `baseline_stability`)."""
    answers = BaselineAnswers(run_settings(tmp_path), None)
    answers.add({"a": RUN_BODY})
    baseline = OtherPromptWhenBatched()
    answers.answer_on(baseline)  # type: ignore[arg-type]
    baseline.batched = True
    calibration = answers.calibrate_batched(baseline, [("request 1", "a")], 1)  # type: ignore[arg-type]
    assert [a.label for a in calibration.changed] == ["request 1"]


def test_a_build_whose_code_cannot_be_told_apart_gets_no_session_private_cache(
    tmp_path: Path,
) -> None:
    """`--baseline-cache off` with parallel workers sharing GPUs gets the session's private
    cache, whose key names the served code; an editable vLLM whose tree's state could not be
    read names none (`ServedVllm.cache_refusal`), so it gets no cache at all, as with a cache
    asked for. Found in review: the private cache was made anyway and its first lookup raised
    a bare ValueError."""
    from harness.preflight.config import RunRequest, _run_baseline_cache
    from harness.spec.platforms import CUDA

    request = RunRequest(baseline_cache="off", session_dir=str(tmp_path), workers=4)
    plain = ServedVllm("/venv/bin/vllm", "0.33.0.dev1+gabc", "2.13.0")
    private = _run_baseline_cache(None, plain, request, CUDA, None)
    assert private is not None, "parallel GPU workers share one baseline start"
    baseline_key(plain, SERVING, "d", BODY, launch=LAUNCH)  # keyed: no refusal
    unreadable = ServedVllm("/venv/bin/vllm", "0.33.0.dev1+gabc", "2.13.0", source_tree="/src/vllm")
    assert unreadable.cache_refusal is not None
    assert _run_baseline_cache(None, unreadable, request, CUDA, None) is None
    asked = BaselineCache(tmp_path / "cache")
    assert _run_baseline_cache(asked, unreadable, request, CUDA, None) is None
    assert _run_baseline_cache(asked, plain, request, CUDA, None) is asked


def test_a_golden_is_one_request_whatever_its_numerics_neutral_flags() -> None:
    """A golden stands in for a baseline, whose key leaves out the flags that cannot change
    its tokens (the KV connector the monolithic baseline never runs, where media and the model
    live, what usage reports): a release's golden stored by an ExampleConnector run is the one
    a NixlConnector run's `--golden` reads. The dtype still tells goldens apart. Found in
    review: a mutant that kept every flag in the golden's key survived every test."""
    neutral = dataclasses.replace(
        SERVING,
        model="/elsewhere/tiny",
        kv_connector="NixlConnector",
        allowed_local_media_path="/media",
        enable_prompt_tokens_details=not SERVING.enable_prompt_tokens_details,
    )
    assert golden_key(neutral, "d", BODY, LAUNCH) == golden_key(SERVING, "d", BODY, LAUNCH)
    other_dtype = dataclasses.replace(SERVING, dtype="float16")
    assert golden_key(other_dtype, "d", BODY, LAUNCH) != golden_key(SERVING, "d", BODY, LAUNCH)


def test_the_key_of_a_run_that_places_no_device_here_is_the_key_of_one_that_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attached with --golden nothing starts on this host, so the run has no device (5e9e532);
    yet the goldens are looked up by the baseline's launch, which placed the baseline on the
    run's devices: on real vLLM the run then failed, "baseline: no cores to place it on" (exit
    2). The key sees no device index (CPU cores are the affinity, a GPU's index a
    placeholder), so a run of no device keys the goldens as one of any devices does."""
    base = run_settings(tmp_path)
    assert BaselineLaunch.of(dataclasses.replace(base, devices=()), environ={}) == (
        BaselineLaunch.of(base, environ={})
    )
    monkeypatch.setattr(baseline_launch, "device_model", lambda platform: "cuda: test")
    cuda = dataclasses.replace(base, platform=CUDA, devices=(3,))
    assert BaselineLaunch.of(dataclasses.replace(cuda, devices=()), environ={}) == (
        BaselineLaunch.of(cuda, environ={})
    )
