"""The forms a projection weight takes on CPU: transposed for few rows, packed for more.

The decode engine's form, where the build has its kernel: **dense tiles**
(kernels/cpu/dense_tiles.py; fp32 on AVX-512 or AVX2, bf16 on AVX512-BF16 or AMX), faster than
the libraries' forms at decode's row counts; ``BATON_DECODE_LINEAR=library`` keeps the forms
below (:func:`decode_tiles`). Elsewhere, and for tools and tests (no role), which packed form:
**oneDNN's** (kernels/cpu/onednn_pack.py) where torch has oneDNN and the CPU runs the dtype
natively: bf16 at every row count (AMX / avx512_bf16), fp32 at 4-48 rows, where it beats
``F.linear`` at decode's row counts and ties at prefill's. Else **MKL's** (fp32, from 4 rows).
One packed form per weight: the transposed one serves the rows it does not (a third copy of
every fp32 weight for MKL's 49+ rows, no faster than the transposed one there, was not worth its
memory). bf16 without oneDNN's bf16 stays plain. The measurements behind each choice:
docs/perf-log.md ("Dense tiles for decode's projections", "MKL packed projections", "oneDNN
prepacked projections").

Two changes to how ``F.linear`` sees a weight, both chosen on whole decode steps (weights cold,
as they are between steps):

- **Transposed.** The weight is held as its contiguous transpose behind the usual ``[out, in]``
  view, so MKL runs ``x @ w`` with no transposed operand: faster at decode's row counts, equal
  for prefill.
- **Packed** (kernels/cpu/mkl_pack.py, where torch has MKL). MKL copies a plain weight into its
  kernel's panel layout on every call; a weight packed once skips that copy, a gain that grows
  with the rows. At one or two rows MKL's GEMV on the plain weight wins, so a projection keeps
  both forms and :meth:`Projection.project` takes the packed one from ``PACKED_MIN_ROWS`` rows
  (memory: the packed copy is larger than the weight, at least MKL's minimum buffer).

Timing each form at start-up and keeping the fastest is not done: timed in a loop the weight
sits in cache, which hides most of what packing saves in a real step (such a choice leaves
projections plain that packing would speed up), and a choice that depends on a start-up
measurement makes runs differ for nothing.
Results equal ``F.linear``'s up to the last bits in every form; the parity tests check greedy
output against Hugging Face with them.

**One copy per engine.** Holding both forms would double each engine's weight memory (three
copies with the buffers loading went through). So the engine's role picks the forms: prefill's
forwards have hundreds of rows, where the forms are equal, so it keeps the transposed weight
only; decode keeps the tiled or packed form alone, for every row count. The price, where decode
keeps a library's form: MKL's GEMV lead at one or two rows, and oneDNN's fp32 form outside 4-48
rows (a little slower than the transposed weight there). A weight MKL would pack into several
times its bytes (its minimum buffer is a few MB) stays transposed. Without a role (tools, tests)
both forms stay.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu import dense_tiles, mkl_pack, onednn_pack, split_bf16
from kernels.cpu.dense_tiles import DenseTileWeight
from kernels.cpu.quant_linear import QuantWeight, bf16_gemm, load_quant_kernels
from shared.runtime.model import CausalLM, Projection


def transposed_copy(weight: torch.Tensor) -> torch.Tensor:
    """The same ``[out, in]`` values over a contiguous ``[in, out]`` buffer."""
    return weight.detach().t().contiguous().t()


ROLES = (None, "prefill", "decode")
# MKL's packed buffer has a minimum size and is padded by panel: several times a small weight,
# close to a large one's own size (mkl_pack.packed_bytes asks MKL). Packed only where it costs at
# most this much more.
MAX_PACKED_GROWTH = 1.25


PACKED_PREFILLS = ("auto", "bf16x3", "int16", "int8", "bf16", "exact")  # BATON_PACKED_PREFILL
PACKED_DECODES = ("auto", "int8", "bf16")  # BATON_PACKED_DECODE
# Rows from which "bf16x3" runs the split kernel; fewer take the wide (int16) tiled kernel: the
# weight's dequantize and split, once a call, cost more than the tiles save on a few rows.
SPLIT_MIN_ROWS = 64


def packed_form(
    weight: QuantWeight,
    role: str | None,
    head: bool,
    prefill: str = "auto",
    dtype: torch.dtype = torch.float32,
    decode: str = "int8",
) -> None:
    """The form a GGUF weight kept quantized takes in an engine of ``role``.

    Where the build has the tiled kernels (AVX-512 VNNI or AVX2), the weight is regrouped into
    their tiles (:meth:`QuantWeight.tile`, in place: a tied embedding gathers its rows from
    them) and a tiled kernel runs every row count: they keep their lead over dequantize + SGEMM
    at a prompt's hundreds of rows too (docs/perf-log.md, "Packed prefill on the tiles"), and a
    sequence's numbers do not depend on the batch it decodes in. An engine without a role takes
    the int8 kernel; decode takes ``decode``, the small mode :func:`decode_arith` resolved from
    BATON_PACKED_DECODE ("auto": where the CPU has AMX, from 32 rows a step a bf16 model's
    arithmetic on its bf16 tiles, ~1.6x the int8 kernel's pace at 64 rows, docs/perf-log.md
    "Packed decode on AMX's bf16 tiles"; fewer rows, and elsewhere, the int8 kernel). The
    prefill engine takes :func:`prefill_arith`'s arithmetic (BATON_PACKED_PREFILL; "auto": the
    most exact of the fast ones this CPU has):

    - "bf16x3" (AMX): from SPLIT_MIN_ROWS rows the weight is dequantized once a call and x and
      w each split into two bf16s, three tile products (kernels/cpu/split_bf16.py: ~4e-6 of
      the outputs' norm, below int16's error), fewer rows the int16 kernel;
    - "int16", x in two bytes a value (an error 1/256 of int8's: a prompt's KV and first token
      are the dequantized model's but at near-ties; ~2x SGEMM's speed with AVX-512 VNNI, on
      AMX's int8 tiles where the CPU has them, the same result);
    - "int8" (~4x, ~2x with AVX2, and the first token of a near-tie moves: llama.cpp's
      arithmetic);
    - "bf16" (where the CPU has a bf16 GEMM): x and the dequantized weight rounded to bf16, a
      bf16 GEMM, as a bf16 model (vLLM's bf16) computes: ~2x bf16x3's pace on AMX, ~3e-3 of
      the outputs' norm, and a near-tie's first token can move;
    - "exact": dequantized once a wave for SGEMM (up to fp32 summation order; a bf16 model
      through a bf16 GEMM of the weight rounded to bf16 where the CPU has one).

    ``dtype``: the model's. The prefill engine's head is exact whatever the choice: it serves
    one row per sequence, by the fp32 kernel (dequantized in registers), not a 113 MB fp32 copy
    of a 135M model's vocabulary per wave."""
    arith = prefill_arith(prefill, dtype) if role == "prefill" else None
    if role == "prefill" and head:
        weight.small_mode, weight.small_max_rows = "f32", 1 << 62
    elif arith in ("exact", "bf16"):
        weight.small_max_rows = 0
        weight.many_rows = "bf16" if arith == "bf16" else "sgemm"
    elif weight.tile():  # regrouped in place where the build has the tiles
        if arith == "bf16x3":
            weight.small_mode, weight.many_rows = "int16", "split"
            weight.small_max_rows = SPLIT_MIN_ROWS - 1
        else:
            if arith is not None:
                weight.small_mode = arith
            elif role == "decode":
                weight.small_mode = decode
            if weight.small_mode != "f32":
                weight.small_max_rows = 1 << 62


def decode_arith(decode: str) -> str:
    """What the decode engine computes tiled packed projections in for ``decode``
    (BATON_PACKED_DECODE): "bf16" (the int8 kernel below the kernels' ``bf16_rows``) where the
    CPU has AMX's bf16 tiles and the choice is "auto" or "bf16", else "int8"."""
    if decode not in PACKED_DECODES:
        raise ValueError(f"BATON_PACKED_DECODE={decode!r}: one of {PACKED_DECODES}")
    kernels = load_quant_kernels()
    amx = kernels is not None and kernels.bf16_rows > 0
    return "bf16" if decode != "int8" and amx else "int8"


def prefill_arith(prefill: str, dtype: torch.dtype = torch.float32) -> str:
    """What the prefill engine of a ``dtype`` model computes packed projections in
    (:func:`packed_form`) for ``prefill`` (BATON_PACKED_PREFILL). "auto": "bf16x3" where the
    CPU has AMX, else "int16" where it gains (below), else "exact". A choice this CPU cannot
    run or gains nothing from is "exact": without the tiled kernels everything but "exact" and
    "bf16"; "bf16" without a bf16 GEMM, or for a bf16 model (its exact path is that GEMM);
    "bf16x3" without AMX; "int16" with AVX2 tiles (two-byte x runs at SGEMM's pace there:
    docs/perf-log.md, "Packed prefill on the tiles"). A bf16 model on a CPU with a bf16 GEMM
    takes "exact" for "auto", "bf16x3" and "int16": it rounds x to bf16 anyway, and that GEMM
    is the faster."""
    kernels = load_quant_kernels()
    isa = "none" if kernels is None or kernels.tile_rows == 0 else kernels.tiles_isa
    if prefill == "bf16":
        return "bf16" if dtype == torch.float32 and bf16_gemm() else "exact"
    if isa == "none" or prefill == "exact":
        return "exact"
    if prefill == "int8":
        return prefill
    if dtype == torch.bfloat16 and bf16_gemm():
        return "exact"
    if prefill in ("auto", "bf16x3") and dtype == torch.float32 and split_bf16.available():
        return "bf16x3"
    if prefill in ("auto", "int16") and isa == "avx512-vnni":
        return "int16"
    return "exact"


DECODE_LINEARS = ("tiles", "library")  # BATON_DECODE_LINEAR


def decode_tiles(weight: torch.Tensor, choice: str = "tiles") -> bool:
    """Whether the decode engine holds ``weight`` in dense tiles (kernels/cpu/dense_tiles.py):
    wherever the build has the dtype's kernel, unless ``choice`` is "library"."""
    if choice == "library" or (weight.dtype is torch.bfloat16 and weight.shape[1] % 2):
        return False
    return dense_tiles.available(weight.dtype)


def embed_from_head(model: nn.Module, head: Projection, tiles: DenseTileWeight) -> None:
    """A head tied to the embedding, held in tiles by the decode engine, serves the embedding's
    row lookups too (:attr:`CausalLM.embed_packed`): the engine holds the vocabulary once, as
    it does a GGUF model's."""
    if not isinstance(model, CausalLM):
        return
    for module in (model.embed_tokens, head):
        module.weight = nn.Parameter(module.weight.new_empty(module.weight.shape, device="meta"))
    model.embed_packed = tiles


def _packs_small(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return mkl_pack.packed_bytes(n, k) <= MAX_PACKED_GROWTH * weight.numel() * weight.element_size()


@torch.inference_mode()
def prepare_projections(
    model: nn.Module,
    role: str | None = None,
    decode_linear: str = "tiles",
    packed_prefill: str = "auto",
    dtype: torch.dtype = torch.float32,
    packed_decode: str = "auto",
) -> int:
    """Transpose every :class:`Projection`'s weight and, where dense tiles (the decode role,
    ``decode_linear``), oneDNN or MKL can, pack it too; returns the number packed. ``role``:
    which forms an engine keeps (the module's docstring). A head tied to the embedding stays as
    it is (the embedding's row gather wants ``[vocab, hidden]``, contiguous) and is still
    packed; in the decode engine's tiles it serves the embedding too (:func:`embed_from_head`).
    A GGUF weight kept quantized (:class:`QuantWeight`) takes :func:`packed_form`'s form
    (``packed_prefill`` and ``packed_decode``: the engines' choices; ``dtype``: the model's)."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: one of {ROLES}")
    if decode_linear not in DECODE_LINEARS:
        raise ValueError(f"BATON_DECODE_LINEAR={decode_linear!r}: one of {DECODE_LINEARS}")
    if packed_prefill not in PACKED_PREFILLS:
        raise ValueError(f"BATON_PACKED_PREFILL={packed_prefill!r}: one of {PACKED_PREFILLS}")
    decode = decode_arith(packed_decode)  # refuses an unknown choice, whatever the model
    # By storage: the loader assigns a tied head its own Parameter over the embedding's tensor.
    tied = {
        m.weight.data_ptr()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and not m.weight.is_meta
    }
    head = getattr(model, "lm_head", None)
    packed = 0
    for module in model.modules():
        if isinstance(module, Projection) and isinstance(module.packed, QuantWeight):
            packed_form(module.packed, role, module is head, packed_prefill, dtype, decode)
            continue
        if not isinstance(module, Projection) or module.weight.is_meta:
            continue
        weight = module.weight.detach()
        form: mkl_pack.PackedWeight | onednn_pack.OneDnnWeight | DenseTileWeight | None = None
        if role == "prefill":
            pass
        elif role == "decode" and decode_tiles(weight, decode_linear):
            form = DenseTileWeight(weight)
        elif onednn_pack.available(weight.dtype):
            form = onednn_pack.OneDnnWeight(weight)
        elif weight.dtype == torch.float32 and mkl_pack.available() and _packs_small(weight):
            form = mkl_pack.PackedWeight(weight)
        if form is not None:
            module.packed = form
            packed += 1
        if module.weight.data_ptr() in tied:
            if role == "decode" and isinstance(form, DenseTileWeight):
                embed_from_head(model, module, form)
            continue
        if role == "decode" and form is not None:
            form.min_rows, form.max_rows = 1, 1 << 62  # it serves every row count alone
            module.weight = nn.Parameter(weight.new_empty(weight.shape, device="meta"))
        else:
            module.weight = nn.Parameter(transposed_copy(weight), requires_grad=False)
    return packed
