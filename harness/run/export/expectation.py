"""expected.json of a case (`tokens_expectation`): what check.py compares the answer with, and
how."""

from __future__ import annotations

import json
from typing import Any

from harness.devices import describe_devices
from harness.errors import BadInput
from harness.judge.compare import is_measured_floor
from harness.judge.guards import kv_rule_for
from harness.judge.policy import ReferencePolicy, default_reference_policy
from harness.judge.records import Verdict
from harness.judge.verdicts import STREAM_CHECK
from harness.run.export.request import describe_request
from harness.run.fuzz.signature import STREAM_FRAMING, died_instance, ids_kind
from harness.run.repro import Bundle, ReproCase
from harness.spec.connectors import KvRule, expected_kv_tokens
from harness.spec.platforms import get_platform
from harness.spec.topology import BASELINE, get_topology

REQUEST_TIMEOUT_S = 600


def tokens_expectation(
    bundle: Bundle, case: ReproCase, record: dict[str, Any], body: dict[str, Any]
) -> dict[str, Any]:
    """expected.json of a case: its reference's ids and log-probs, how the harness judged it
    (the case's policy, the run's noise floor), and what the harness recorded, where."""
    policy = reference_policy(bundle)
    topology = get_topology(case.topology)
    drift_passes = policy.policy_for(topology, case.reference == BASELINE.name).passes(
        Verdict.DRIFT
    )
    answer = expected_answer(bundle, case)
    guard = kv_guard(bundle, record, len(answer["prompt_token_ids"]))
    return {
        **answer,
        **({"kv_transfer": guard} if guard else {}),
        "check": "tokens",
        "what": f"{case.topology} / {case.prompt}: {describe_request(body)}; expecting "
        f"{reference_words(case.reference)}'s token ids",
        "timeout_s": REQUEST_TIMEOUT_S,
        "policy": policy.name,
        "drift_passes": drift_passes,
        "noise_floor_nats": noise_floor(bundle, record),
        "recorded": {
            "verdict": case.verdict,
            "source": f"the harness (run {bundle.path.name})",
            "where": recording_host(bundle.run),
            "ids_vary_with": ids_vary_with(bundle.run),
            **where_it_failed(case.verdict, record),
            **unjudged_guards(case.verdict, record, guard),
        },
    }


def unjudged_guards(
    verdict: str, record: dict[str, Any], kv_guard: dict[str, Any] | None
) -> dict[str, Any]:
    """A VACUOUS case's failed guards that check.py does not hold (every one but the KV guard
    it carries, `kv_guard`): guards the harness read from the instances (taps, D's /metrics),
    which an export without the harness cannot, so check.py's MATCH there says why it cannot
    reproduce the failure instead of a bare "NOT reproduced"."""
    if verdict != Verdict.VACUOUS.value:
        return {}
    guards = record.get("guards") or {}
    unseen = [
        name
        for name, result in guards.items()
        if isinstance(result, dict)
        and result.get("ok") is False
        and not result.get("not_checkable")
        and not (name == "kv_transfer" and kv_guard)
    ]
    return {"unjudged_guards": unseen} if unseen else {}


def kv_guard(bundle: Bundle, record: dict[str, Any], prompt_tokens: int) -> dict[str, Any] | None:
    """The KV guard check.py judges beside the ids, where the harness judged one and a client
    can see what it reads: D's `cached_tokens` in the answer's usage (vLLM's proxy passes D's
    answer on), held to ExampleConnector's block-aligned prefix rule. Found on real vLLM: a
    fuzz's known VACUOUS case (D loads none of P's KV at k*block+1 prompt tokens) exported,
    and check.py, judging ids alone, said MATCH and "NOT reproduced". None where the run
    judged no KV guard, or could not, and under NIXL's rule, which reads D's /metrics."""
    guard = (record.get("guards") or {}).get("kv_transfer")
    if not isinstance(guard, dict) or "ok" not in guard or guard.get("not_checkable"):
        return None
    serving = bundle.serving()
    rule = kv_rule_for(serving.kv_connector)
    if rule is not KvRule.BLOCK_ALIGNED_PREFIX:
        return None
    return {
        "min_cached_tokens": expected_kv_tokens(rule, prompt_tokens, serving.block_size),
        "rule": rule.value,
        "block_size": serving.block_size,
        "recorded": guard.get("evidence"),
    }


def where_it_failed(verdict: str, record: dict[str, Any]) -> dict[str, Any]:
    """Where the recorded failure showed, for check.py's "reproduced" (its `reproduction`):
    for an ERROR the instance that died (`died`, its name in the export; None: none did), for
    ids that differ which ones (`ids`, the harness's signature kind: "stream framing" for a
    stream whose framing broke, whatever its ids did) and the first `position`. The verdict
    alone made another instance's death, or prompt ids parting where generated ids had,
    "reproduced"; read as generated ids, so did a broken framing where ids had parted, and
    the other way round (both found in review). Nothing when the record has no detail to
    tell by, as `epd-harness repro`'s `another_failure`."""
    if "detail" not in record:
        return {}
    if verdict == Verdict.ERROR.value:
        died = died_instance(str(record.get("error") or record["detail"]))
        return {"died": died.rsplit("/", 1)[-1] if died else None}
    if verdict in (Verdict.MISMATCH.value, Verdict.DRIFT.value):
        divergence = record.get("divergence")
        index = divergence.get("index") if isinstance(divergence, dict) else None
        position = index if isinstance(index, int) and not isinstance(index, bool) else None
        guards = record.get("guards")
        framing = guards.get(STREAM_CHECK) if isinstance(guards, dict) else None
        broke = isinstance(framing, dict) and framing.get("ok") is False
        ids = STREAM_FRAMING if broke else ids_kind(str(record["detail"]))
        return {"ids": ids, "position": position}
    return {}


def reference_policy(bundle: Bundle) -> ReferencePolicy:
    """The run's reference policy (summary.json's `run`; a fuzz run's settings in run.json),
    else its platform's default."""
    name = _summary_run(bundle).get("reference_policy") or (bundle.run.get("fuzz") or {}).get(
        "reference_policy"
    )
    try:
        return ReferencePolicy(str(name))
    except ValueError:
        return default_reference_policy(get_platform(bundle.run.get("platform_profile", "cpu")))


def noise_floor(bundle: Bundle, record: dict[str, Any]) -> float:
    """The tolerance the harness judged the case with (its divergence's), else the run's
    measured noise floor (summary.json, run.json); 0 when none was recorded. A recorded one
    that is no measurement (inf, NaN, negative, not a number) is BadInput naming the file and
    the field: it would be check.py's drift tolerance (an inf one passes every near tie)."""
    sources = (
        ("summary.json", record.get("divergence") or {}),
        ("summary.json", _summary_run(bundle)),
        ("run.json", bundle.run),
    )
    for file, source in sources:
        field = "tolerance" if "tolerance" in source else "noise_floor_nats"
        value = source.get(field)
        if value is None:
            continue
        if not is_measured_floor(value):
            raise BadInput(
                f"{bundle.path / file}: {field} is {value!r}, not a measured noise floor "
                "(a finite number of nats, 0 or more)"
            )
        return float(value)
    return 0.0


def _summary_run(bundle: Bundle) -> dict[str, Any]:
    """summary.json's `run`: where a run writes its reference policy and noise floor
    (`harness.report.text.write_summary_json`), not at the file's top."""
    run = bundle.summary.get("run")
    return run if isinstance(run, dict) else {}


def recording_host(run: dict[str, Any]) -> str:
    """Where the expected ids were computed, as far as run.json knows: its host and the
    devices the run used (`devices_used`: model, count, driver, CUDA or AMX); for a bundle
    written before that was recorded, its devices (GPU platforms) or its CPU."""
    hostname = run.get("hostname")
    host = f"the recording host {hostname}" if hostname else "the recording host"
    used = describe_devices(run.get("devices_used"))
    if used:
        return f"{host} ({used})"
    profile = run.get("platform_profile", "cpu")
    if profile == "cpu":
        cpu = (run.get("cpu") or {}).get("model") or "model not recorded"
        return f"{host} (CPU {cpu})"
    devices = ",".join(str(d) for d in run.get("devices") or []) or "?"
    return f"{host} ({profile} devices {devices}; GPU model not recorded)"


def ids_vary_with(run: dict[str, Any]) -> str:
    """What else, beside a bug, can give other ids than the recording host's, for the platform
    the case was recorded on: a CPU export said "another GPU model, driver or CUDA", which a
    developer on another CPU could not act on (found by a real-vLLM audit on CPU)."""
    platform = run.get("platform_profile", "cpu")
    if platform == "cpu":
        return (
            "another CPU model (its vector instructions, AMX), torch or vLLM build, or thread count"
        )
    if platform == "xpu":
        return "another GPU model, driver or oneAPI version"
    return "another GPU model, driver or CUDA version"


def reference_words(reference: str) -> str:
    """'the monolithic baseline', or the exact reference's name ('1P+1D')."""
    return "the monolithic baseline" if reference == BASELINE.name else reference


def expected_answer(bundle: Bundle, case: ReproCase) -> dict[str, Any]:
    """The answer of the case's own reference (the monolithic baseline, or an exact reference
    such as 1P+1D) to the case's request, as the bundle recorded it: the ids the harness
    compared with, never another reference's."""
    responses_path = bundle.path / "responses.json"
    try:
        responses = json.loads(responses_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(f"{responses_path} cannot be read: {exc}") from None
    reference = case.reference
    result = ((responses.get(reference) or {}).get(case.prompt) or {}).get("result")
    if not result:
        raise BadInput(
            f"{bundle.path}: responses.json has no answer of {reference} to {case.prompt!r}"
        )
    # An entry of another token than the id generated there (log-probs misaligned with the
    # ids) is none: check.py reads these as its ids', as the harness's judge never does.
    logprobs = [
        p if i < len(result["token_ids"]) and p.get("token_id") == result["token_ids"][i] else {}
        for i, p in enumerate(result.get("logprobs") or [])
    ]
    return {
        "reference": reference,
        "prompt_token_ids": result["prompt_token_ids"],
        "token_ids": result["token_ids"],
        "text": result.get("text", ""),
        "top_logprobs": [p.get("top") for p in logprobs],
        "token_logprobs": [p.get("logprob") for p in logprobs],
    }
