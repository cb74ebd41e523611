"""The CPU decode step's layers as one native call (kernels/cpu/decode_program.py), recorded once
per batch size and thread count.

The eager forward (model.py) makes about ten kernel calls a layer, and at a small model's decode
step the Python between them (checks, fresh tensors, ctypes conversions) costs as much as the
smaller kernels: a third of a batch-1 step of SmolLM2 with packed weights. A program records the
same calls with the same arguments (the wrappers' own rules for thread splits and bias padding)
into buffers of its own, so the step's numbers are the eager forward's bit for bit; per step it
only writes the RoPE tables', the slot mapping's and the block tables' addresses.

What it records: fp32 and bf16 models on the CPU whose layers run the decode engine's C forms
(fused norms and SiLU * up, the C RoPE, projections as dense tiles of the model's dtype or packed
GGUF weights on their int8 kernel) without sliding windows or q/k norms, over a KV cache of the
model's dtype (or bf16 under an fp32 model, its rows rounded as stored) read by the C attention
kernel. A bf16 model's step converts where its eager forward does (q to fp32 for the attention
kernel and its output back; a packed weight's x and y around the int8 kernel), with torch's
rounding, and adds its residual as torch adds bf16.
Anything else (and any step whose metadata is not that kernel's) runs the eager forward.
Where the engine follows its thread budget between layers (``LayerProgress``: the decode
service's CPU sharing), a step runs a layer a call, each at the thread count its layer starts
with (a kernel's split does not change its numbers).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict

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
DTYPES = (torch.float32, torch.bfloat16)


def _records(model: CausalLM) -> bool:
    """Whether every layer runs forms a program records (the module docstring)."""
    dtype = model.norm.weight.dtype
    if dtype not in DTYPES or model.norm.weight.device.type != "cpu":
        return False
    rope = RopeKernel if dtype == torch.float32 else LayerKernels
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        if not isinstance(layer.kernels, LayerKernels) or layer.mlp.kernels is not layer.kernels:
            return False
        if attn.window is not None or attn.qk_norm or not isinstance(attn.rope_kernel, rope):
            return False
        if attn.head_dim % 2 or attn.head_dim > MAX_HEAD_DIM:
            return False
        projections = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if not all(_linear_kind(p, dtype) for p in projections):
            return False
    return True


def _linear_kind(p: Projection, dtype: torch.dtype) -> int:
    """The op kind that runs ``p`` as its eager call would at a decode batch of ``dtype`` rows
    (0: none)."""
    w = p.packed
    if isinstance(w, DenseTileWeight) and w.dtype == dtype:
        return prog.DENSE_LINEAR
    if isinstance(w, QuantWeight) and w.kernels is not None and w.small_mode in ("int8", "bf16"):
        return prog.QUANT_LINEAR
    return 0


class _Buffers:
    """The activations every program reads and writes, ``capacity`` rows each: a batch of B
    rows uses the first B (a row's stride is its width whatever the capacity). A bf16 model's
    also has fp32 rows for what its kernels take in fp32 (q and the attention's output, a packed
    weight's x and y)."""

    def __init__(self, model: CausalLM, capacity: int) -> None:
        first = model.layers[0]
        assert isinstance(first, DecoderLayer)
        a, hidden = first.self_attn, model.config.hidden_size
        inter = first.mlp.down_proj.in_features
        qkv = a.q_size + 2 * a.kv_size
        widths = {"hidden": hidden, "x": hidden, "qkv": qkv, "attn": a.q_size, "o": hidden,
                  "x2": hidden, "gate_up": 2 * inter, "act": inter, "down": hidden}  # fmt: skip
        dtype = model.norm.weight.dtype
        self.capacity = capacity
        self.full = {n: torch.zeros(capacity, cols, dtype=dtype) for n, cols in widths.items()}
        if dtype != torch.float32:
            scratch = {"q32": a.q_size, "attn32": a.q_size, "x32": max(hidden, a.q_size, inter),
                       "y32": max(qkv, hidden, 2 * inter)}  # fmt: skip
            self.full |= {n: torch.zeros(capacity, cols) for n, cols in scratch.items()}

    def rows(self, batch: int) -> dict[str, torch.Tensor]:
        return {name: t[:batch] for name, t in self.full.items()}


class DecodePrograms:
    """The programs of one model and KV cache; see the module docstring."""

    # Programs kept (by batch, thread count and scale), the least recently run dropped first:
    # a serving engine meets many batch sizes, and each program holds ~170 bytes an op
    # (11 a layer in fp32, 13 to 21 in bf16).
    MAX_PROGRAMS = 64

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, lib: ctypes.CDLL) -> None:
        self.model, self.kv_cache, self.lib = model, kv_cache, lib
        self.dtype = model.norm.weight.dtype
        self._buffers: _Buffers | None = None
        self._programs: OrderedDict[tuple[int, int, float], prog.Program] = OrderedDict()
        # Each biased projection's bias as its kernel reads it (ops hold the address).
        self._biases: dict[int, torch.Tensor] = {}
        self.step = prog.step_array(STEP_SLOTS)
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
        dtype = model.norm.weight.dtype
        # The cache in the model's dtype, or bf16 under an fp32 model (the attention kernel
        # reads either; the store rounds rows as torch's copy does).
        cache_ok = kv_cache.dtype in (dtype, torch.bfloat16)
        if not cache_ok or not kv_cache.is_contiguous() or not _records(model):
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
        """The layers' output for the embedded ``hidden`` (the programs' buffer, valid until
        their next step), or None where this step is not one a program runs. Under
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
            or hidden.dtype != self.dtype
            or any(t.shape != table or t.dtype != self.dtype or not t.is_contiguous()
                   for t in (cos, sin))
        ):  # fmt: skip
            return None
        if self._buffers is None or self._buffers.capacity < batch:
            # New addresses: every program is recorded again over the larger buffers.
            capacity = 1 << (batch - 1).bit_length()
            self._buffers = _Buffers(self.model, capacity)
            self._programs.clear()
        rows, values = meta.rows, self.step
        values[COS], values[SIN] = cos.data_ptr(), sin.data_ptr()
        values[SLOTS] = meta.slot_mapping.data_ptr()
        values[TABLES] = rows.block_tables.data_ptr()
        values[MAX_BLOCKS] = rows.block_tables.shape[1]
        values[LENS], values[MAX_LEN] = rows.context_lens.data_ptr(), rows.max_context_len
        out = self._buffers.full["hidden"][:batch]
        out.copy_(hidden)
        if progress is None:
            self._program(batch, meta).run()
        else:
            for i in range(len(self.model.layers)):
                program = self._program(batch, meta)
                program.run(program.layers[i], program.layers[i + 1])
                progress.stored()
        return out

    def _program(self, batch: int, meta: CpuKernelDecodeMetadata) -> prog.Program:
        key = (batch, torch.get_num_threads(), meta.scale)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._record(batch, meta)
            if len(self._programs) > self.MAX_PROGRAMS:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
        return program

    def _record(self, batch: int, meta: CpuKernelDecodeMetadata) -> prog.Program:
        """Every layer's ops for ``batch`` rows at this thread count; ``program.layers``: where
        each layer's ops begin (and the end)."""
        assert self._buffers is not None
        model, cache, b = self.model, self.kv_cache, self._buffers.rows(batch)
        hidden, x, qkv, attn = b["hidden"], b["x"], b["qkv"], b["attn"]
        o, x2, gate_up, act, down = b["o"], b["x2"], b["gate_up"], b["act"], b["down"]
        dtype, bf16 = self.dtype, self.dtype == torch.bfloat16
        hidden_size = hidden.shape[1]
        qkv_n, inter = qkv.shape[1], act.shape[1]
        program = prog.Program(self.lib, self.step)
        step = prog.Program.step_arg
        kernel = meta.kernel
        attend = prog.address(kernel._attend[cache.dtype])
        num_slots = cache.shape[2] * cache.shape[3]
        for i, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer) and isinstance(layer.kernels, LayerKernels)
            k, a = layer.kernels, layer.self_attn
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            k_pool, v_pool = cache[i, 0], cache[i, 1]
            program.layers.append(len(program))
            program.add(prog.RMS_NORM, prog.address(k._norm[dtype]),
                        [hidden.data_ptr(), batch, hidden_size, hidden_size,
                         n1.weight.data_ptr(), x.data_ptr(), op_parts(batch * hidden_size)],
                        n1.eps)  # fmt: skip
            self._linear(program, a.qkv_proj, x, qkv, b)
            heads = a.num_heads + a.num_kv_heads
            rope_args = [qkv.data_ptr(), batch, heads, a.head_dim, qkv_n, step(COS), step(SIN)]
            if bf16:
                assert isinstance(a.rope_kernel, LayerKernels)
                program.add(prog.ROPE_PARTS, prog.address(a.rope_kernel._rope),
                            [*rope_args, op_parts(batch * heads * a.head_dim)])  # fmt: skip
            else:
                assert isinstance(a.rope_kernel, RopeKernel)
                program.add(prog.ROPE, prog.address(a.rope_kernel._rope), rope_args)
            k_at = qkv.data_ptr() + a.q_size * qkv.element_size()
            v_at = k_at + a.kv_size * qkv.element_size()
            program.add(prog.STORE_KV, None,
                        [k_at, v_at, qkv_n, a.kv_size, step(SLOTS), batch, k_pool.data_ptr(),
                         v_pool.data_ptr(), num_slots, qkv.element_size(),
                         cache.element_size()])  # fmt: skip
            # The attention kernel takes fp32 q and writes fp32 (a bf16 model's eager call
            # converts around it).
            q_at, q_stride, out = qkv.data_ptr(), qkv_n, attn
            if bf16:
                q_at, q_stride, out = b["q32"].data_ptr(), a.q_size, b["attn32"]
                program.add(prog.TO_F32, None, [qkv.data_ptr(), qkv_n, batch, a.q_size, q_at,
                                                a.q_size])  # fmt: skip
            program.add(prog.ATTEND, attend,
                        [q_at, q_stride, k_pool.data_ptr(), v_pool.data_ptr(),
                         step(TABLES), step(MAX_BLOCKS), step(LENS), 0, batch,
                         kernel.parts(batch), a.num_heads, a.num_kv_heads, a.head_dim,
                         cache.shape[3], step(MAX_LEN), out.data_ptr()], meta.scale)  # fmt: skip
            if bf16:
                program.add(prog.TO_BF16, None, [out.data_ptr(), a.q_size, batch, a.q_size,
                                                 attn.data_ptr(), a.q_size])  # fmt: skip
            self._linear(program, a.o_proj, attn, o, b)
            program.add(prog.ADD_RMS_NORM, prog.address(k._add_norm[dtype]),
                        [hidden.data_ptr(), o.data_ptr(), batch, hidden_size,
                         n2.weight.data_ptr(), x2.data_ptr(), op_parts(batch * hidden_size)],
                        n2.eps)  # fmt: skip
            self._linear(program, layer.mlp.gate_up_proj, x2, gate_up, b)
            program.add(prog.SILU_MUL, prog.address(k._silu_mul[dtype]),
                        [gate_up.data_ptr(), batch, inter, 2 * inter, act.data_ptr(),
                         op_parts(batch * inter)])  # fmt: skip
            self._linear(program, layer.mlp.down_proj, act, down, b)
            program.add(prog.ADD_BF16 if bf16 else prog.ADD, None,
                        [hidden.data_ptr(), down.data_ptr(), batch * hidden_size])  # fmt: skip
        program.layers.append(len(program))
        return program

    def _linear(
        self,
        program: prog.Program,
        p: Projection,
        x: torch.Tensor,
        y: torch.Tensor,
        b: dict[str, torch.Tensor],
    ) -> None:
        """``y = p.project(x)`` as the eager call runs it (the same kernel, split and bias; a
        tiled packed weight under a bf16 model: the kernel's entry that takes and gives bf16
        rows, the eager call's bits with the conversions in the kernel's threads; an untiled
        one: x to fp32 and y back around it)."""
        m, k = x.shape
        n = y.shape[1]
        w, kind = p.packed, _linear_kind(p, self.dtype)
        bias = 0
        if p.bias is not None:
            kept = self._biases.get(id(p))
            if kept is None:
                dense = kind == prog.DENSE_LINEAR
                kept = tile_bias(p.bias, n) if dense else p.bias.to(torch.float32).contiguous()
                self._biases[id(p)] = kept
            bias = kept.data_ptr()
        if kind == prog.DENSE_LINEAR:
            assert isinstance(w, DenseTileWeight)
            program.add(prog.DENSE_LINEAR, prog.address(w.kernels._linear[self.dtype]),
                        [x.data_ptr(), m, n, k, w.tiles.data_ptr(), bias, y.data_ptr(),
                         linear_parts(m, n, k)])  # fmt: skip
            return
        assert kind == prog.QUANT_LINEAR and isinstance(w, QuantWeight) and w.kernels is not None
        if not 0 < m <= w.small_max_rows:
            raise ValueError(f"{m} rows: past the packed weight's decode kernel")
        fn = w._small_kernel(w.kernels)  # the eager call's own choice (int8: tiles or rows; bf16)
        assert fn is not None
        io16 = w.kernels.io16_twin(fn) if self.dtype == torch.bfloat16 else None
        convert = self.dtype != torch.float32 and io16 is None
        x_at, y_at = x.data_ptr(), y.data_ptr()
        if convert:
            # fp32 x [m, k] and y [m, n], contiguous, at the start of the scratch rows
            x_at, y_at = b["x32"].data_ptr(), b["y32"].data_ptr()
            program.add(prog.TO_F32, None, [x.data_ptr(), k, m, k, x_at, k])
        program.add(prog.QUANT_LINEAR, prog.address(io16 or fn),
                    [w._raw_ptr, w._qtype, n, k, x_at, m, k, bias, y_at,
                     quant_parts(m, n, k)])  # fmt: skip
        if convert:
            program.add(prog.TO_BF16, None, [y_at, n, m, n, y.data_ptr(), n])
