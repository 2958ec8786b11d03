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


def fake_worker_class(receiving: dict[str, Meta], finished: set[str]) -> type:
    """The attributes of vLLM 0.32's NixlPullConnectorWorker the plugin uses, nothing else."""
    import torch

    class Worker:
        num_blocks = NUM_BLOCKS

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
            return Results(set(finished))

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
