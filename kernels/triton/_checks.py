"""Argument checks shared by the kernel wrappers.

Every wrapper validates its inputs on the host before launching: a Triton kernel handed a wrong
dtype, shape or stride reads garbage or faults far from the cause. All checks raise ValueError
naming the offending argument.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and that device is CUDA unless the interpreter is on."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, other in devices.items():
        if other != device:
            raise ValueError(f"{name} is on {other} but {first_name} is on {device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {device} "
            "(set TRITON_INTERPRET=1 before importing triton to run them on CPU)"
        )
    return device


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of: {names}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """`shape` lists the expected sizes; None accepts any size in that dimension."""
    ok = t.dim() == len(shape) and all(
        e is None or e == s for e, s in zip(shape, t.shape, strict=True)
    )
    if not ok:
        expected = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {expected}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")


def check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    """Rows may be strided (e.g. views of a fused qkv tensor) but each row must be dense."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (strides {t.stride()})")


def check_power_of_two(name: str, value: int, minimum: int = 1, maximum: int = 1 << 30) -> None:
    if value < minimum or value > maximum or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two in [{minimum}, {maximum}]")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def check_query(q: torch.Tensor) -> None:
    """q [rows, Hq, D] as the attention kernels load it: a float dtype, dense rows (a strided
    view of a fused qkv is fine), D a power of two in [16, 256] (tl.dot's and the tiles')."""
    check_dtype("q", q, FLOAT_DTYPES)
    check_shape("q", q, (None, None, None))
    check_power_of_two("head_dim", q.shape[2], 16, 256)
    check_unit_last_stride("q", q)


def check_head_groups(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of {num_kv_heads}")


def check_paged_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache/v_cache: one contiguous shape [num_blocks, block_size, Hkv, D] for an already
    checked q (D its head dim), block_size a power of two and Hkv dividing q's heads; their
    dtype is the caller's to check."""
    check_shape("k_cache", k_cache, (None, None, None, q.shape[2]))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_power_of_two("block_size", k_cache.shape[1])
    check_head_groups(q.shape[1], k_cache.shape[2])
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 4 under the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
