"""The rows the fake moves between instances, and the safetensors files its connectors keep them
in, written and read without torch (the fake must start fast, standard library only) yet in the
real format: the faults rewrite these files with torch's safetensors (`harness.run.faults`).

An "embedding" or "KV" row is `ROW_FLOATS` float32 derived from a seed: what the encoder writes
where ECExampleConnector does (`<ec storage>/<mm_hash>/EC_FILE`, tensor `ec_cache`) and P where
ExampleConnector does (`kv_folder`, `<KV_LAYER>.safetensors`, tensor `kv_cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading

if __package__:  # imported, by the tests of its pure functions
    from harness.testing.fake_vllm_server.failures import RequestFailed
else:  # the executable: harness.testing.fake_vllm wrote these modules beside it
    from failures import RequestFailed  # type: ignore[no-redef]

ROW_FLOATS = 4  # floats per embedding / KV row
ROW_BYTES = 4 * ROW_FLOATS
EC_FILE = "encoder_cache.safetensors"
KV_LAYER = "model.layers.0.self_attn.attn"


def write_tensor(path: str, name: str, data: bytes) -> None:
    """One float32 tensor of shape [rows, ROW_FLOATS] as a safetensors file."""
    rows = len(data) // ROW_BYTES
    header = {name: {"dtype": "F32", "shape": [rows, ROW_FLOATS], "data_offsets": [0, len(data)]}}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded + data)
    os.replace(partial, path)


def read_tensor(path: str, name: str) -> bytes:
    """The float32 bytes of tensor `name` of a safetensors file (as torch would save them)."""
    with open(path, "rb") as source:
        blob = source.read()
    (size,) = struct.unpack("<Q", blob[:8])
    entry = json.loads(blob[8 : 8 + size])[name]
    if entry["dtype"] != "F32":
        raise RequestFailed(f"{path}: {name} is {entry['dtype']}, not F32")
    start, end = entry["data_offsets"]
    return blob[8 + size + start : 8 + size + end]


def rows_from(seed: bytes, count: int) -> bytes:
    """`count` rows of float32 derived from `seed`; exactly representable values in [-2, 2)."""
    out = bytearray()
    for index in range(count):
        digest = hashlib.sha256(seed + index.to_bytes(4, "little")).digest()
        out += struct.pack(f"<{ROW_FLOATS}f", *((b - 128) / 64.0 for b in digest[:ROW_FLOATS]))
    return bytes(out)


def kv_folder(kv_storage: str, ids: list[int], hashes: list[str]) -> str:
    """ExampleConnector's layout: a directory named by a hash of the prefix ids and mm hashes."""
    key = struct.pack(f"<{len(ids)}q", *ids) + "-".join(hashes).encode()
    return os.path.join(kv_storage, hashlib.sha256(key).hexdigest()[:32])
