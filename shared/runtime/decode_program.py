"""The CPU decode step's layers as one native call (kernels/cpu/decode_program.py), recorded once
per batch size and thread count.

The eager forward (model.py) makes about ten kernel calls a layer, and at a small model's decode
step the Python between them (checks, fresh tensors, ctypes conversions) costs as much as the
smaller kernels: a third of a batch-1 step of SmolLM2 with packed weights. A program records the
same calls with the same arguments (the wrappers' own rules for thread splits and bias padding)
into buffers of its own, so the step's numbers are the eager forward's bit for bit; per step it
only writes the RoPE tables', the slot mapping's and the block tables' addresses.

What it records: fp32 models on the CPU whose layers run the decode engine's C forms (fused
norms and SiLU * up, the C RoPE, projections as fp32 dense tiles or packed GGUF weights on their
int8 kernel) without sliding windows or q/k norms, over a float KV cache read by the C
attention kernel. Anything else (and any step whose metadata is not that kernel's: a windowed
layer, the layer-wise handoff's progress reports) runs the eager forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu import decode_program as prog
from kernels.cpu.dense_tiles import DenseTileWeight, linear_parts, tile_bias
from kernels.cpu.layer_ops import LayerKernels
from kernels.cpu.layer_ops import parts as op_parts
from kernels.cpu.quant_linear import QuantWeight
from kernels.cpu.quant_linear import linear_parts as quant_parts
from kernels.cpu.rope import MAX_HEAD_DIM, RopeKernel
from shared.runtime.attention.cpu_kernels import CpuKernelDecodeMetadata
from shared.runtime.model import CausalLM, DecoderLayer, Projection

# The step array's slots.
COS, SIN, SLOTS, TABLES, MAX_BLOCKS, LENS, MAX_LEN = range(7)


def _records(model: CausalLM) -> bool:
    """Whether every layer runs forms a program records (the module docstring)."""
    if model.norm.weight.dtype != torch.float32 or model.norm.weight.device.type != "cpu":
        return False
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        if not isinstance(layer.kernels, LayerKernels) or layer.mlp.kernels is not layer.kernels:
            return False
        if attn.window is not None or attn.qk_norm or not isinstance(attn.rope_kernel, RopeKernel):
            return False
        if attn.head_dim % 2 or attn.head_dim > MAX_HEAD_DIM:
            return False
        projections = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if not all(_linear_kind(p) for p in projections):
            return False
    return True


def _linear_kind(p: Projection) -> int:
    """The op kind that runs ``p`` as its eager call would at a decode batch (0: none)."""
    w = p.packed
    if isinstance(w, DenseTileWeight) and w.dtype == torch.float32:
        return prog.DENSE_LINEAR
    if isinstance(w, QuantWeight) and w.kernels is not None and w.small_mode == "int8":
        return prog.QUANT_LINEAR
    return 0


@dataclass
class _Step:
    """One batch size's program and the buffers its ops read and write."""

    program: prog.Program
    hidden: torch.Tensor
    keep: list[torch.Tensor]  # tensors whose addresses the ops hold (buffers, padded biases)


class DecodePrograms:
    """The programs of one model and KV cache, by (batch, threads); see the module docstring."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, lib: object) -> None:
        self.model, self.kv_cache, self.lib = model, kv_cache, lib
        self._steps: dict[tuple[int, int, float], _Step] = {}
        # Past the packed weights' decode kernel (their small_max_rows) the eager call
        # dequantizes: such batches run the eager forward.
        self.max_batch = min(
            (m.packed.small_max_rows for m in model.modules()
             if isinstance(m, Projection) and isinstance(m.packed, QuantWeight)),
            default=1 << 62,
        )  # fmt: skip

    @classmethod
    def create(cls, model: CausalLM, kv_cache: torch.Tensor) -> DecodePrograms | None:
        """None where the model's forms or the cache are not ones a program records, or the
        library cannot be built."""
        if kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous() or not _records(model):
            return None
        lib = prog.load_program_library()
        return None if lib is None else cls(model, kv_cache, lib)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: object,
    ) -> torch.Tensor | None:
        """The layers' output for the embedded ``hidden`` (the program's buffer, valid until
        its next step), or None where this step is not one a program runs."""
        if type(meta) is not CpuKernelDecodeMetadata or meta.rows.starts is not None:
            return None
        batch = hidden.shape[0]
        table = (batch, 1, self.model.config.head_dim)
        if (
            kv_cache is not self.kv_cache
            or not 0 < batch <= self.max_batch
            or hidden.dtype != torch.float32
            or any(t.shape != table or t.dtype != torch.float32 or not t.is_contiguous()
                   for t in (cos, sin))
        ):  # fmt: skip
            return None
        key = (batch, torch.get_num_threads(), meta.scale)
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = self._record(batch, meta)
        rows, values = meta.rows, step.program.step
        values[COS], values[SIN] = cos.data_ptr(), sin.data_ptr()
        values[SLOTS] = meta.slot_mapping.data_ptr()
        values[TABLES], values[MAX_BLOCKS] = (
            rows.block_tables.data_ptr(),
            rows.block_tables.shape[1],
        )
        values[LENS], values[MAX_LEN] = rows.context_lens.data_ptr(), rows.max_context_len
        step.hidden.copy_(hidden)
        step.program.run()
        return step.hidden

    def _record(self, batch: int, meta: CpuKernelDecodeMetadata) -> _Step:
        model, cache = self.model, self.kv_cache
        first = model.layers[0]
        assert isinstance(first, DecoderLayer)
        a0 = first.self_attn
        hidden_size = model.config.hidden_size
        heads, kv_heads, head_dim = a0.num_heads, a0.num_kv_heads, a0.head_dim
        qkv_n = a0.q_size + 2 * a0.kv_size
        inter = first.mlp.down_proj.in_features

        def buf(cols: int) -> torch.Tensor:
            return torch.zeros(batch, cols)

        hidden, x, qkv, attn, o, x2 = (
            buf(n) for n in (hidden_size, hidden_size, qkv_n, a0.q_size, hidden_size, hidden_size)
        )
        gate_up, act, down = buf(2 * inter), buf(inter), buf(hidden_size)
        keep = [hidden, x, qkv, attn, o, x2, gate_up, act, down]
        program = prog.Program(self.lib, 7)  # type: ignore[arg-type]
        step = prog.Program.step_arg
        kernel = meta.kernel
        attend = prog.address(kernel._attend[torch.float32])
        num_slots = cache.shape[2] * cache.shape[3]
        for i, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer) and isinstance(layer.kernels, LayerKernels)
            k, a = layer.kernels, layer.self_attn
            assert isinstance(a.rope_kernel, RopeKernel)
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            k_pool, v_pool = cache[i, 0], cache[i, 1]
            program.add(prog.RMS_NORM, prog.address(k._norm[torch.float32]),
                        [hidden.data_ptr(), batch, hidden_size, hidden_size,
                         n1.weight.data_ptr(), x.data_ptr(), op_parts(batch * hidden_size)],
                        n1.eps)  # fmt: skip
            self._linear(program, a.qkv_proj, x, qkv, keep)
            program.add(prog.ROPE, prog.address(a.rope_kernel._rope),
                        [qkv.data_ptr(), batch, heads + kv_heads, head_dim, qkv_n, step(COS),
                         step(SIN)])  # fmt: skip
            k_at = qkv.data_ptr() + a.q_size * 4
            v_at = k_at + a.kv_size * 4
            program.add(prog.STORE_KV, None,
                        [k_at, v_at, qkv_n, a.kv_size, step(SLOTS), batch, k_pool.data_ptr(),
                         v_pool.data_ptr(), num_slots])  # fmt: skip
            program.add(prog.ATTEND, attend,
                        [qkv.data_ptr(), qkv_n, k_pool.data_ptr(), v_pool.data_ptr(),
                         step(TABLES), step(MAX_BLOCKS), step(LENS), 0, batch,
                         kernel.parts(batch), heads, kv_heads, head_dim, cache.shape[3],
                         step(MAX_LEN), attn.data_ptr()], meta.scale)  # fmt: skip
            self._linear(program, a.o_proj, attn, o, keep)
            program.add(prog.ADD_RMS_NORM, prog.address(k._add_norm[torch.float32]),
                        [hidden.data_ptr(), o.data_ptr(), batch, hidden_size,
                         n2.weight.data_ptr(), x2.data_ptr(), op_parts(batch * hidden_size)],
                        n2.eps)  # fmt: skip
            self._linear(program, layer.mlp.gate_up_proj, x2, gate_up, keep)
            program.add(prog.SILU_MUL, prog.address(k._silu_mul[torch.float32]),
                        [gate_up.data_ptr(), batch, inter, 2 * inter, act.data_ptr(),
                         op_parts(batch * inter)])  # fmt: skip
            self._linear(program, layer.mlp.down_proj, act, down, keep)
            program.add(prog.ADD, None, [hidden.data_ptr(), down.data_ptr(), batch * hidden_size])
        return _Step(program, hidden, keep)

    @staticmethod
    def _linear(
        program: prog.Program, p: Projection, x: torch.Tensor, y: torch.Tensor,
        keep: list[torch.Tensor],
    ) -> None:  # fmt: skip
        """``y = p.project(x)`` as the eager call runs it (the same kernel, split and bias)."""
        m, k = x.shape
        n = y.shape[1]
        w = p.packed
        bias = 0
        if isinstance(w, DenseTileWeight):
            if p.bias is not None:
                padded = tile_bias(p.bias, n)
                keep.append(padded)
                bias = padded.data_ptr()
            program.add(prog.DENSE_LINEAR, prog.address(w.kernels._linear[torch.float32]),
                        [x.data_ptr(), m, n, k, w.tiles.data_ptr(), bias, y.data_ptr(),
                         linear_parts(m, n, k)])  # fmt: skip
            return
        assert isinstance(w, QuantWeight) and w.kernels is not None
        if not 0 < m <= w.small_max_rows:
            raise ValueError(f"{m} rows: past the packed weight's decode kernel")
        if p.bias is not None:
            b = p.bias.contiguous()
            keep.append(b)
            bias = b.data_ptr()
        fn = w.kernels._tiles_linear if w.tiled else w.kernels._linear
        program.add(prog.QUANT_LINEAR, prog.address(fn),
                    [w._raw_ptr, w._qtype, n, k, x.data_ptr(), m, k, bias, y.data_ptr(),
                     quant_parts(m, n, k)])  # fmt: skip
