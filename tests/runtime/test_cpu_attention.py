"""The C decode attention (kernels/cpu/paged_decode_attention.py) against the fp64 reference and the
torch path, over head sizes (specialised and generic), groups, block sizes and context lengths;
its thread split, its input checks, its build cache and its fallback."""

from __future__ import annotations

import ctypes
import random
from pathlib import Path

import pytest
import torch

from kernels.cpu.build import build_library
from kernels.cpu.paged_decode_attention import FLAGS, SOURCE, DecodeKernel, KernelBatch, load_kernel
from shared.runtime.attention import TorchAttentionBackend, select_backend, selector
from shared.runtime.attention.cpu_kernels import CpuKernelDecodeMetadata
from shared.runtime.attention.torch_backend import TorchDecodeMetadata
from tests.runtime.helpers import built_or_skip, torch_threads

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> DecodeKernel:
    loaded = load_kernel(tmp_path_factory.mktemp("kernels"), max_threads=1)
    return built_or_skip(loaded, "the torch path")


Case = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], list[int], list[int]
]


def _case(
    batch: int, num_heads: int, num_kv_heads: int, head_dim: int, bs: int, max_len: int, seed: int
) -> Case:
    """Lengths: one token, one block, one past it, the longest, then random; each sequence's
    blocks scattered over the pool, some tables longer than their context needs."""
    rng = random.Random(seed)
    lens = ([1, bs, bs + 1, max_len] + [rng.randint(1, max_len) for _ in range(batch)])[:batch]
    needs = [-(-n // bs) + rng.randint(0, 1) for n in lens]
    ids = list(range(1, sum(needs) + 1))
    rng.shuffle(ids)
    tables = [ids[sum(needs[:i]) : sum(needs[: i + 1])] for i in range(batch)]
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, len(ids) + 1, bs, num_kv_heads, head_dim, generator=g)
    q = torch.randn(batch, num_heads, head_dim, generator=g)
    k = torch.randn(batch, num_kv_heads, head_dim, generator=g)
    v = torch.randn(batch, num_kv_heads, head_dim, generator=g)
    slots = [bt[(n - 1) // bs] * bs + (n - 1) % bs for bt, n in zip(tables, lens, strict=True)]
    return pool, q, k, v, tables, lens, slots


def reference(
    q: torch.Tensor, pool: torch.Tensor, tables: list[list[int]], lens: list[int], scale: float
) -> torch.Tensor:
    """fp64 softmax attention of each query over its sequence's first ``n`` cached tokens."""
    bs, group = pool.shape[2], q.shape[1] // pool.shape[-2]
    out = []
    for i, (bt, n) in enumerate(zip(tables, lens, strict=True)):
        slots = [bt[p // bs] * bs + p % bs for p in range(n)]
        k = pool[0].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        v = pool[1].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[i].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", probs, v))
    return torch.stack(out)


def _tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "bs"),
    [
        (8, 4, 32, 16),  # the bench model
        (4, 4, 64, 16),  # no grouping
        (8, 1, 128, 16),  # one KV head (MQA)
        (4, 2, 16, 16),  # the tiny model: generic head size
        (6, 2, 80, 8),  # generic size, group 3, small blocks
        (2, 2, 32, 32),  # large blocks
        (4, 2, 24, 16),  # not a multiple of 16: the scalar scores loop
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_the_reference_and_the_torch_path(
    kernel: DecodeKernel, num_heads: int, num_kv_heads: int, head_dim: int, bs: int, seed: int
) -> None:
    pool, q, k, v, tables, lens, slots = _case(7, num_heads, num_kv_heads, head_dim, bs, 70, seed)
    num_blocks = pool.shape[1]
    torch_be = TorchAttentionBackend(num_blocks, bs, num_kv_heads, head_dim**-0.5, CPU)
    c_be = TorchAttentionBackend(
        num_blocks, bs, num_kv_heads, head_dim**-0.5, CPU, decode_kernel=kernel
    )
    meta = c_be.decode_metadata(slots, tables, lens)
    assert isinstance(meta, CpuKernelDecodeMetadata)
    pool_c = pool.clone()
    got = meta.forward(q, k, v, pool_c)
    want_torch = torch_be.decode_metadata(slots, tables, lens).forward(q, k, v, pool)
    assert torch.equal(pool_c, pool)  # the new token's K/V stored the same way
    torch.testing.assert_close(got, want_torch, atol=2e-6, rtol=2e-5)
    want = reference(q, pool, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "bs"),
    [
        (14, 2, 64, 16),  # the Qwen2-0.5B shape: vector loops
        (9, 3, 64, 16),  # SmolLM2's: rows widened in pairs (vec16.h load_pairs), group 3
        (4, 2, 32, 16),  # a head of one pair of vectors (AVX-512)
        (4, 1, 256, 16),  # a head wider than a walk's registers: walks of whole pairs
        (4, 2, 16, 16),  # vector loops, one 16-wide column
        (6, 2, 24, 8),  # not a multiple of 16: the scalar loops
        (9, 9, 128, 16),  # K rows too wide to widen into scratch: converted where they lie
    ],
)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_a_bf16_cache_is_read_in_fp32(
    kernel: DecodeKernel,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bs: int,
    q_dtype: torch.dtype,
) -> None:
    """Over a bf16 cache the kernel computes in fp32 on the cached values (each widens exactly):
    fp32-close to the fp64 reference on those values, rounded to q's dtype once."""
    pool, q, k, v, tables, lens, slots = _case(9, num_heads, num_kv_heads, head_dim, bs, 70, 4)
    pool, q = pool.bfloat16(), q.to(q_dtype)
    backend = TorchAttentionBackend(
        pool.shape[1], bs, num_kv_heads, head_dim**-0.5, CPU, decode_kernel=kernel
    )
    meta = backend.decode_metadata(slots, tables, lens)
    pool_c = pool.clone()
    got = meta.forward(q, k.bfloat16(), v.bfloat16(), pool_c)
    assert got.dtype == q_dtype and got.shape == q.shape
    want = reference(q.float(), pool_c.float(), tables, lens, head_dim**-0.5)
    rtol = 2**-8 if q_dtype == torch.bfloat16 else 1e-5  # rounded once: half a bf16 step, and a bit
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=rtol)
    # torch's bf16 path rounds scores and probabilities to bf16 on the way: close, not equal
    torch_be = TorchAttentionBackend(pool.shape[1], bs, num_kv_heads, head_dim**-0.5, CPU)
    want_torch = torch_be.decode_metadata(slots, tables, lens).forward(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), pool.clone()
    )
    torch.testing.assert_close(got.bfloat16(), want_torch, atol=3e-2, rtol=3e-2)


def test_a_batch_split_across_threads_gives_the_same_numbers(tmp_path: Path) -> None:
    one, four = load_kernel(tmp_path, max_threads=1), load_kernel(tmp_path, max_threads=4)
    if one is None or four is None:
        pytest.skip("no C compiler")
    pool, q, _, _, tables, lens, _ = _case(37, 8, 4, 32, 16, 90, seed=3)
    bt = _tables(tables)
    cl = torch.tensor(lens)
    rows = KernelBatch(bt, cl, max(lens), pool.shape[2])
    with torch_threads(4):  # a call splits into torch's thread count, up to its maximum
        a = one.attend(q, pool, rows, 0.2)
        b = four.attend(q, pool, rows, 0.2)
        assert (one.parts(37), four.parts(37), four.parts(31)) == (1, 4, 3)
    with torch_threads(2):  # fewer threads now (an engine gave back borrowed cores)
        assert four.parts(37) == 2
    assert torch.equal(a, b)  # each row is computed the same way whichever thread runs it


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc")
def test_the_kernels_split_on_torchs_own_openmp_runtime(tmp_path: Path) -> None:
    """The C kernels' parts run on the OpenMP team torch's GEMMs use: the process maps one
    OpenMP runtime, torch's (a second one would start its own team beside torch's, and the
    two took turns on the same cores)."""
    from kernels.cpu.layer_ops import load_layer_ops
    from kernels.cpu.paged_decode_int8 import load_int8_kernel
    from kernels.cpu.prefill_attention import load_prefill_kernel

    kernels = [load_kernel(tmp_path), load_prefill_kernel(tmp_path), load_int8_kernel(tmp_path),
               load_layer_ops(tmp_path)]  # fmt: skip
    paths = [k.path for k in kernels if k is not None]
    if len(paths) < len(kernels):
        pytest.skip("no C compiler")
    for path in paths:  # each splits through OpenMP (a lookup also searches what it links)
        assert hasattr(ctypes.CDLL(str(path)), "GOMP_parallel"), path.name
    runtimes = {
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "libgomp" in line or "libiomp" in line or "libomp" in line
    }
    torch_lib = Path(torch.__file__).parent / "lib"
    assert len(runtimes) == 1, runtimes
    if (torch_lib / "libgomp.so.1").exists():  # torch's own wheel: its bundled copy
        assert runtimes == {str(torch_lib / "libgomp.so.1")}


def test_inputs_it_cannot_read_are_refused(kernel: DecodeKernel) -> None:
    pool, q, _, _, tables, lens, _ = _case(5, 4, 2, 32, 16, 40, seed=0)
    bt = _tables(tables)
    cl = torch.tensor(lens)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernel.attend(q.double(), pool, KernelBatch(bt, cl, max(lens), 16), 1.0)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernel.attend(q, pool.half(), KernelBatch(bt, cl, max(lens), 16), 1.0)
    with pytest.raises(ValueError, match="int64"):
        KernelBatch(bt.int(), cl, max(lens), 16)
    with pytest.raises(ValueError, match="longer"):
        KernelBatch(bt, cl, max(lens) - 1, 16)
    with pytest.raises(ValueError, match="longer"):
        KernelBatch(bt[:, :1].contiguous(), cl, max(lens), 16)
    with pytest.raises(ValueError, match="one block table"):
        KernelBatch(bt[:2], cl, max(lens), 16)
    with pytest.raises(ValueError, match="one block table"):
        kernel.attend(q[:2], pool, KernelBatch(bt, cl, max(lens), 16), 1.0)


def test_the_library_is_built_once_per_source(tmp_path: Path) -> None:
    first = build_library(SOURCE, FLAGS, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert build_library(SOURCE, FLAGS, tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_without_a_compiler_the_torch_path_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert load_kernel(tmp_path / "cache") is None
    monkeypatch.setattr(selector, "load_kernel", lambda: None)  # what select_backend calls
    backend = select_backend(CPU, 8, 16, 2, 1.0)
    assert backend.name == "torch"
    meta = backend.decode_metadata([0], [[0]], [1])
    assert isinstance(meta, TorchDecodeMetadata)


def test_backend_choice() -> None:
    """fp32 or bf16 on CPU: the decode kernel (an int8 cache, fp32 only: its own) and, where it
    serves, the prefill kernel; "torch" or another dtype: torch."""
    from kernels.cpu.prefill_attention import load_prefill_kernel
    from shared.runtime.kv_codec import make_kv_codec

    prefill = load_prefill_kernel()
    serves = prefill is not None and prefill.serves
    assert select_backend(CPU, 8, 16, 2, 1.0, cpu_attention="torch").name == "torch"
    assert select_backend(CPU, 8, 16, 2, 1.0, dtype=torch.bfloat16).name == "torch+c-decode"
    bf16 = select_backend(CPU, 8, 16, 2, 1.0, dtype=torch.bfloat16, head_dim=64)
    assert bf16.name == "torch+c-decode" + ("+prefill" if serves else "")
    fp16 = select_backend(CPU, 8, 16, 2, 1.0, dtype=torch.float16, head_dim=64)
    assert fp16.name == "torch"
    int8 = make_kv_codec("int8")
    assert select_backend(CPU, 8, 16, 2, 1.0, codec=int8).name == "torch+c-int8"
    assert select_backend(CPU, 8, 16, 2, 1.0, codec=int8, dtype=torch.bfloat16).name == "torch"
    assert select_backend(CPU, 8, 16, 2, 1.0, codec=int8, cpu_attention="torch").name == "torch"
    with pytest.raises(ValueError, match="BATON_CPU_ATTENTION"):
        select_backend(CPU, 8, 16, 2, 1.0, cpu_attention="fast")
