"""Compile the kernels for a GPU target on a machine without a GPU.

    python -m kernels.triton.compile_check [--arch 90] [--quick]

The CPU interpreter accepts code that the GPU compiler rejects (dot shapes, layouts, dtype
rules), so this runs the real Triton -> PTX -> cubin pipeline for sm_90 (H100/H200) on
representative specialisations and prints each kernel's shared memory. It needs triton with its
bundled ptxas, no CUDA driver, and TRITON_INTERPRET unset (interpreted kernels cannot be
compiled). Exit status 1 if any specialisation fails to compile.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton import _checks

HOPPER_SMEM_BYTES = 227 * 1024
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Spec:
    label: str
    kernel: Any
    pointers: dict[str, str]  # pointer argument -> element type ("bf16", "i32", ...)
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    scalars: dict[str, str] = field(default_factory=dict)  # non-stride scalars -> type


def _decode(dt: str, group: int, head_dim: int, int8: bool, split: bool, fp: bool = False) -> Spec:
    """``fp``: an int8 cache's full-precision window (slots of 4 tokens)."""
    from kernels.triton.paged_decode_attention import _config, _paged_decode_kernel

    cfg = _config(TORCH_DTYPES[dt], head_dim)
    kv = "i8" if int8 else dt
    out = "fp32" if split else dt
    return Spec(
        f"decode {dt} group={group} D={head_dim} int8={int8} split={split} fp={fp}",
        _paged_decode_kernel,
        {
            "q_ptr": dt,
            "k_cache_ptr": kv,
            "v_cache_ptr": kv,
            "k_scale_ptr": "fp32" if int8 else kv,
            "v_scale_ptr": "fp32" if int8 else kv,
            "block_tables_ptr": "i32",
            "context_lens_ptr": "i32",
            "fp_k_ptr": dt if fp else kv,
            "fp_v_ptr": dt if fp else kv,
            "fp_tables_ptr": "i32",
            "fp_starts_ptr": "i32",
            "out_ptr": out,
            "m_ptr": out,
            "l_ptr": out,
        },  # fmt: skip
        {
            "GROUP": group,
            "GROUP_PAD": max(16, triton.next_power_of_2(group)),
            "HEAD_DIM": head_dim,
            "BLOCK_SIZE": 16,
            "BLOCK_N": cfg["BLOCK_N"],
            "KV_INT8": int8,
            "SPLIT_KV": split,
            "HAS_FP": fp,
            "FP_BLOCK": 4 if fp else 1,
        },  # fmt: skip
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        scalars={"qk_scale": "fp32", "tokens_per_split": "i32", "window": "i32"},
    )


def _prefill(dt: str, group: int, head_dim: int, window: bool = False) -> Spec:
    from kernels.triton.prefill_attention import _config, _prefill_kernel

    cfg = _config(TORCH_DTYPES[dt], head_dim)
    return Spec(
        f"prefill {dt} group={group} D={head_dim} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}"
        + (" window" if window else ""),
        _prefill_kernel,
        {
            "q_ptr": dt,
            "k_cache_ptr": dt,
            "v_cache_ptr": dt,
            "block_tables_ptr": "i32",
            "cu_seqlens_q_ptr": "i32",
            "seq_lens_ptr": "i32",
            "out_ptr": dt,
        },  # fmt: skip
        {
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "BLOCK_SIZE": 16,
            "BLOCK_M": cfg["BLOCK_M"],
            "BLOCK_N": cfg["BLOCK_N"],
            "HAS_WINDOW": window,
        },  # fmt: skip
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        scalars={"qk_scale": "fp32", "window": "i32"},
    )


def specs(quick: bool) -> list[Spec]:
    from kernels.triton.int8_kv import _dequantize_kernel, _quantize_kernel
    from kernels.triton.kv_store import _store_kv_kernel
    from kernels.triton.paged_decode_attention import _split_kv_reduce_kernel

    out = [
        _decode("bf16", 4, 128, int8=False, split=False),
        _decode("bf16", 4, 128, int8=True, split=True),
        _decode("bf16", 4, 128, int8=True, split=True, fp=True),
        Spec("split-KV reduce", _split_kv_reduce_kernel,
             {"acc_ptr": "fp32", "m_ptr": "fp32", "l_ptr": "fp32", "out_ptr": "bf16"},
             {"NUM_SPLITS": 33, "SPLITS_PAD": 64, "HEAD_DIM": 128}),
        _prefill("bf16", 4, 128),
        _prefill("bf16", 4, 128, window=True),
        Spec("store_kv bf16", _store_kv_kernel,
             {"k_ptr": "bf16", "v_ptr": "bf16", "k_cache_ptr": "bf16", "v_cache_ptr": "bf16",
              "slot_mapping_ptr": "i64"},
             {"NUM_HEADS": 8, "HEADS_PAD": 8, "HEAD_DIM": 128}),
        Spec("quantize bf16", _quantize_kernel,
             {"x_ptr": "bf16", "x_q_ptr": "i8", "scale_ptr": "fp32"},
             {"BLOCK_R": 16, "HEAD_DIM": 128}, scalars={"num_rows": "i32"}),
        Spec("dequantize bf16", _dequantize_kernel,
             {"x_q_ptr": "i8", "scale_ptr": "fp32", "out_ptr": "bf16"},
             {"BLOCK_R": 16, "HEAD_DIM": 128}, scalars={"num_rows": "i32"}),
    ]  # fmt: skip
    if not quick:
        out += [
            _decode("fp16", 1, 64, int8=False, split=True),
            _decode("fp32", 2, 32, int8=False, split=False),
            _prefill("fp16", 1, 64),
            _prefill("fp32", 2, 128),
            _prefill("bf16", 4, 256),
        ]
    return out


def compile_spec(spec: Spec, target: GPUTarget) -> dict[str, Any]:
    fn = spec.kernel
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(fn.arg_names):
        if name in spec.constexprs:
            signature[name] = "constexpr"
            continue
        if name in spec.pointers:
            signature[name] = "*" + spec.pointers[name]
        elif name in spec.scalars:
            signature[name] = spec.scalars[name]
        elif name.startswith("stride"):
            signature[name] = "i32"
        else:
            raise ValueError(f"{spec.label}: no type for argument {name}")
        if signature[name].startswith("*") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what launch-time specialisation gives
    source = ASTSource(fn, signature, spec.constexprs, attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    compiled = triton.compile(source, target=target, options=options)
    return {"label": spec.label, "shared": compiled.metadata.shared}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90")
    parser.add_argument("--quick", action="store_true", help="one specialisation per kernel")
    args = parser.parse_args(argv)
    if _checks.interpreting():
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for spec in specs(args.quick):
        try:
            result = compile_spec(spec, target)
        except Exception as exc:  # report every failing specialisation, not just the first
            failures += 1
            print(f"FAIL  {spec.label}: {type(exc).__name__}: {exc}")
            continue
        smem = result["shared"]
        flag = "" if smem <= HOPPER_SMEM_BYTES else "  (exceeds Hopper shared memory)"
        failures += bool(flag)
        print(f"ok    {spec.label}: {smem} B shared memory{flag}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
