"""What one fake instance knows and counts: its role (from the connector configs it was started
with, as vLLM's), the chat it answers, the EC and KV it moves through its connectors
(ECExampleConnector, ExampleConnector, NIXL), its optional prefix cache, and the `/metrics`
counters the transfer guards read. It holds no socket of its own: the handlers (`handlers`) call
it, and it reads a NIXL P's blocks as a client of that P's side channel.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import urllib.error
import urllib.request

if __package__:  # imported, by the tests of its pure functions
    from harness.testing.fake_vllm_server.failures import RequestFailed, RequestRejected
    from harness.testing.fake_vllm_server.media import GRID_KEYS, MediaItem
    from harness.testing.fake_vllm_server.model import (
        generated_ids,
        kv_rows,
        model_placeholder_ids,
        tokenize,
    )
    from harness.testing.fake_vllm_server.tensors import (
        EC_FILE,
        KV_LAYER,
        ROW_BYTES,
        kv_folder,
        read_tensor,
        write_tensor,
    )
else:  # the executable: harness.testing.fake_vllm wrote these modules beside it
    from failures import RequestFailed, RequestRejected  # type: ignore[no-redef]
    from media import GRID_KEYS, MediaItem  # type: ignore[no-redef]
    from model import (  # type: ignore[no-redef]
        generated_ids,
        kv_rows,
        model_placeholder_ids,
        tokenize,
    )
    from tensors import (  # type: ignore[no-redef]
        EC_FILE,
        KV_LAYER,
        ROW_BYTES,
        kv_folder,
        read_tensor,
        write_tensor,
    )


def aligned_prefix(prompt_tokens: int, block_size: int) -> int:
    """ExampleConnector's whole blocks, leaving D at least one token to compute."""
    return ((prompt_tokens - 1) // block_size) * block_size


# The read goes straight to P, never through the environment's HTTP(S)_PROXY, which urllib's
# default opener follows for 127.0.0.1 too: through a runner's proxy every read failed and D
# recomputed (found in review). Run as a script beside its modules, this fake cannot import
# the harness's own opener (`harness.serve.http_direct`).
DIRECT_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Engine:
    """What one fake instance knows and counts."""

    def __init__(self, args: argparse.Namespace, modes: dict[str, float]):
        ec = json.loads(args.ec_transfer_config or "{}")
        kv = json.loads(args.kv_transfer_config or "{}")
        ec_role, kv_role = ec.get("ec_role", ""), kv.get("kv_role", "")
        self.role = (
            "encoder"
            if ec_role == "ec_producer"
            else "prefill"
            if kv_role == "kv_producer"
            else "decode"
            if kv_role == "kv_consumer"
            else "pd"
            if ec_role
            else "baseline"
        )
        self.model = args.served_model_name or args.model
        self.placeholder_ids = model_placeholder_ids(args.model)
        self.modes = modes
        self.block_size = args.block_size
        self.ec_storage = (ec.get("ec_connector_extra_config") or {}).get("shared_storage_path")
        self.kv_storage = (kv.get("kv_connector_extra_config") or {}).get("shared_storage_path")
        self.nixl = kv.get("kv_connector") == "NixlConnector"
        # vLLM 0.32 lets an EC or KV consumer take metadata-only `*_embeds` parts, enabling
        # embedding inputs for it (config/vllm.py, allow_missing_mm_embeddings); any other
        # instance takes them only when started with --enable-mm-embeds.
        consumer = (ec.get("ec_connector") and ec_role in ("ec_consumer", "ec_both")) or (
            kv.get("kv_connector") and kv_role in ("kv_consumer", "kv_both")
        )
        self.enable_mm_embeds = bool(args.enable_mm_embeds or consumer)
        self.side_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        self.side_port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or 0)
        self.engine_id = f"fake-{os.getpid()}"
        self.lock = threading.Lock()
        self.blocks: dict[int, bytes] = {}  # NIXL P: block id -> its rows
        self.sent: dict[str, list[int]] = {}  # NIXL P: request id -> its blocks
        self.next_block = 1
        self.prefix_cache: dict[str, bytes] = {}  # mode prefix-cache: key -> full blocks' rows
        self.counters = {
            "cached:p2p": 0.0,
            "cached:external_unspecified": 0.0,
            "source:external_kv_transfer": 0.0,
            "source:local_compute": 0.0,
            "source:local_cache_hit": 0.0,
            "nixl_transfers": 0.0,
            "nixl_bytes": 0.0,
            "nixl_failed": 0.0,
            "success": 0.0,
        }

    def count(self, **increments: float) -> None:
        """Add to the `/metrics` counters (`a__b` names the counter `a:b`), under the lock: the
        handlers' threads count concurrently."""
        with self.lock:
            for name, value in increments.items():
                key = name.replace("__", ":")
                self.counters[key] = self.counters.get(key, 0.0) + value

    # -- chat ------------------------------------------------------------------------------

    def chat(self, body: dict, request_id: str) -> dict:
        """The unstreamed answer to a chat completion `body`, moving and counting its EC and KV
        as this instance's role does."""
        ids, placeholders, items = tokenize(body, self.placeholder_ids)
        for item in items:
            if item.embeds and not self.enable_mm_embeds:  # renderers/chat_utils.py
                embeds = f"{item.kind}_embeds"
                raise RequestRejected(
                    f"You must set `--enable-mm-embeds` to input `{embeds}`", embeds
                )
        ec_params = self.encode(items) if self.role == "encoder" else None
        key = self.prefix_key(body, ids, items)
        held = self.held_prefix(key)
        moved, cached = self.load_kv(body, ids, items, len(held) // ROW_BYTES)
        loaded = held + moved
        cached += len(held) // ROW_BYTES
        rows = kv_rows(ids, placeholders, loaded, self.ec_storage, "serve-anything" in self.modes)
        self.count(
            source__local_compute=len(ids) - len(loaded) // ROW_BYTES,
            source__external_kv_transfer=len(moved) // ROW_BYTES,
            source__local_cache_hit=len(held) // ROW_BYTES,
        )
        self.keep_prefix(key, rows, len(ids))
        kv_params = self.save_kv(ids, items, rows, request_id) if self.role == "prefill" else None
        wanted = body.get("max_tokens") or body.get("max_completion_tokens") or 4
        out = generated_ids(rows, int(wanted))
        self.count(success=1)
        top = [{"token": f"token_id:{t}", "logprob": -0.5, "bytes": None} for t in out]
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "total_tokens": len(ids) + len(out),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        return {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model"),
            "prompt_token_ids": ids,
            "usage": usage,
            "kv_transfer_params": kv_params,
            "ec_transfer_params": ec_params,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "fake"},
                    "finish_reason": "length",
                    "token_ids": out,
                    "logprobs": {"content": [{**t, "top_logprobs": [t]} for t in top]},
                }
            ],
        }

    def prefix_key(self, body: dict, ids: list[int], items: list[MediaItem]) -> str | None:
        """The prompt's full blocks with its media's hashes and its salt (vLLM's block hashes
        carry both), where the mode keeps a prefix cache."""
        prefix = aligned_prefix(len(ids), self.block_size)
        if "prefix-cache" not in self.modes or prefix == 0:
            return None
        salt = str(body.get("cache_salt") or "")
        return json.dumps([salt, ids[:prefix], [item.hash for item in items]])

    def held_prefix(self, key: str | None) -> bytes:
        """The rows this instance holds for the prompt from an earlier request (b"": none)."""
        with self.lock:
            held = self.prefix_cache.get(key, b"") if key else b""
        if held:
            self.count(cached__device=len(held) // ROW_BYTES)
        return held

    def keep_prefix(self, key: str | None, rows: bytes, prompt_tokens: int) -> None:
        """Keep the prompt's full blocks for a later request (the mode prefix-cache only)."""
        if key:
            with self.lock:
                full_blocks = aligned_prefix(prompt_tokens, self.block_size)
                self.prefix_cache[key] = rows[: full_blocks * ROW_BYTES]

    def encode(self, items: list[MediaItem]) -> dict | None:
        """ECExampleConnector's producer: one file per item, one entry per mm_hash. An item
        whose file the storage already holds is loaded, not encoded, so nothing is written:
        vLLM 0.32's scheduler asks the connector's `has_cache_item` (the file exists) before
        scheduling an item's encoder (v1/core/sched/scheduler.py), and only an encoded item
        is saved."""
        params: dict = {}
        for index, item in enumerate(items):
            path = os.path.join(self.ec_storage or "", item.hash, EC_FILE)
            if self.ec_storage and not os.path.isfile(path):
                write_tensor(path, "ec_cache", item.computed())
            entry = params.setdefault(item.hash, {"item_indices": []})
            entry["item_indices"].append(index)
            grid_key = GRID_KEYS.get(item.kind)
            entry["metadata"] = (
                {grid_key: item.grid} if grid_key else {"audio_num_tokens": [item.tokens]}
            )
        return params or None

    def load_kv(
        self, body: dict, ids: list[int], items: list[MediaItem], held: int = 0
    ) -> tuple[bytes, int]:
        """D's KV from P, as its connector finds it, past the `held` tokens D's own prefix
        cache gave: (rows loaded, cached_tokens reported for them)."""
        if self.role != "decode":
            return b"", 0
        if self.nixl:  # NIXL reads only the blocks D does not hold
            params = body.get("kv_transfer_params") or {}
            return self.read_remote_blocks(params, len(ids), held // self.block_size), 0
        prefix = aligned_prefix(len(ids), self.block_size)
        if not self.kv_storage or held >= prefix:
            return b"", 0
        folder = kv_folder(self.kv_storage, ids[:prefix], [i.hash for i in items])
        path = os.path.join(folder, f"{KV_LAYER}.safetensors")
        if prefix == 0 or not os.path.isfile(path):
            return b"", 0
        rows = read_tensor(path, "kv_cache")
        if len(rows) != prefix * ROW_BYTES:
            raise RequestFailed(f"{path} holds {len(rows) // ROW_BYTES} rows for {prefix} tokens")
        self.count(cached__external_unspecified=prefix)
        return rows, prefix

    def read_remote_blocks(self, params: dict, prompt_tokens: int, skip: int = 0) -> bytes:
        """NIXL's read: the blocks P named past the first `skip` (D holds those), from P's side
        channel; a failed read is counted and the prompt computed here, as vLLM's D recomputes
        what it could not get."""
        groups = params.get("remote_block_ids")
        if not params.get("do_remote_prefill") or not groups:
            return b""
        blocks = (groups[0] if isinstance(groups[0], list) else groups)[skip:]
        if not blocks:
            return b""
        prompt_tokens -= skip * self.block_size
        url = (
            f"http://{params.get('remote_host')}:{params.get('remote_port')}/read?"
            f"request={params.get('remote_request_id')}&blocks={','.join(map(str, blocks))}"
        )
        try:
            with DIRECT_OPENER.open(url, timeout=30) as reply:
                data = reply.read()
        except (OSError, urllib.error.URLError) as exc:
            print(f"ERROR NIXL transfer failed: {exc}", flush=True)
            self.count(nixl_failed=1)
            return b""
        rows = data[: prompt_tokens * ROW_BYTES]
        received = len(rows) // ROW_BYTES
        self.count(cached__p2p=received, nixl_transfers=1, nixl_bytes=len(data))
        return rows[: received * ROW_BYTES]

    def save_kv(
        self, ids: list[int], items: list[MediaItem], rows: bytes, request_id: str
    ) -> dict | None:
        """P's side of the connector: files (ExampleConnector) or blocks kept for D's read."""
        if self.nixl:
            per_block = self.block_size * ROW_BYTES
            with self.lock:
                allocated = []
                for start in range(0, len(rows), per_block):
                    self.blocks[self.next_block] = rows[start : start + per_block]
                    allocated.append(self.next_block)
                    self.next_block += 1
                self.sent[request_id] = allocated
            return {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [allocated],
                "remote_engine_id": self.engine_id,
                "remote_request_id": request_id,
                "remote_host": self.side_host,
                "remote_port": self.side_port,
                "tp_size": 1,
                "remote_num_tokens": len(ids),
            }
        if self.kv_storage:
            prefix = aligned_prefix(len(ids), self.block_size)
            if prefix:
                folder = kv_folder(self.kv_storage, ids[:prefix], [i.hash for i in items])
                path = os.path.join(folder, f"{KV_LAYER}.safetensors")
                write_tensor(path, "kv_cache", rows[: prefix * ROW_BYTES])
        return None

    def serve_blocks(self, request_id: str, blocks: list[int]) -> bytes | None:
        """P's side channel: the rows of the blocks D reads (then freed, as D's notification
        frees them); None when P holds no such request or block."""
        with self.lock:
            if request_id not in self.sent or any(b not in self.blocks for b in blocks):
                return None
            data = b"".join(self.blocks[b] for b in blocks)
            for block in self.sent.pop(request_id):
                self.blocks.pop(block, None)
        return data

    # -- metrics ---------------------------------------------------------------------------

    def metrics(self) -> str:
        """`/metrics` in Prometheus' text format, under vLLM 0.32's names and labels."""
        with self.lock:
            c = dict(self.counters)
        labels = f'engine="0",model_name="{self.model}"'
        lines = []
        for source in ("device", "host", "disk", "p2p", "external_unspecified"):
            value = c.get(f"cached:{source}", 0.0)
            lines.append(
                f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="{source}"}} {value}'
            )
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            value = c.get(f"source:{source}", 0.0)
            lines.append(
                f'vllm:prompt_tokens_by_source_total{{{labels},source="{source}"}} {value}'
            )
        lines.append(
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {c["success"]}'
        )
        if self.nixl:
            lines += [
                f"vllm:nixl_xfer_time_seconds_count{{{labels}}} {c['nixl_transfers']}",
                f"vllm:nixl_xfer_time_seconds_sum{{{labels}}} {c['nixl_transfers'] * 0.001}",
                f"vllm:nixl_bytes_transferred_count{{{labels}}} {c['nixl_transfers']}",
                f"vllm:nixl_bytes_transferred_sum{{{labels}}} {c['nixl_bytes']}",
                f"vllm:nixl_num_failed_transfers_total{{{labels}}} {c['nixl_failed']}",
            ]
        return "\n".join(lines) + "\n"
