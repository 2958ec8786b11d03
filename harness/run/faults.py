"""Planted faults for the harness's self-test: each one must turn a run red with a known verdict.

A harness that cannot fail proves nothing (upstream's bash harness stayed green while every
comparison failed, vLLM failure mode 13). Each fault here breaks one link of the EPD chain on
purpose, and the self-test checks that the judge names the right verdict:

- `corrupt_ec_files`: the consumer loads wrong embeddings            -> MISMATCH
- `zero_kv_files`: D decodes from zeroed KV                          -> MISMATCH
- `drop_encoder_metadata`: raw media reach the consumer, which encodes them itself; the tokens
  still equal the baseline's, so only the transfer guards can tell   -> VACUOUS
- `drop_kv`: none of P's KV reaches D, which computes the prompt itself; the tokens still
  equal the baseline's, so only the `kv_transfer` guard can tell      -> VACUOUS
- `kill_instance`: an instance dies mid-run                          -> ERROR, at once
- `duplicate_stream_chunk`: the proxy relays the first chunk of D's stream with tokens twice:
  the client's ids differ and the stream's usage no longer counts them -> MISMATCH
- `misroute_nixl_blocks`: under NixlConnector there are no files: P's KV stays in P's memory
  and D reads it over UCX. The proxy carries P's `kv_transfer_params` to D, so the fault
  points every `remote_block_ids` entry at P's first block: D's NIXL reads P's real buffers,
  but the first block's KV into every position                       -> MISMATCH

Graded faults (issue 10) find how small a break the harness still catches, so a loss of
sensitivity shows up as a number (docs/self-test.md; the search is in `harness.run.graded`):

- `ec_noise`: seeded Gaussian noise, a given fraction of each EC tensor's std, added to the
  encoder outputs between encoder and consumer
- `kv_noise`: the same on the KV ExampleConnector files between P and D
- `nixl_kv_noise`: the same under NixlConnector, on the blocks D read from P, planted inside D by
  a vLLM plugin the harness puts on D's PYTHONPATH (`harness.run.nixl_kv_noise_plugin`)
- `ec_swap_items`: the EC files of a request's media items swap places (two images: each image
  gets the other's embedding)
- `ec_zero_frame`: the rows of one temporal frame (pair) of a video's EC embedding are zeroed
- `ec_video_grid`: the consumer is told a video grid of the same size but another shape, so
  its M-RoPE positions are wrong while embeddings and prompt ids stay right (the
  `second_per_grid_ts` error itself cannot be planted from outside vLLM: see `ec_video_grid`)

Faults act only through the proxy's `ProxyFaults` hooks and on the files in the run's own
storage directories (and, for `nixl_kv_noise`, through a plugin in a directory of the run that
only a self-test's D is started with); vLLM's installed files are never touched. Only the self-tests and an
explicit `--plant-fault` use them; a normal run never does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.errors import BadInput
from harness.judge.guards import EC_CACHE_FILE
from harness.run import nixl_kv_noise_plugin as plugin
from harness.serve.launch import ManagedServer
from harness.serve.proxy import ProxyFaults
from harness.spec.topology import Topology

if TYPE_CHECKING:
    import torch

KV_FILE_SUFFIX = ".safetensors"  # ExampleConnector: <kv_storage>/<prompt hash>/<layer>.safetensors
# Why a planted fault did not act on a request, as the fuzzer's shrink must tell: the request's
# SHAPE (nothing in it for the fault: one media item for ec-swap-items, no video for
# ec-zero-frame), which fresh servers share, so a failure there is not the fault's; or LEFTOVER
# state, what earlier requests left in a storage or cache (kv-noise: P found this prompt's KV
# files stored and wrote none), which fresh servers would not have. A fault records a leftover
# miss only where its earlier action on that state stands: what the request read is what the
# fault would have made for it on fresh servers (`PlantedFault.leftover`); any other miss counts
# as the request's shape. Making the fault act again instead would take a fresh
# ExampleConnector key, which hashes the prompt's tokens and media only (no cache_salt): the
# request itself would have to change.


@dataclass
class PlantedFault(ProxyFaults):
    """ProxyFaults that also record what they did.

    A fault that silently touched nothing would make the self-test vacuous in turn (the run
    would be "red" for some other reason, or green by luck), so the tests assert on `touched`
    and `problems` as well as on the verdict. Hooks run on the proxy's thread, where an
    exception would only surface as an opaque HTTP 500: they record their problems instead.
    """

    touched: list[Path] = field(default_factory=list)  # files rewritten, in order
    problems: list[str] = field(default_factory=list)  # what the fault could not do, and why
    # What the fault measurably did, one line per file or item (e.g. the relative std of the
    # noise really added, after rounding to the file's dtype): evidence for the report.
    effects: list[str] = field(default_factory=list)
    # The problems that are no miss of the request's shape but of what earlier requests left,
    # on which the fault already acted as it would on this request on fresh servers (each is in
    # `problems` too). Every other problem counts as the request's shape (e.g. ec-swap-items on
    # one item): fresh servers would not see the fault act either. See above, at KV_FILE_SUFFIX.
    leftover: list[str] = field(default_factory=list)

    def rewrite(
        self, request_id: str, path: Path, transform: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Rewrite one file, recording it as touched or recording why it could not be."""
        if not path.is_file():
            self.problems.append(f"{request_id}: {path} does not exist")
            return
        try:
            rewrite_tensors(path, transform)
        except Exception as exc:  # noqa: BLE001 - reported through `problems`, see above
            self.problems.append(f"{request_id}: rewriting {path}: {type(exc).__name__}: {exc}")
            return
        self.touched.append(path)


def plant(live: ProxyFaults, fault: ProxyFaults | None = None) -> None:
    """Make a running proxy behave as `fault` prescribes (None: no fault) from its next request.

    A TopologySession hands its ProxyFaults object to the proxy once, at start, and the proxy
    reads the hooks on every request. Swapping the hooks on that same object lets one started
    topology serve a clean request and several planted faults in turn, instead of one start
    (~40 s on CPU) per fault.
    """
    source = fault if fault is not None else ProxyFaults()
    for hook in dataclasses.fields(ProxyFaults):
        setattr(live, hook.name, getattr(source, hook.name))


def first_request_only(fault: PlantedFault, id_contains: str = "") -> PlantedFault:
    """`fault`, acting on the first request whose hook runs (of those whose id holds
    `id_contains`; the harness's sessions put the prompt's name in it) and on no other: one
    broken request among many in flight (a load), the rest left as they were."""
    chosen: list[str] = []

    def once(hook: Callable[[str, dict[str, Any]], None] | None):
        if hook is None:
            return None

        def run(request_id: str, params: dict[str, Any]) -> None:
            if not chosen and id_contains in request_id:
                chosen.append(request_id)
            if chosen and request_id == chosen[0]:
                hook(request_id, params)

        return run

    fault.after_encode = once(fault.after_encode)
    fault.after_prefill = once(fault.after_prefill)
    return fault


def corrupt_ec_files(ec_storage: Path) -> PlantedFault:
    """After the encoders answered, corrupt the EC file of every mm_hash they reported.

    The file keeps its keys, shapes and dtypes, so the consumer loads it without complaint;
    only the values are wrong, as a broken transfer or a stale cache would make them.
    """
    fault = PlantedFault()

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        if not ec_transfer_params:
            fault.problems.append(f"{request_id}: the encoders reported no mm_hash")
        for mm_hash in ec_transfer_params:
            fault.rewrite(request_id, ec_storage / mm_hash / EC_CACHE_FILE, flip_away_from_zero)

    fault.after_encode = after_encode
    return fault


def zero_kv_files(kv_storage: Path) -> PlantedFault:
    """After P answered, zero every KV file under `kv_storage` (shapes and dtypes kept).

    ExampleConnector writes one `<layer>.safetensors` per layer into a directory named after a
    hash of the prompt, so "every file" includes those of earlier requests: send a faulted
    request with a prompt of its own, and do not expect earlier prompts to survive it.
    """
    fault = PlantedFault()

    def after_prefill(request_id: str, prefill_response: dict[str, Any]) -> None:
        paths = sorted(kv_storage.rglob(f"*{KV_FILE_SUFFIX}"))
        if not paths:
            fault.problems.append(f"{request_id}: no *{KV_FILE_SUFFIX} under {kv_storage}")
        for path in paths:
            fault.rewrite(request_id, path, zeros)

    fault.after_prefill = after_prefill
    return fault


def misroute_nixl_blocks() -> PlantedFault:
    """After P answered, point every block id P handed out for D's NIXL read at P's first block.

    What `zero_kv_files` does to ExampleConnector's files cannot be done to NIXL's buffers from
    outside vLLM: they are P's registered KV cache in P's own address space, read by D through
    UCX. (Zeroing them would take a NIXL peer that asks P's side channel for its region
    addresses and writes into P's memory as root: a debugger, not a harness.) What the harness
    does own is the hand-over: the proxy carries `remote_block_ids` from P to D. With every id
    set to the first block's, D really reads P's buffers over NIXL, but gets the prompt's first
    block n times and none of the rest (the media's KV among it). A permutation would not do:
    keys carry their positions (RoPE is applied before caching) and attention over a set of
    keys ignores their order, so reversed blocks changed answers only through the partial last
    block, and left one prompt in four (two_images) matching the baseline (measured). A prompt of one block has nothing to misroute: recorded as a
    problem rather than passed off as planted.
    """
    fault = PlantedFault()

    def after_prefill(request_id: str, prefill_response: dict[str, Any]) -> None:
        params = prefill_response.get("kv_transfer_params") or {}
        blocks = params.get("remote_block_ids")
        if not blocks:
            fault.problems.append(f"{request_id}: P returned no remote_block_ids: {params}")
            return
        # One list per KV cache group (vLLM's BlockIds), or a flat list in older releases.
        grouped = isinstance(blocks[0], list)
        groups = blocks if grouped else [blocks]
        misrouted = [[group[0]] * len(group) if group else group for group in groups]
        if misrouted == groups:
            fault.problems.append(f"{request_id}: one block {blocks}: nothing to misroute")
            return
        params["remote_block_ids"] = misrouted if grouped else misrouted[0]
        fault.effects.append(
            f"{request_id}: remote_block_ids {blocks} -> {params['remote_block_ids']}"
        )

    fault.after_prefill = after_prefill
    return fault


def drop_kv(kv_storage: Path, kv_connector: str = "ExampleConnector") -> PlantedFault:
    """After P answered, make sure none of its KV reaches D: D computes the whole prompt itself.

    This is the KV side of the silent fallback `drop_encoder_metadata` plants: D answers right
    from its own prefill, so the tokens still equal the baseline's and only the `kv_transfer`
    guard can turn the case red (VACUOUS). Under NixlConnector the proxy hands D no
    `kv_transfer_params` (D then treats the request as its own; P keeps the blocks until
    vLLM's abort timeout frees them). Under ExampleConnector D finds its KV by the prompt's
    directory in the shared storage, whatever the proxy says, so the directories P wrote since
    the fault was made (or since its previous request) are removed: one request at a time, or
    a concurrent request's directory goes too. A request after which nothing was dropped is
    recorded as a problem, not passed off as planted.
    """
    fault = PlantedFault()
    if kv_connector == "NixlConnector":

        def drop_params(request_id: str, prefill_response: dict[str, Any]) -> None:
            params = prefill_response.pop("kv_transfer_params", None)
            if not params:
                fault.problems.append(f"{request_id}: P returned no kv_transfer_params to drop")
                return
            fault.effects.append(f"{request_id}: kv_transfer_params withheld from D: {params}")

        fault.after_prefill = drop_params
        return fault
    written = KvFilesSince(kv_storage)

    def remove_directories(request_id: str, prefill_response: dict[str, Any]) -> None:
        fresh = sorted({path.parent for path in written.fresh()})
        if not fresh:
            fault.problems.append(
                f"{request_id}: P wrote no new *{KV_FILE_SUFFIX} under {kv_storage}: "
                "nothing to withhold from D"
            )
        for directory in fresh:
            files = sorted(directory.glob(f"*{KV_FILE_SUFFIX}"))
            shutil.rmtree(directory, ignore_errors=True)
            if directory.exists():
                fault.problems.append(f"{request_id}: {directory} could not be removed")
                continue
            fault.touched += files
            fault.effects.append(f"{request_id}: removed {directory.name}/ ({len(files)} files)")
        written.settle()

    fault.after_prefill = remove_directories
    return fault


def drop_encoder_metadata() -> PlantedFault:
    """The proxy ignores what the encoders returned, so the consumer gets raw media.

    This is the silent raw-media fallback (failure mode 8): the consumer encodes locally and
    the tokens still match; only the transfer guards can turn it red.
    """
    return PlantedFault(drop_encoder_metadata=True)


def duplicate_stream_chunk() -> PlantedFault:
    """The proxy relays the first chunk of D's stream that carries generated tokens twice, as a
    proxy that relays P's first token and then D's whole stream does: the client reads one
    token twice, and the final usage counts one fewer than the stream carried."""
    return PlantedFault(duplicate_first_token_chunk=True)


# -- graded faults -------------------------------------------------------------------------------


def ec_noise(ec_storage: Path, fraction: float, seed: int = 0) -> PlantedFault:
    """After the encoders answered, add Gaussian noise of `fraction` x each EC tensor's std.

    Seeded per tensor (`seed` and the embeddings' own bytes), so a rerun plants the very same
    noise, and the same image gets the same noise whatever key the EPD protocol gives its file:
    seeded by the mm_hash, the proxy's upstream cache key (the URL, not the URL and kwargs)
    re-rolled every rung, and 1E+1PD's 5% rung then first differed at token 3. Noise much
    below the dtype's resolution (bf16: ~0.4% of a value) is partly rounded away: `effects`
    records the relative std really added, file by file.
    """
    fault = PlantedFault()

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        if not ec_transfer_params:
            fault.problems.append(f"{request_id}: the encoders reported no mm_hash")
        for mm_hash in ec_transfer_params:
            path = ec_storage / mm_hash / EC_CACHE_FILE
            fault.rewrite(request_id, path, content_seeded_noise(fraction, seed, fault))

    fault.after_encode = after_encode
    return fault


def kv_noise(kv_storage: Path, fraction: float, seed: int = 0) -> PlantedFault:
    """After P answered, add Gaussian noise of `fraction` x each tensor's std to the KV files
    P wrote for this request.

    Unlike `zero_kv_files`, only files new or rewritten since the fault was made (or since its
    previous request) are touched: noise must not pile up on earlier prompts' files, and a
    request whose KV files already existed (nothing new written) is reported as a problem, not
    silently passed. It is marked as a leftover miss (`PlantedFault.leftover`) while every KV
    file in the storage is one P wrote after the fault was made, so one it noised (as it would
    noise it for this request): with files from before (a storage the fault found filled) it
    cannot tell which file D read, and the miss stays one of shape.
    """
    fault = PlantedFault()
    written = KvFilesSince(kv_storage)
    older = set(kv_file_stamps(kv_storage))  # files the fault found, and never noised

    def after_prefill(request_id: str, prefill_response: dict[str, Any]) -> None:
        fresh = written.fresh()
        if not fresh:
            # LEFTOVER, not the request's shape: P writes nothing only when it finds the
            # folder its prompt's block-aligned prefix (and media hashes) key already stored,
            # i.e. an earlier request with that prefix wrote it, and this fault noised it then
            # (it noises every file P writes). Causal attention makes that KV a function of
            # the prefix alone, and the noise is seeded by the file's key, so D reads the very
            # file fresh servers would write and noise for this request.
            problem = (
                f"{request_id}: P wrote no new *{KV_FILE_SUFFIX} under {kv_storage} "
                f"({len(kv_file_stamps(kv_storage))} older file(s) left alone)"
            )
            fault.problems.append(problem)
            if not older & set(kv_file_stamps(kv_storage)):
                fault.leftover.append(problem)
        for path in fresh:
            key = str(path.relative_to(kv_storage))
            fault.rewrite(request_id, path, noise_transform(fraction, file_seed(seed, key), fault))
        written.settle()

    fault.after_prefill = after_prefill
    return fault


@dataclass(frozen=True)
class NixlKvNoiseSite:
    """The plugin directory on D's PYTHONPATH and the control directory it talks through."""

    plugin_path: Path  # holds the plugin package and its *.dist-info/entry_points.txt
    control: Path  # fault.json in; effects.jsonl and loaded.jsonl out

    def env(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """D's environment additions: the plugin directory first on PYTHONPATH (the rest of
        the harness's PYTHONPATH kept), and the control directory."""
        inherited = (os.environ if environ is None else environ).get("PYTHONPATH", "")
        path = os.pathsep.join(p for p in (str(self.plugin_path), inherited) if p)
        return {"PYTHONPATH": path, plugin.CONTROL_ENV: str(self.control)}

    def loaded(self) -> list[dict[str, Any]]:
        """One record per D process that ran the plugin's entry point."""
        return read_json_lines(self.control / plugin.LOADED_FILE)


def install_nixl_kv_noise_plugin(directory: Path) -> NixlKvNoiseSite:
    """Write the plugin as an importable package with entry-point metadata under `directory`.

    Nothing goes into a virtualenv: only a process with `directory/plugin` on its PYTHONPATH
    finds the entry point (importlib.metadata reads `*.dist-info` from every sys.path entry),
    and only one with the control variable set acts on it.
    """
    plugin_path = directory / "plugin"
    control = directory / "control"
    package = plugin_path / plugin.PACKAGE
    dist_info = plugin_path / f"{plugin.PACKAGE}-1.0.dist-info"
    for folder in (package, dist_info, control):
        folder.mkdir(parents=True, exist_ok=True)
    source = Path(plugin.__file__).read_text(encoding="utf-8")
    (package / "__init__.py").write_text(source, encoding="utf-8")
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {plugin.PACKAGE.replace('_', '-')}\nVersion: 1.0\n"
        "Summary: epd-harness self-test fault: noise on the KV blocks D read over NIXL\n",
        encoding="utf-8",
    )
    (dist_info / "entry_points.txt").write_text(
        f"[{plugin.ENTRY_POINT_GROUP}]\n{plugin.PACKAGE} = {plugin.PACKAGE}:register\n",
        encoding="utf-8",
    )
    return NixlKvNoiseSite(plugin_path, control)


@dataclass
class NixlKvNoise(PlantedFault):
    """`kv_noise` under NixlConnector: after P answered, D's plugin is told to add noise to the
    blocks of this request once D's NIXL read of them completes.

    The order names P's request id, which D's receive metadata carries, so exactly the faulted
    request is perturbed. What D did arrives after D answered: `collect()` reads it back into
    `touched` / `effects` / `problems`, and must be called before they mean anything.
    """

    site: NixlKvNoiseSite | None = None
    fraction: float = 0.0
    seed: int = 0
    # What the noise is seeded with beside `seed` (e.g. the prompt's name): request ids carry a
    # random part, and a rerun must plant the very same noise. None: the request id.
    key: str | None = None
    ordered: list[str] = field(default_factory=list)  # labels (harness request ids) ordered

    def order(self, request_id: str, prefill_response: dict[str, Any]) -> None:
        assert self.site is not None
        params = prefill_response.get("kv_transfer_params") or {}
        remote = params.get("remote_request_id")
        if not remote:
            self.problems.append(f"{request_id}: P returned no remote_request_id: {params}")
            return
        order = {
            "fraction": self.fraction,
            "seed": self.seed,
            "key": self.key or request_id,
            "label": request_id,
            "remote_request_id": remote,
        }
        temporary = self.site.control / f".{plugin.FAULT_FILE}.new"
        temporary.write_text(json.dumps(order), encoding="utf-8")
        os.replace(temporary, self.site.control / plugin.FAULT_FILE)
        self.ordered.append(request_id)

    def collect(self) -> None:
        """Read what D's plugin did for the requests ordered; an order D never carried out, or
        one it could not, becomes a problem. Clears the order, so no later request is hit."""
        assert self.site is not None
        (self.site.control / plugin.FAULT_FILE).unlink(missing_ok=True)
        done = {}
        for record in read_json_lines(self.site.control / plugin.EFFECTS_FILE):
            done.setdefault(record.get("label"), []).append(record)
        for label in self.ordered:
            records = done.get(label, [])
            if not records:
                loaded = self.site.loaded()
                self.problems.append(
                    f"{label}: D's plugin reported nothing for this request "
                    f"(plugin loaded in {len(loaded)} process(es): {loaded[-3:]})"
                )
            for record in records:
                if "problem" in record:
                    self.problems.append(f"{label}: D's plugin: {record['problem']}")
                    continue
                self.touched.append(Path(f"D:{record['req_id']}"))
                self.effects.append(
                    f"noise {self.fraction:g} of std asked, {record['planted']:.3g} planted on "
                    f"{record['blocks']} blocks x {record['layers']} layers "
                    f"(cache {record['cache_shape']})"
                )
        self.ordered.clear()


def nixl_kv_noise(
    site: NixlKvNoiseSite, fraction: float, seed: int = 0, key: str | None = None
) -> NixlKvNoise:
    """Noise of `fraction` x each layer's std on the KV blocks D reads over NIXL for the next
    request (D must have been started with `site.env()`), seeded by (`seed`, `key`, layer);
    `collect()` after the request."""
    fault = NixlKvNoise(site=site, fraction=fraction, seed=seed, key=key)
    fault.after_prefill = fault.order
    return fault


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def ec_swap_items(ec_storage: Path) -> PlantedFault:
    """After the encoders answered, the EC files of the request's items swap places.

    With two images each gets the other's embedding (with more, every item gets the next one's).
    The items must have equal shapes (same image size): otherwise the consumer would reject the
    file (an ERROR, not the MISMATCH this fault is for), so a mismatch is reported as a problem.

    The fault belongs to the request: a swapped file stays in the storage, and a later request
    with one of those items (which the encoder need not write again) would read the other's
    embedding. So each item's original file is kept, and put back when a later request reports
    that item, before anything else. What this cannot undo: the consumer's own encoder cache
    (vLLM keeps a finished request's embeddings and reuses them by mm_hash), so a later request
    with one of the images may still get the swapped embedding from memory.
    """
    fault = PlantedFault()
    originals: dict[Path, bytes] = {}  # a swapped file's content before its first swap

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        hashes = list(ec_transfer_params)
        for path in [ec_storage / h / EC_CACHE_FILE for h in hashes]:
            if path in originals:
                write_bytes_atomic(path, originals.pop(path))
        if len(hashes) < 2:
            fault.problems.append(
                f"{request_id}: {len(hashes)} distinct media item(s); swapping needs two or more"
            )
            return
        paths = [ec_storage / h / EC_CACHE_FILE for h in hashes]
        try:
            before = {path: path.read_bytes() for path in paths}
            swap_tensor_files(paths)
        except Exception as exc:  # noqa: BLE001 - reported through `problems`
            fault.problems.append(
                f"{request_id}: swapping {len(paths)} EC files: {type(exc).__name__}: {exc}"
            )
            return
        originals.update(before)
        fault.touched += paths
        fault.effects.append(f"rotated the EC files of {', '.join(hashes)} by one")

    fault.after_encode = after_encode
    return fault


def ec_zero_frame(ec_storage: Path, frame: int = 0) -> PlantedFault:
    """After the encoders answered, zero one temporal frame of every video's EC embedding.

    How rows map to frames (Qwen2.5-VL, checked against the published grid): the encoder output
    of a video is `[grid_t * (grid_h / m) * (grid_w / m), hidden]` with m the spatial merge size
    (2), rows ordered frame-major: `grid_t` blocks of `(grid_h / m) * (grid_w / m)` rows each.
    One grid_t step is one temporal patch, i.e. a pair of input frames (temporal_patch_size 2):
    an 8-frame 224x224 video has grid [4, 16, 16], 256 rows, 64 per frame pair. The encoder
    publishes the grid as `video_grid_thw` in its metadata, which is where it is read from; a
    row count that does not divide by grid_t is reported as a problem.
    """
    fault = PlantedFault()

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        videos = {h: video_grid(e) for h, e in ec_transfer_params.items() if video_grid(e)}
        if not videos:
            fault.problems.append(
                f"{request_id}: no video among the encoded items "
                f"({len(ec_transfer_params)} item(s))"
            )
        for mm_hash, grid in videos.items():
            path = ec_storage / mm_hash / EC_CACHE_FILE
            fault.rewrite(request_id, path, zero_frame_transform(grid[0], frame, fault))

    fault.after_encode = after_encode
    return fault


def ec_video_grid(ec_storage: Path | None = None) -> PlantedFault:
    """A position error: the consumer is told video grid [2t, h/2, w] instead of [t, h, w].

    The size (t*h*w, hence the placeholder count, the prompt ids and the EC rows) is unchanged,
    so the consumer loads the right embeddings into the right number of placeholders, but its
    M-RoPE positions (temporal index, row, column of every video token) are computed for the
    wrong shape.

    Why not `second_per_grid_ts` itself: vLLM 0.32's consumer cannot be told it. The encoder
    publishes only `video_grid_thw` (`Qwen2VLMultiModalDataParser.embedding_fields`), and the
    field config a `video_embeds` part is parsed with (`_create_qwen2vl_field_factory`) has no
    `second_per_grid_ts`, so `MultiModalKwargsItems.from_hf_inputs` drops such a key silently
    and `Qwen2_5_VLForConditionalGeneration.iter_mm_grid_thw` falls back to 1.0. Changing
    fps / mm_processor_kwargs in the consumer's request instead changes the item's mm_hash
    (vLLM hashes the uuid with the kwargs): the consumer misses the EC file (an ERROR).

    The metadata is rewritten in place in the encoders' answer, which the proxy then copies into
    the consumer's `video_embeds` parts (and its request trace).
    """
    del ec_storage  # the files stay as they are; only what the consumer is told changes
    fault = PlantedFault()

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        videos = {h: e for h, e in ec_transfer_params.items() if video_grid(e)}
        if not videos:
            fault.problems.append(
                f"{request_id}: no video among the encoded items "
                f"({len(ec_transfer_params)} item(s))"
            )
        for mm_hash, entry in videos.items():
            t, h, w = video_grid(entry) or (0, 0, 0)
            if h % 4:
                fault.problems.append(
                    f"{request_id}: {mm_hash}: grid height {h} is not a "
                    "multiple of 4; cannot halve it keeping the merge size"
                )
                continue
            wrong = [2 * t, h // 2, w]
            entry["metadata"]["video_grid_thw"] = grid_like(
                entry["metadata"]["video_grid_thw"], wrong
            )
            fault.effects.append(f"{mm_hash}: video_grid_thw [{t}, {h}, {w}] -> {wrong}")
            fault.touched.append(Path(mm_hash))

    fault.after_encode = after_encode
    return fault


def video_grid(entry: dict[str, Any]) -> tuple[int, int, int] | None:
    """(t, h, w) from an encoder's `ec_transfer_params` entry, None if it is not a video."""
    grid = (entry.get("metadata") or {}).get("video_grid_thw")
    if grid is None:
        return None
    flat = [int(v) for v in _flatten(grid)]
    return (flat[0], flat[1], flat[2]) if len(flat) == 3 else None


def grid_like(original: Any, values: list[int]) -> Any:
    """`values` nested like `original` ([t, h, w] or [[t, h, w]])."""
    if isinstance(original, list) and original and isinstance(original[0], list):
        return [values]
    return values


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def kill_instance(server: ManagedServer) -> None:
    """SIGKILL a running server's whole process group, as a crash or the OOM killer would.

    The group holds the API server and the EngineCore it forked, so nothing of the instance is
    left to answer. The server is not stopped or reaped here: noticing the death is the job of
    the code under test, and the session's exit still cleans up.
    """
    if server.pgid is None or not server.is_alive():
        raise RuntimeError(f"{server.name} is not running (exit code {server.exit_code})")
    os.killpg(server.pgid, signal.SIGKILL)


def flip_away_from_zero(tensor: torch.Tensor) -> torch.Tensor:
    """Every element changes sign and lands at least 1 from zero: x >= 0 -> -x-1, x < 0 -> -x+1.

    Unlike plain negation (which keeps zeros) or small noise (which bf16 rounding may absorb),
    this changes every element, so a unit test can prove the file was really corrupted.
    """
    import torch

    return torch.where(tensor >= 0, -tensor - 1, -tensor + 1).to(tensor.dtype)


def zeros(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.zeros_like(tensor)


def file_seed(seed: int, key: str) -> int:
    """A per-file seed: the same for the same (seed, file key) on every run and machine."""
    return zlib.crc32(f"{seed}:{key}".encode())


def add_relative_noise(tensor: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`tensor` + N(0, (fraction * std(tensor))^2), computed in float32, cast back.

    The std is the tensor's own (all elements), so the strength means the same for an EC
    embedding and for a KV layer whatever their scale. Seeded: equal inputs give equal outputs.
    """
    import torch

    original = tensor.float()
    std = float(original.std()) if original.numel() > 1 else 0.0
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(original.shape, generator=generator, dtype=torch.float32)
    return (original + noise * (fraction * std)).to(tensor.dtype)


def relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """std(after - before) / std(before), in float32: the strength really planted."""
    b = before.float()
    std = float(b.std())
    return float((after.float() - b).std()) / std if std else math.inf


def noise_transform(
    fraction: float, seed: int, fault: PlantedFault
) -> Callable[[torch.Tensor], torch.Tensor]:
    def transform(tensor: torch.Tensor) -> torch.Tensor:
        noisy = add_relative_noise(tensor, fraction, seed)
        fault.effects.append(
            f"noise {fraction:g} of std asked, "
            f"{relative_change(tensor, noisy):.3g} planted ({tensor.dtype})"
        )
        return noisy

    return transform


def content_seeded_noise(
    fraction: float, seed: int, fault: PlantedFault
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`noise_transform` seeded by (`seed`, a digest of the tensor's values): the same tensor
    gets the same noise on every run, machine and protocol (`ec_noise`)."""

    def transform(tensor: torch.Tensor) -> torch.Tensor:
        digest = hashlib.sha256(tensor.detach().float().cpu().numpy().tobytes()).hexdigest()
        return noise_transform(fraction, file_seed(seed, digest[:32]), fault)(tensor)

    return transform


def zero_frame_rows(tensor: torch.Tensor, grid_t: int, frame: int) -> torch.Tensor:
    """`tensor` with the rows of temporal frame `frame` (of `grid_t`, frame-major) zeroed."""
    rows = tensor.shape[0]
    if grid_t <= 0 or rows % grid_t:
        raise ValueError(f"{rows} rows do not split into {grid_t} temporal frames")
    if not 0 <= frame < grid_t:
        raise ValueError(f"frame {frame} is outside the video's {grid_t} temporal frames")
    per_frame = rows // grid_t
    out = tensor.clone()
    out[frame * per_frame : (frame + 1) * per_frame] = 0
    return out


def zero_frame_transform(
    grid_t: int, frame: int, fault: PlantedFault
) -> Callable[[torch.Tensor], torch.Tensor]:
    def transform(tensor: torch.Tensor) -> torch.Tensor:
        zeroed = zero_frame_rows(tensor, grid_t, frame)
        per_frame = tensor.shape[0] // grid_t
        fault.effects.append(
            f"zeroed rows {frame * per_frame}-{(frame + 1) * per_frame - 1} "
            f"(frame {frame} of {grid_t}) of {tuple(tensor.shape)}"
        )
        return zeroed

    return transform


def kv_file_stamps(kv_storage: Path) -> dict[Path, tuple[int, int]]:
    """Every KV file under `kv_storage` with its (mtime_ns, size): what changed since."""
    stamps = {}
    for path in kv_storage.rglob(f"*{KV_FILE_SUFFIX}") if kv_storage.is_dir() else ():
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        stamps[path] = (stat.st_mtime_ns, stat.st_size)
    return stamps


class KvFilesSince:
    """The KV files P wrote (new or rewritten) since this was made or last settled: what a
    fault acting on one request's KV may touch, earlier prompts' files left alone."""

    def __init__(self, kv_storage: Path):
        self.kv_storage = kv_storage
        self._seen = kv_file_stamps(kv_storage)

    def fresh(self) -> list[Path]:
        current = kv_file_stamps(self.kv_storage)
        return sorted(path for path, stamp in current.items() if self._seen.get(path) != stamp)

    def settle(self) -> None:
        """Take the storage as it is now (after the fault acted) as seen."""
        self._seen = kv_file_stamps(self.kv_storage)


def write_bytes_atomic(path: Path, content: bytes) -> None:
    """Replace a file whole (a reader never sees it half-written)."""
    temporary = path.with_name(f".{path.name}.planted")
    temporary.write_bytes(content)
    os.replace(temporary, path)


def swap_tensor_files(paths: list[Path]) -> None:
    """Rotate the contents of safetensors files by one (2 files: a swap); shapes must agree."""
    from safetensors.torch import load_file, save_file

    contents = [load_file(path) for path in paths]
    layouts = [{k: (tuple(t.shape), t.dtype) for k, t in c.items()} for c in contents]
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError(f"the items' tensors differ in shape or dtype: {layouts}")
    for n, path in enumerate(paths):
        temporary = path.with_name(f".{path.name}.planted")
        save_file(contents[(n + 1) % len(paths)], str(temporary))
        os.replace(temporary, path)


def rewrite_tensors(path: Path, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply `transform` to every tensor of a safetensors file, keeping keys and metadata.

    Written to a temporary file and renamed over the original, so a reader never sees a
    half-written file (a truncated file would fail to load: an ERROR, not the planted MISMATCH).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    originals = load_file(path)
    tensors = {name: transform(tensor).contiguous() for name, tensor in originals.items()}
    for name, tensor in tensors.items():
        before = originals[name]
        if tensor.shape != before.shape or tensor.dtype != before.dtype:
            raise ValueError(
                f"{path}: {name} would change from {tuple(before.shape)} {before.dtype} to "
                f"{tuple(tensor.shape)} {tensor.dtype}; the consumer would reject the file"
            )
    temporary = path.with_name(f".{path.name}.planted")
    save_file(tensors, str(temporary), metadata=metadata)
    os.replace(temporary, path)


# Faults a whole run can be started with (`epd-harness run --plant-fault NAME`), so that a
# bundle from a planted failure can be replayed by `epd-harness repro` with the same fault.
FAULT_NAMES = ("corrupt-ec", "zero-kv", "drop-kv", "drop-metadata", "stream-duplicate-chunk")
# Faults that act on the P->D hop (a topology without one has nothing for them to break).
KV_FAULTS = ("zero-kv", "drop-kv", "kv-noise")
# Faults that act on streamed answers only (`--stream`).
STREAM_FAULTS = ("stream-duplicate-chunk",)
# Graded faults, NAME or NAME:STRENGTH (see `parse_fault`).
GRADED_FAULTS = {
    "ec-noise": "ec-noise:FRACTION  Gaussian noise, FRACTION x std, on each EC tensor (e.g. 0.05)",
    "kv-noise": "kv-noise:FRACTION  the same on the KV files P wrote for D",
    "ec-swap-items": "ec-swap-items      a request's media items get each other's EC embedding",
    "ec-zero-frame": "ec-zero-frame[:N]  temporal frame (pair) N (default 0) of a video's EC "
    "embedding zeroed",
    "ec-video-grid": "ec-video-grid      the consumer is told video grid [2t, h/2, w]: wrong "
    "positions, same size",
}
MAX_NOISE_FRACTION = 100.0
# ec-zero-frame's index: a temporal frame (pair) of the request's video, which has a handful;
# bounded so a long string of digits is refused as a typo, not carried into int() and float().
MAX_FRAME_INDEX = 9999
FAULT_SYNTAX = (
    "ec-noise:FRACTION, kv-noise:FRACTION, ec-swap-items, ec-zero-frame[:N], ec-video-grid"
)


@dataclass(frozen=True)
class FaultSpec:
    """A parsed `--plant-fault` value: the kind and, for graded faults, its strength."""

    kind: str
    strength: float | None = None  # noise: fraction of std; ec-zero-frame: the frame index

    @property
    def name(self) -> str:
        return self.kind if self.strength is None else f"{self.kind}:{self.strength:g}"


def parse_fault(text: str) -> FaultSpec:
    """`corrupt-ec`, `ec-noise:0.05`, `ec-zero-frame:1`, ...; BadInput (one line) otherwise."""
    kind, sep, value = text.strip().partition(":")
    if kind not in (*FAULT_NAMES, *GRADED_FAULTS):
        raise BadInput(
            f"unknown fault {text!r} (known: {', '.join(FAULT_NAMES)}) and no graded "
            f"fault either ({FAULT_SYNTAX})"
        )
    if kind in ("ec-noise", "kv-noise"):
        try:
            fraction = float(value) if sep else math.nan
        except ValueError:
            fraction = math.nan
        if not (0 < fraction <= MAX_NOISE_FRACTION):
            raise BadInput(
                f"fault {text!r}: {kind} needs a strength, a fraction of each "
                f"tensor's std in (0, {MAX_NOISE_FRACTION:g}], e.g. {kind}:0.05"
            )
        return FaultSpec(kind, fraction)
    if kind == "ec-zero-frame" and sep:
        # isascii: '²' is a digit to isdigit(), not to int(); the length before int(), which
        # refuses over 4300 digits.
        digits = value.isascii() and value.isdigit() and len(value) <= len(str(MAX_FRAME_INDEX))
        if not (digits and int(value) <= MAX_FRAME_INDEX):
            raise BadInput(
                f"fault {text!r}: ec-zero-frame takes a temporal frame index "
                f"(0, 1, ... {MAX_FRAME_INDEX}), e.g. ec-zero-frame:1"
            )
        return FaultSpec(kind, float(int(value)))
    if sep:
        raise BadInput(f"fault {text!r}: {kind} takes no strength; drop ':{value}'")
    return FaultSpec(kind)


def fault_reaches(kind: str, topology: Topology) -> bool:
    """Whether a fault of `kind` has anything to act on in `topology`: KV faults need a P->D
    hop, stream faults a stream from D (or PD) through a proxy, the others an encoder."""
    if kind in KV_FAULTS:
        return topology.has_kv_transfer
    if kind in STREAM_FAULTS:
        return not topology.is_baseline
    return topology.has_ec_transfer


def fault_for(
    name: str,
    ec_storage: Path | None,
    kv_storage: Path | None,
    kv_connector: str = "ExampleConnector",
) -> PlantedFault:
    """The named fault (plain or graded, see `parse_fault`), aimed at a running topology's
    storage; under NixlConnector zero-kv becomes `misroute_nixl_blocks` (there are no files)."""
    spec = parse_fault(name)
    if spec.kind in KV_FAULTS:
        if kv_storage is None:
            raise ValueError(f"fault {spec.kind} needs a topology with P and D")
        if spec.kind == "drop-kv":
            return drop_kv(kv_storage, kv_connector)
        if kv_connector == "NixlConnector":
            if spec.kind == "kv-noise":
                raise BadInput(
                    "kv-noise rewrites ExampleConnector's KV files; under "
                    "--kv-connector nixl the KV never leaves P's memory, and its noise needs "
                    "a plugin D is started with (the graded self-test, "
                    "scenarios/test_detection.py, plants it): use zero-kv, which misroutes "
                    "NIXL's block ids instead"
                )
            return misroute_nixl_blocks()
        return (
            zero_kv_files(kv_storage)
            if spec.kind == "zero-kv"
            else kv_noise(kv_storage, spec.strength or 0.0)
        )
    if spec.kind == "drop-metadata":
        return drop_encoder_metadata()
    if spec.kind == "stream-duplicate-chunk":
        return duplicate_stream_chunk()
    if ec_storage is None:
        raise ValueError(f"fault {spec.kind} needs a topology with an encoder")
    if spec.kind == "corrupt-ec":
        return corrupt_ec_files(ec_storage)
    if spec.kind == "ec-noise":
        return ec_noise(ec_storage, spec.strength or 0.0)
    if spec.kind == "ec-swap-items":
        return ec_swap_items(ec_storage)
    if spec.kind == "ec-zero-frame":
        return ec_zero_frame(ec_storage, int(spec.strength or 0))
    return ec_video_grid(ec_storage)
