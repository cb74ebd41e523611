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
attention kernel. Anything else (and any step whose metadata is not that kernel's) runs the eager
forward. Where the engine follows its thread budget between layers (``LayerProgress``: the
decode service's CPU sharing), a step runs a layer a call, each at the thread count its layer
starts with (a kernel's split does not change its numbers).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu import decode_program as prog
from kernels.cpu.dense_tiles import DenseTileWeight, linear_parts, tile_bias
from kernels.cpu.layer_ops import LayerKernels
from kernels.cpu.layer_ops import parts as op_parts
from kernels.cpu.quant_linear import QuantWeight
from kernels.cpu.quant_linear import linear_parts as quant_parts
from kernels.cpu.rope import MAX_HEAD_DIM, RopeKernel
from shared.runtime.attention.common import LayerProgress
from shared.runtime.attention.cpu_kernels import CpuKernelDecodeMetadata
from shared.runtime.model import CausalLM, DecoderLayer, Projection

# The step array's slots.
COS, SIN, SLOTS, TABLES, MAX_BLOCKS, LENS, MAX_LEN = range(7)
STEP_SLOTS = 7
# norm, qkv, RoPE, KV store, attention, o, add + norm, gate_up, SiLU * up, down, add
OPS_PER_LAYER = 11


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
class _Batch:
    """One batch size's buffers (every thread count's ops read and write these) and its ops by
    thread count (each kernel's split is the count's)."""

    hidden: torch.Tensor
    buffers: dict[str, torch.Tensor]
    keep: list[torch.Tensor]  # tensors whose addresses the ops hold (padded biases)
    step: ctypes.Array[ctypes.c_int64]
    programs: dict[int, prog.Program]


class DecodePrograms:
    """The programs of one model and KV cache; see the module docstring."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, lib: ctypes.CDLL) -> None:
        self.model, self.kv_cache, self.lib = model, kv_cache, lib
        self._batches: dict[tuple[int, float], _Batch] = {}
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
        its next step), or None where this step is not one a program runs. Under
        :class:`LayerProgress` (the engine's thread budget followed between layers) the layers
        run one call each, each reported stored after it, each at the thread count of its
        start."""
        progress = None
        if type(meta) is LayerProgress:
            progress, meta = meta, meta.meta
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
        entry = self._batches.get((batch, meta.scale))
        if entry is None:
            entry = self._batches[(batch, meta.scale)] = self._buffers(batch)
        rows, values = meta.rows, entry.step
        values[COS], values[SIN] = cos.data_ptr(), sin.data_ptr()
        values[SLOTS] = meta.slot_mapping.data_ptr()
        values[TABLES] = rows.block_tables.data_ptr()
        values[MAX_BLOCKS] = rows.block_tables.shape[1]
        values[LENS], values[MAX_LEN] = rows.context_lens.data_ptr(), rows.max_context_len
        entry.hidden.copy_(hidden)
        if progress is None:
            self._program(entry, meta).run()
        else:
            for i in range(len(self.model.layers)):
                self._program(entry, meta).run(i * OPS_PER_LAYER, (i + 1) * OPS_PER_LAYER)
                progress.stored()
        return entry.hidden

    def _buffers(self, batch: int) -> _Batch:
        first = self.model.layers[0]
        assert isinstance(first, DecoderLayer)
        a, hidden = first.self_attn, self.model.config.hidden_size
        inter = first.mlp.down_proj.in_features
        widths = {"hidden": hidden, "x": hidden, "qkv": a.q_size + 2 * a.kv_size,
                  "attn": a.q_size, "o": hidden, "x2": hidden, "gate_up": 2 * inter,
                  "act": inter, "down": hidden}  # fmt: skip
        buffers = {name: torch.zeros(batch, cols) for name, cols in widths.items()}
        return _Batch(buffers["hidden"], buffers, [], prog.step_array(STEP_SLOTS), {})

    def _program(self, entry: _Batch, meta: CpuKernelDecodeMetadata) -> prog.Program:
        threads = torch.get_num_threads()
        program = entry.programs.get(threads)
        if program is None:
            program = entry.programs[threads] = self._record(entry, meta)
        return program

    def _record(self, entry: _Batch, meta: CpuKernelDecodeMetadata) -> prog.Program:
        """Every layer's OPS_PER_LAYER ops at this thread count, over ``entry``'s buffers."""
        model, cache, b = self.model, self.kv_cache, entry.buffers
        hidden, x, qkv, attn = b["hidden"], b["x"], b["qkv"], b["attn"]
        o, x2, gate_up, act, down = b["o"], b["x2"], b["gate_up"], b["act"], b["down"]
        batch, hidden_size = hidden.shape
        qkv_n, inter = qkv.shape[1], act.shape[1]
        program = prog.Program(self.lib, entry.step)
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
            start = len(program)
            program.add(prog.RMS_NORM, prog.address(k._norm[torch.float32]),
                        [hidden.data_ptr(), batch, hidden_size, hidden_size,
                         n1.weight.data_ptr(), x.data_ptr(), op_parts(batch * hidden_size)],
                        n1.eps)  # fmt: skip
            self._linear(program, a.qkv_proj, x, qkv, entry.keep)
            program.add(prog.ROPE, prog.address(a.rope_kernel._rope),
                        [qkv.data_ptr(), batch, a.num_heads + a.num_kv_heads, a.head_dim, qkv_n,
                         step(COS), step(SIN)])  # fmt: skip
            k_at = qkv.data_ptr() + a.q_size * qkv.element_size()
            v_at = k_at + a.kv_size * qkv.element_size()
            program.add(prog.STORE_KV, None,
                        [k_at, v_at, qkv_n, a.kv_size, step(SLOTS), batch, k_pool.data_ptr(),
                         v_pool.data_ptr(), num_slots])  # fmt: skip
            program.add(prog.ATTEND, attend,
                        [qkv.data_ptr(), qkv_n, k_pool.data_ptr(), v_pool.data_ptr(),
                         step(TABLES), step(MAX_BLOCKS), step(LENS), 0, batch,
                         kernel.parts(batch), a.num_heads, a.num_kv_heads, a.head_dim,
                         cache.shape[3], step(MAX_LEN), attn.data_ptr()], meta.scale)  # fmt: skip
            self._linear(program, a.o_proj, attn, o, entry.keep)
            program.add(prog.ADD_RMS_NORM, prog.address(k._add_norm[torch.float32]),
                        [hidden.data_ptr(), o.data_ptr(), batch, hidden_size,
                         n2.weight.data_ptr(), x2.data_ptr(), op_parts(batch * hidden_size)],
                        n2.eps)  # fmt: skip
            self._linear(program, layer.mlp.gate_up_proj, x2, gate_up, entry.keep)
            program.add(prog.SILU_MUL, prog.address(k._silu_mul[torch.float32]),
                        [gate_up.data_ptr(), batch, inter, 2 * inter, act.data_ptr(),
                         op_parts(batch * inter)])  # fmt: skip
            self._linear(program, layer.mlp.down_proj, act, down, entry.keep)
            program.add(prog.ADD, None, [hidden.data_ptr(), down.data_ptr(), batch * hidden_size])
            assert len(program) - start == OPS_PER_LAYER
        return program

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
