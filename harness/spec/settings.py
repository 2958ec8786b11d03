"""What one run is: the served vLLM, the shared serving flags, where artifacts go, which devices.

`harness.preflight.prepare_run` builds these from a user's inputs (CLI flags, pytest options,
the benchmark's arguments) after checking every one of them; everything downstream takes them
as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.redact import redact_env
from harness.spec.attach import AttachSpec
from harness.spec.generations import NEWEST, ProtocolGeneration
from harness.spec.platforms import CPU, DEFAULT_CPU_CORES, PlatformProfile
from harness.spec.topology import ServingConfig

STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServedVllm:
    """The vLLM that serves, as read from its own interpreter (not from the harness's: they are
    different installations whenever `--vllm` points elsewhere). Baseline cache keys and every
    report use these versions."""

    executable: str
    version: str  # e.g. "0.32.0+cpu"; "unknown" when it could not be read
    torch_version: str = "unknown"
    # What the served interpreter's AMX start-up hook did (`harness.amx` STATUS line), read
    # from a fresh interpreter: on an AMX CPU anything but "granted" leaves NIXL's D to SIGILL.
    amx_permission: str = "unknown"
    # The served interpreter's libraries that shape what vLLM computes besides torch: the HF
    # processors and tokenizers that turn media and text into the prompt (transformers,
    # tokenizers, Pillow, OpenCV, PyAV, decord, torchvision), and GPU kernel libraries (triton,
    # flashinfer): (label, version) of those installed (`harness.preflight.vllm.LIBRARIES`).
    libraries: tuple[tuple[str, str], ...] = ()
    # The libraries that move embeddings and KV between instances (NIXL and its CUDA builds):
    # recorded, never in a baseline key (one monolithic instance moves nothing through them).
    transfer_libraries: tuple[tuple[str, str], ...] = ()
    # An editable (development) install, `pip install -e`: the source tree it runs from, whose
    # code changes while the version stays what it was at install time; and that code's state
    # ("git <HEAD> + diff <sha256>"), "" when it could not be read (`source_problem` says why).
    source_tree: str = ""
    source_state: str = ""
    source_problem: str = ""

    @property
    def known(self) -> bool:
        return self.version != "unknown"

    @property
    def cache_refusal(self) -> str | None:
        """Why a baseline of this build must not be cached, or None: its version names no
        code when it is an editable install whose tree's state could not be read."""
        if self.source_tree and not self.source_state:
            return (
                f"vLLM {self.version} is an editable install of {self.source_tree} whose code "
                f"cannot be identified ({self.source_problem or 'unknown state'}): its "
                "baseline is computed, not cached"
            )
        return None


HARNESS_PROXY = "harness"
VLLM_PROXY = "vllm"
# How vLLM's EPD proxy learns the instances: URLs on its command line, or started empty with
# `--dynamic-registration` and each instance registered through its admin API.
STATIC_REGISTRATION = "static"
DYNAMIC_REGISTRATION = "dynamic"
REGISTRATION_MODES = (STATIC_REGISTRATION, DYNAMIC_REGISTRATION)
ATTACH_PROXY = "attach"  # a deployment the harness did not start (harness.spec.attach)
PROXY_KINDS = (HARNESS_PROXY, VLLM_PROXY, ATTACH_PROXY)


@dataclass(frozen=True)
class ProxyChoice:
    """The EPD proxy under test: the harness's own (`harness.serve.proxy`), or the one the
    served vLLM release ships (`disagg_epd_proxy.py`, and for 1P+1D the toy proxy of its NIXL
    tests), taken from that release's sdist or a checkout, never from this repository; or,
    with `attach`, the proxy of a deployment somebody else started (nothing is launched)."""

    kind: str = HARNESS_PROXY
    files_dir: Path | None = None  # holds the vLLM release's proxy files (kind "vllm")
    origin: str = ""  # where they came from: the sdist's URL and sha256, or the checkout
    interpreter: tuple[str, ...] = ()  # the served vLLM's Python, which runs them
    registration: str = STATIC_REGISTRATION  # kind "vllm" only
    attach: AttachSpec | None = None  # kind "attach": the deployment under test
    # From a vLLM source tree (--vllm-source): its git commit, and whether that matches the
    # served build's own commit (`harness.preflight.upstream_proxy.from_checkout`).
    source_commit: str | None = None
    commit_check: str = ""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind,
            "files_dir": str(self.files_dir) if self.files_dir else None,
            "origin": self.origin,
            "registration": self.registration,
            "source_commit": self.source_commit,
            "commit_check": self.commit_check,
        }
        if self.attach is not None:
            data["attach"] = self.attach.to_json()
        return data


LOCAL_LAUNCHER = "local"
RAY_LAUNCHER = "ray"
LAUNCHER_KINDS = (LOCAL_LAUNCHER, RAY_LAUNCHER)
# Where a Ray launcher puts a topology's instances: each on a node of its own (Ray's
# STRICT_SPREAD), or wherever they fit (PACK: colocation, on request).
SPREAD_PLACEMENT = "spread"
PACK_PLACEMENT = "pack"
PLACEMENTS = (SPREAD_PLACEMENT, PACK_PLACEMENT)
# The one-host rehearsal cluster's nodes, at the least: the largest topology's instances, each
# on a node of its own (a run keeping more up at once asks for more: `rehearsal_nodes`).
REHEARSAL_NODES = 3


@dataclass(frozen=True)
class LauncherChoice:
    """What turns an instance spec into a running server: `local` (a subprocess of the harness
    on this host, `harness.serve.launch`) or `ray` (a Ray actor on a node of a cluster runs
    that same launcher there, `harness.serve.ray_launcher`). Nothing downstream of the session
    knows which one ran: the plan, the verdicts, the guards, the taps and the bundle are the
    same."""

    kind: str = LOCAL_LAUNCHER
    # The cluster (GCS "host:port"); None with `ray`: a one-host rehearsal cluster of
    # `rehearsal_nodes` nodes on 127.0.0.2 and up is started for the run and stopped after it.
    ray_address: str | None = None
    placement: str = SPREAD_PLACEMENT
    # A directory every node (and the harness) sees, for connectors that move data through
    # files (ExampleConnector); None: the run directory, which must then be shared.
    shared_dir: Path | None = None
    # Environment given to every instance besides what the spec renders (a cluster's UCX or
    # network settings); the network invariants (harness.spec.network) still apply to it.
    instance_env: tuple[tuple[str, str], ...] = ()
    # The rehearsal cluster's nodes: as many as the run keeps instances up at once (a fuzz
    # keeps the baseline up beside its topology), at least REHEARSAL_NODES.
    rehearsal_nodes: int = REHEARSAL_NODES

    @property
    def is_local(self) -> bool:
        return self.kind == LOCAL_LAUNCHER

    @property
    def rehearses_on_this_host(self) -> bool:
        """`ray` without an address: the run starts its own cluster of nodes here."""
        return self.kind == RAY_LAUNCHER and self.ray_address is None

    def refusal_on(self, platform: PlatformProfile) -> str | None:
        """Why this launcher cannot run instances of `platform`, or None.

        The one-host rehearsal starts its Ray nodes without dividing the host's devices among
        them, so on a platform whose instances own their devices each node would report all of
        them, and Ray, which hands out device ids per node, could give two instances the same
        device. It rehearses the network and the storage of a cluster, which the CPU profile
        shows; on GPUs the cluster must be a real one."""
        if not (self.rehearses_on_this_host and platform.exclusive_devices):
            return None
        return (
            f"--launcher ray without --ray-address starts a one-host rehearsal cluster, which "
            f"runs on the cpu platform only (its nodes would share this host's {platform.name} "
            f"devices, each seeing all of them); give --ray-address HOST:PORT of a cluster "
            f"whose nodes have devices of their own"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ray_address": self.ray_address,
            "placement": self.placement if self.kind == RAY_LAUNCHER else None,
            "shared_dir": str(self.shared_dir) if self.shared_dir else None,
            # A credential handed to the nodes stays out of the artifacts (found in review).
            "instance_env": redact_env(dict(self.instance_env)),
        }


@dataclass(frozen=True)
class RunSettings:
    """What every topology of one run shares."""

    serving: ServingConfig
    run_dir: Path  # artifacts: one subdirectory per topology (logs, storage)
    vllm: ServedVllm = ServedVllm("vllm", "unknown")
    platform: PlatformProfile = CPU
    # The devices this run may use: CPU cores on CPU, GPU / XPU ids otherwise (one per instance
    # unless `colocate`).
    devices: tuple[int, ...] = DEFAULT_CPU_CORES
    colocate: bool = False
    # Parallel xdist workers sharing these devices (CPU waves shrink accordingly).
    workers: int = 1
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    request_timeout_s: float = REQUEST_TIMEOUT_S
    proxy: ProxyChoice = ProxyChoice()
    # The EPD protocol the served vLLM speaks (harness.spec.generations): which flags are
    # rendered, how the proxy reads encoders, which cases apply.
    protocol: ProtocolGeneration = NEWEST
    # How each (topology, reference) pair is judged (harness.judge.policy.REFERENCE_POLICIES);
    # empty: the platform's default (exact on CPU, P->D drift allowed on GPUs).
    reference_policy: str = ""
    # EPD topologies are sent `stream: true` (with usage) and their answers read from the
    # stream's events, framing checked (`--stream`); the baseline answers without streaming.
    stream: bool = False
    # How the served vLLM's own parser judged every command line before the run
    # (harness.preflight.vllm_args.ArgvCheck.to_json), for run.json; None: not checked.
    argv_check: dict[str, Any] | None = None
    # Where the instances run (harness.serve.launcher): this host, or the nodes of a Ray cluster.
    launcher: LauncherChoice = LauncherChoice()

    @property
    def vllm_executable(self) -> str:
        return self.vllm.executable

    @property
    def workers_share_devices(self) -> bool:
        """Instances own their devices and parallel workers lease them from one another: an
        instance kept up in one worker keeps the others off its devices."""
        return self.platform.exclusive_devices and self.workers > 1
