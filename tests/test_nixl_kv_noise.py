"""The NIXL form of the graded KV fault: a vLLM plugin in D's environment only
(harness/run/faults/nixl_kv_noise_plugin.py) and the harness side that orders and reads it back
(`harness.run.faults.nixl.nixl_kv_noise`).

The e2e ladder (scenarios/test_detection.py under `--epd-kv-connector nixl`) shows the fault
turns real NIXL runs red; here: the noise lands on the ordered request's blocks and nowhere
else, the plugin is found by vLLM's own plugin loader from a PYTHONPATH directory (nothing
installed), and what D did comes back to the harness as touched/effects/problems.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.run.faults import nixl_kv_noise_plugin as plugin
from harness.run.faults.nixl import install_nixl_kv_noise_plugin, nixl_kv_noise

pytestmark = pytest.mark.model

NUM_BLOCKS, HEADS, SLOTS, DIM = 12, 2, 64, 32  # the tiny model's layout: K and V slots per block


@dataclass
class Remote:
    request_id: str


@dataclass
class Meta:
    local_physical_block_ids: tuple[list[int], ...]
    remote: Remote
    local_block_ids: tuple[list[int], ...] = ()


@dataclass
class Results:
    finished_recving: set[str]
    finished_sending: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


def fake_worker_class(
    receiving: dict[str, Meta],
    finished: set[str],
    failed: frozenset[str] = frozenset(),
    num_blocks: int = NUM_BLOCKS,
) -> type:
    """The attributes of vLLM 0.32's NixlPullConnectorWorker the plugin uses, nothing else."""
    import torch

    blocks_in_cache = num_blocks

    class Worker:
        num_blocks = blocks_in_cache

        def __init__(self) -> None:
            torch.manual_seed(0)
            self.device_kv_caches = {
                f"layer.{n}": torch.randn(NUM_BLOCKS, HEADS, SLOTS, DIM).to(torch.bfloat16)
                for n in range(2)
            }
            self._recving_metadata = dict(receiving)

        def get_transfer_results(self) -> Results:
            for req_id in finished:  # as vLLM's: finished requests leave the metadata
                self._recving_metadata.pop(req_id, None)
            return Results(set(finished), failed_recving=set(failed))

    return Worker


def order(
    control: Path, remote_request_id: str, fraction: float = 0.05, label: str = "rung"
) -> None:
    (control / plugin.FAULT_FILE).write_text(
        json.dumps(
            {
                "fraction": fraction,
                "seed": 10,
                "key": "d-kv-noise-1",
                "label": label,
                "remote_request_id": remote_request_id,
            }
        )
    )


def test_block_dim_is_the_dimension_of_the_caches_block_count() -> None:
    assert plugin.block_dim((NUM_BLOCKS, HEADS, SLOTS, DIM), NUM_BLOCKS) == 0
    assert plugin.block_dim((2, NUM_BLOCKS, HEADS, 32, DIM), NUM_BLOCKS) == 1
    with pytest.raises(ValueError, match="no dimension"):
        plugin.block_dim((3, 4), NUM_BLOCKS)


def test_noise_lands_on_the_ordered_requests_blocks_only(tmp_path: Path) -> None:
    import torch

    receiving = {
        "d-1": Meta(([3, 5, 7],), Remote("p-ordered")),
        "d-2": Meta(([8, 9],), Remote("p-clean")),
    }
    worker_class = fake_worker_class(receiving, {"d-1", "d-2"})
    plugin.wrap(worker_class, tmp_path)
    worker = worker_class()
    before = {k: v.clone() for k, v in worker.device_kv_caches.items()}
    order(tmp_path, "p-ordered")
    worker.get_transfer_results()

    for layer, cache in worker.device_kv_caches.items():
        changed = [b for b in range(NUM_BLOCKS) if not torch.equal(cache[b], before[layer][b])]
        assert changed == [3, 5, 7], (layer, changed)
    (effect,) = [
        json.loads(line) for line in (tmp_path / plugin.EFFECTS_FILE).read_text().splitlines()
    ]
    assert effect["req_id"] == "d-1" and effect["label"] == "rung", effect
    assert effect["blocks"] == 3 and effect["layers"] == 2, effect
    assert 0.04 < effect["planted"] < 0.06, "5% of std asked; bf16 rounding keeps it near"


def test_a_hybrid_models_state_layers_are_skipped_and_its_attention_layers_perturbed(
    tmp_path: Path,
) -> None:
    """A hybrid model's D holds (conv, ssm) state tuples beside its attention KV: those are no
    KV blocks to noise, and trying them turned the whole request into a problem line, with no
    layer perturbed. Skipped, the attention layers get the noise and the states stay as they
    were."""
    import torch

    worker_class = fake_worker_class({"d-1": Meta(([3, 5],), Remote("p-1"))}, {"d-1"})
    plugin.wrap(worker_class, tmp_path)
    worker = worker_class()
    state = (torch.randn(NUM_BLOCKS, 4, 3), torch.randn(NUM_BLOCKS, HEADS, DIM))
    worker.device_kv_caches = {"mamba.0": state, **worker.device_kv_caches}
    before = [tensor.clone() for tensor in state]
    order(tmp_path, "p-1")
    worker.get_transfer_results()

    (effect,) = [
        json.loads(line) for line in (tmp_path / plugin.EFFECTS_FILE).read_text().splitlines()
    ]
    assert "problem" not in effect and effect["layers"] == 2, effect
    assert all(torch.equal(a, b) for a, b in zip(worker.device_kv_caches["mamba.0"], before))


def test_without_an_order_nothing_is_touched(tmp_path: Path) -> None:
    import torch

    worker_class = fake_worker_class({"d-1": Meta(([3],), Remote("p-1"))}, {"d-1"})
    plugin.wrap(worker_class, tmp_path)
    worker = worker_class()
    before = {k: v.clone() for k, v in worker.device_kv_caches.items()}
    worker.get_transfer_results()
    assert all(torch.equal(v, before[k]) for k, v in worker.device_kv_caches.items())
    assert not (tmp_path / plugin.EFFECTS_FILE).exists()


def test_a_rerun_plants_the_same_noise(tmp_path: Path) -> None:
    """Seeded by the order's key (the rung's prompt), not by the request id, whose random part
    differs from run to run."""
    import torch

    caches = []
    for run in range(2):
        control = tmp_path / str(run)
        control.mkdir()
        worker_class = fake_worker_class({"d": Meta(([1, 2],), Remote("p"))}, {"d"})
        plugin.wrap(worker_class, control)
        worker = worker_class()
        order(control, "p", label=f"1P+1D-d-kv-noise-1-{run:08x}")
        worker.get_transfer_results()
        caches.append(worker.device_kv_caches["layer.0"])
    assert torch.equal(caches[0], caches[1])


def test_the_harness_orders_from_ps_answer_and_reads_back_what_d_did(tmp_path: Path) -> None:
    site = install_nixl_kv_noise_plugin(tmp_path / "site")
    fault = nixl_kv_noise(site, 0.05, seed=10)
    assert fault.after_prefill is not None
    fault.after_prefill("req-A", {"kv_transfer_params": {"remote_request_id": "p-A"}})
    written = json.loads((site.control / plugin.FAULT_FILE).read_text())
    assert written == {
        "fraction": 0.05,
        "seed": 10,
        "key": "req-A",
        "label": "req-A",
        "remote_request_id": "p-A",
    }

    plugin.append_line(
        site.control,
        plugin.EFFECTS_FILE,
        {
            "label": "req-A",
            "req_id": "d-A",
            "blocks": 6,
            "layers": 2,
            "planted": 0.0501,
            "cache_shape": [9, 2, 64, 32],
        },
    )
    fault.collect()
    assert fault.touched and not fault.problems, (fault.touched, fault.problems)
    assert "0.0501 planted on 6 blocks x 2 layers" in fault.effects[0], fault.effects
    assert not (site.control / plugin.FAULT_FILE).exists(), "the order is cleared after use"


def test_an_order_d_never_carried_out_is_a_problem(tmp_path: Path) -> None:
    site = install_nixl_kv_noise_plugin(tmp_path / "site")
    fault = nixl_kv_noise(site, 0.05)
    fault.after_prefill("req-B", {"kv_transfer_params": {"remote_request_id": "p-B"}})
    fault.collect()
    assert not fault.touched and "reported nothing" in fault.problems[0], fault.problems
    missing = nixl_kv_noise(site, 0.05)
    missing.after_prefill("req-C", {"kv_transfer_params": {}})
    assert "no remote_request_id" in missing.problems[0], missing.problems


def test_d_alone_gets_the_plugin_and_the_harness_pythonpath_is_kept(tmp_path: Path) -> None:
    site = install_nixl_kv_noise_plugin(tmp_path / "site")
    env = site.env({"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"] == f"{site.plugin_path}{os.pathsep}/elsewhere"
    assert env[plugin.CONTROL_ENV] == str(site.control)
    entry_points = next(site.plugin_path.glob("*.dist-info")) / "entry_points.txt"
    assert entry_points.read_text() == (
        f"[vllm.general_plugins]\n{plugin.PACKAGE} = {plugin.PACKAGE}:register\n"
    )


def discovered_plugins(env: dict[str, str]) -> list[str]:
    """The `vllm.general_plugins` entry points an interpreter with `env` discovers: the list
    vLLM's loader (`vllm.plugins.load_plugins_by_group`) starts from, read with the same
    `importlib.metadata` call and without importing vLLM (a fraction of a second)."""
    code = (
        "import json\nfrom importlib.metadata import entry_points\n"
        f"found = entry_points(group={plugin.ENTRY_POINT_GROUP!r})\n"
        "print(json.dumps(sorted(e.name for e in found)))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout)


def test_vllms_own_plugin_loader_finds_and_applies_it(tmp_path: Path) -> None:
    """In a fresh interpreter of the served vLLM, with only PYTHONPATH and the control variable
    set: `load_general_plugins()` (what every vLLM process calls) wraps the NIXL pull worker;
    without them no interpreter even discovers the plugin (nothing is installed)."""
    site = install_nixl_kv_noise_plugin(tmp_path / "site")
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        f"from {plugin.WORKER_MODULE} import {plugin.WORKER_CLASS} as W\n"
        f"print(W.get_transfer_results.__module__, getattr(W, {plugin.PATCHED_FLAG!r}, False))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **site.env()},
        timeout=300,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split()[-2:] == [plugin.PACKAGE, "True"], child.stdout
    (loaded,) = site.loaded()
    assert loaded["patched"].endswith(plugin.WORKER_CLASS), loaded

    assert plugin.PACKAGE in discovered_plugins({**os.environ, **site.env()})
    without = {k: v for k, v in os.environ.items() if k != plugin.CONTROL_ENV}
    assert plugin.PACKAGE not in discovered_plugins(without), "no plugin outside the self-test's D"


def test_only_a_completed_read_of_the_ordered_request_is_perturbed(tmp_path: Path) -> None:
    """A read that failed is not planted on (D recomputes or errors: no noise of the fault's
    reached the answer), and a finished request D holds no receive metadata for is passed
    over: the wrapper runs inside D's worker, where an exception stops D."""
    import torch

    receiving = {"d-1": Meta(([3, 5],), Remote("p-ordered"))}
    worker_class = fake_worker_class(receiving, {"d-1", "d-gone"}, failed=frozenset({"d-1"}))
    plugin.wrap(worker_class, tmp_path)
    worker = worker_class()
    before = {k: v.clone() for k, v in worker.device_kv_caches.items()}
    order(tmp_path, "p-ordered")
    worker.get_transfer_results()
    assert all(torch.equal(v, before[k]) for k, v in worker.device_kv_caches.items())
    assert not (tmp_path / plugin.EFFECTS_FILE).exists()


def test_what_d_cannot_plant_is_a_problem_line_and_d_keeps_serving(tmp_path: Path) -> None:
    """A request that received no blocks, and a cache whose block dimension is not found, each
    come back as a problem in effects.jsonl, not as an exception out of D's worker."""
    for name, meta, num_blocks, problem in (
        ("empty", Meta(([],), Remote("p-1")), NUM_BLOCKS, "the request received no blocks"),
        ("layout", Meta(([3],), Remote("p-1")), 5, "ValueError: no dimension"),
    ):
        control = tmp_path / name
        control.mkdir()
        worker_class = fake_worker_class({"d-1": meta}, {"d-1"}, num_blocks=num_blocks)
        plugin.wrap(worker_class, control)
        order(control, "p-1")
        worker_class().get_transfer_results()
        (effect,) = [
            json.loads(x) for x in (control / plugin.EFFECTS_FILE).read_text().splitlines()
        ]
        assert effect["problem"].startswith(problem), effect


def test_the_noise_is_a_fraction_of_the_std_of_the_blocks_but_the_last(tmp_path: Path) -> None:
    """The std is the received blocks' own (a cache of std 8 gets 8 times the noise of one of
    std 1), taken without the last block, whose unused slots hold what an earlier request left."""
    import torch

    torch.manual_seed(1)
    cache = torch.randn(4, HEADS, SLOTS, DIM) * 8
    cache[2] = torch.randn(HEADS, SLOTS, DIM) * 800  # the last block's leftovers
    before = cache.clone()
    planted = plugin.perturb_blocks(cache, 0, [0, 1, 2], 0.05, seed=3)
    noise = (cache[:2] - before[:2]).std() / before[:2].std()
    assert 0.045 < float(noise) < 0.055, float(noise)
    assert 0.045 < planted < 0.055, planted
    assert torch.equal(cache[3], before[3]), "a block not received is never touched"


def test_the_noise_is_seeded_by_seed_key_and_layer_each() -> None:
    seeds = {
        plugin.layer_seed(seed, key, layer)
        for seed in (1, 2)
        for key in ("prompt-a", "prompt-b")
        for layer in ("layer.0", "layer.1")
    }
    assert len(seeds) == 8, "every layer of every (seed, key) draws noise of its own"
    assert plugin.layer_seed(1, "prompt-a", "layer.0") == plugin.layer_seed(
        1, "prompt-a", "layer.0"
    )


def test_the_harness_orders_with_the_rungs_key_and_collects_each_request_once(
    tmp_path: Path,
) -> None:
    """The order carries the key the fault was given (a rerun's request ids differ, its noise
    must not); each request is read back by its own label, once: a request D reported a
    problem for, or nothing at all, is a problem of that request only."""
    site = install_nixl_kv_noise_plugin(tmp_path / "site")
    fault = nixl_kv_noise(site, 0.05, seed=10, key="d-kv-noise-1")

    def request(label: str, record: dict | None) -> None:
        fault.after_prefill(label, {"kv_transfer_params": {"remote_request_id": f"p-{label}"}})
        written = json.loads((site.control / plugin.FAULT_FILE).read_text())
        assert (written["key"], written["label"]) == ("d-kv-noise-1", label), written
        if record is not None:
            plugin.append_line(site.control, plugin.EFFECTS_FILE, {"label": label, **record})
        fault.collect()

    done = {"req_id": "d-A", "blocks": 6, "layers": 2, "planted": 0.05, "cache_shape": [9]}
    request("req-A", done)
    request("req-B", {"req_id": "d-B", "problem": "the request received no blocks"})
    request("req-C", None)
    assert fault.touched == [Path("D:d-A")] and len(fault.effects) == 1, fault.touched
    assert fault.problems[0] == "req-B: D's plugin: the request received no blocks"
    assert fault.problems[1].startswith("req-C: D's plugin reported nothing"), fault.problems
    assert len(fault.problems) == 2, fault.problems


def test_the_plugin_wraps_once_and_does_nothing_without_the_control_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM may load general plugins more than once in a process: the worker is wrapped once
    (wrapped twice, each read would be planted on twice). Without the control variable, or
    with it empty, the plugin neither wraps nor writes anything."""
    import types

    worker_class = fake_worker_class({"d-1": Meta(([3],), Remote("p-1"))}, {"d-1"})
    module = types.ModuleType(plugin.WORKER_MODULE)
    setattr(module, plugin.WORKER_CLASS, worker_class)
    monkeypatch.setitem(sys.modules, plugin.WORKER_MODULE, module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(plugin.CONTROL_ENV, "")
    plugin.register()
    assert not getattr(worker_class, plugin.PATCHED_FLAG, False) and not list(tmp_path.iterdir())

    control = tmp_path / "control"
    control.mkdir()
    monkeypatch.setenv(plugin.CONTROL_ENV, str(control))
    plugin.register()
    plugin.register()
    order(control, "p-1")
    worker_class().get_transfer_results()
    effects = (control / plugin.EFFECTS_FILE).read_text().splitlines()
    assert len(effects) == 1, effects
    assert len((control / plugin.LOADED_FILE).read_text().splitlines()) == 2
