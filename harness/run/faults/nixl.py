"""Faults under NixlConnector, where P's KV never becomes a file: the block ids P hands D
misrouted (through the proxy), and noise on the blocks D read, planted inside D by the plugin
beside this module (`nixl_kv_noise_plugin`), which the harness installs into a directory of
the run and puts on that D's PYTHONPATH only."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.run.faults import nixl_kv_noise_plugin as plugin
from harness.run.faults.planted import PlantedFault


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
    block, and left one prompt in four (two_images) matching the baseline (measured). A prompt of
    one block has nothing to misroute: recorded as a problem rather than passed off as planted.
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
