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
child processes: without the permission, with it, with the non-AMX kernel, and as a repaired
environment runs it (the ISA vLLM picks, after the start-up hook `scripts/cpu` installs,
`harness/amx.py`), and prints each child's exit status. "Without the permission" turns that
hook off (EPD_HARNESS_AMX_PERMISSION=off), so the crash still shows in a repaired venv. Needs
the served vLLM's interpreter (vllm-cpu) on an x86 host:

    .venv/bin/python scripts/amx_attention_sigill.py

A child alone: `scripts/amx_attention_sigill.py ISA MODE`, ISA amx, vec or auto (the one vLLM
picks here), MODE no-permission (run it with EPD_HARNESS_AMX_PERMISSION=off), permission (ask
in the child) or hook (whatever the start-up hook did). It prints one `key=value` line before
the kernel runs and `completed` after (`scenarios/test_amx.py` reads both).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 32  # the tiny model's attention
CONTEXT, QUERY = 120, 1  # D's first step under NIXL for the 121-token text prompt
HOOK_OFF = {"EPD_HARNESS_AMX_PERMISSION": "off"}  # harness/amx.py's switch
MODES = ("no-permission", "permission", "hook")


def amx_permitted() -> bool:
    granted = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None)
    libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(granted))
    return bool(granted.value & (1 << XFEATURE_XTILEDATA))


def hook_status() -> str:
    """What the start-up hook did in this interpreter (harness/amx.py), if it is installed."""
    hook = sys.modules.get("_epd_harness_amx")
    return getattr(hook, "STATUS", None) or "no hook"


def run_kernel(isa: str, mode: str) -> None:
    """In this process: optionally ask for AMX, then one attention call as D's first step."""
    if mode == "permission":
        ctypes.CDLL(None).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    import torch
    import vllm._custom_ops as ops

    if isa == "auto":  # the one vLLM's CPU attention backend picks on this host
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(torch.bfloat16, BLOCK, HEAD_DIM)

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
    print(f"isa={isa} permitted_before_kernel={amx_permitted()} hook={hook_status()}", flush=True)
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


def run_child(isa: str, mode: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    """One child (`isa`, `mode`) in a fresh `python`, Python's faulthandler on for evidence."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    if mode == "no-permission":
        env.update(HOOK_OFF)
    return subprocess.run(
        [python, __file__, isa, mode], capture_output=True, text=True, env=env, check=False
    )


def main() -> int:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(__doc__)
        return 0
    if len(sys.argv) not in (1, 3):
        raise SystemExit(f"usage: {sys.argv[0]} [ISA MODE]  (--help says more)")
    if len(sys.argv) == 3:  # a child: ISA, MODE
        if sys.argv[2] not in MODES:
            raise SystemExit(f"MODE must be one of {', '.join(MODES)}")
        run_kernel(sys.argv[1], sys.argv[2])
        print("completed", flush=True)
        return 0
    for isa, mode in (
        ("amx", "no-permission"),
        ("amx", "permission"),
        ("vec", "no-permission"),
        ("auto", "hook"),
    ):
        child = run_child(isa, mode)
        seen = next((ln for ln in child.stdout.splitlines() if ln.startswith("isa=")), "")
        print(f"isa={isa:<4} {mode:<14} -> {describe(child.returncode)}  ({seen})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
