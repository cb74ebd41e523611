"""The forms a projection weight takes on CPU: transposed for few rows, packed for more.

Which packed form: **oneDNN's** (kernels/cpu/onednn_pack.py) where torch has oneDNN and the CPU
runs the dtype natively: bf16 at every row count (AMX / avx512_bf16; 1.4x F.linear at 1-64 rows,
equal at prefill's 2,048), fp32 at 4-48 rows (1.4-2.1x at decode's row counts on an AMX Xeon,
2026-12-05; its table). Else **MKL's** (fp32, from 4 rows), measured on Zen 3 below. One packed
form per weight: the transposed one serves the rows it does not (memory: a third copy of every
fp32 weight for MKL's 49+ rows, ~1.0x the transposed one there, was not worth it). bf16 without
oneDNN's bf16 stays plain.

Two changes to how ``F.linear`` sees a weight, both measured on whole decode steps of the bench
model (one thread, paged KV, weights cold as they are between steps):

- **Transposed.** The weight is held as its contiguous transpose behind the usual ``[out, in]``
  view, so MKL runs ``x @ w`` with no transposed operand: 15-30% faster at decode row counts on
  Zen 4 (2026-11), equal for prefill.
- **Packed** (kernels/cpu/mkl_pack.py, where torch has MKL). MKL copies a plain weight into its
  kernel's panel layout on every call; a weight packed once skips that copy. Decode step,
  transposed against packed, ms (Zen 3, 2026-12-04, best of four alternations):

  | batch | 1 | 2 | 8 | 16 | 32 | 48 | 64 |
  |---|---|---|---|---|---|---|---|
  | transposed | 1.87-2.01 | 2.53-2.71 | 3.91 | 5.60 | 8.86 | 11.87 | 15.78 |
  | packed | 2.01-2.21 | 3.03-3.22 | 3.69 | 5.36 | 7.81 | 10.22 | 13.56 |

  At one or two rows MKL's GEMV on the plain weight wins, so a projection keeps both forms and
  :meth:`Projection.project` takes the packed one from ``PACKED_MIN_ROWS`` rows (memory: the
  packed copy is 1.15-2.2x a weight, at least MKL's ~5.8 MB buffer for a small one).

Timing each form at start-up and keeping the fastest was tried and dropped: timed in a loop
the weight sits in cache, which hides most of what packing saves in a real step (the timed
choice left half the projections plain and was 2-11% slower than packing all at 32-64 rows),
and a choice that depends on a start-up measurement makes runs differ for nothing.
Results equal ``F.linear``'s up to the last bits in every form; the parity tests check greedy
output against Hugging Face with them.

**One copy per engine.** Holding both forms doubled each engine's weight memory (with the
buffers freed at load, three copies: prefill 12.1 GB and decode 11.7 GB RSS on a 4.0 GB fp32
checkpoint). So the engine's role picks the forms: prefill's forwards have hundreds of rows, where
the forms are equal, so it keeps the transposed weight only; decode keeps the packed form alone,
for every row count. The price, from the tables here: MKL's GEMV lead at one or two rows, and
oneDNN's fp32 form outside 4-48 rows (~10% slower than the transposed weight at 64 rows on one
thread, 2026-12-05). A weight MKL would pack into several times its bytes (its buffer is at
least ~5.8 MB) stays transposed. Without a role (tools, tests) both forms stay.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu import mkl_pack, onednn_pack
from kernels.cpu.quant_linear import QuantWeight
from shared.runtime.model import Projection


def transposed_copy(weight: torch.Tensor) -> torch.Tensor:
    """The same ``[out, in]`` values over a contiguous ``[in, out]`` buffer."""
    return weight.detach().t().contiguous().t()


ROLES = (None, "prefill", "decode")
# MKL's packed buffer is at least ~5.8 MB and padded by panel: 8.7x a 576 x 576 weight, 2.2x a
# 2048 x 1024 one, 1.15x 16384 x 2048 (torch 2.13's MKL, Ice Lake, 2026-12-06). Packed only
# where it costs at most this much more.
MAX_PACKED_GROWTH = 1.25


def exact_prefill(weight: QuantWeight, head: bool) -> None:
    """A GGUF weight in the prefill engine computes exactly (up to fp32 summation order), not
    with int8 activations: a prompt's forward has hundreds of rows, where dequantizing the
    weight once and running SGEMM costs what the int8 kernel does (kernels/cpu/quant_linear.py), and
    the first token then agrees with the dequantized model wherever it is not a near-tie. The
    head serves one row per sequence: the fp32 kernel (dequantized in registers), not a 113 MB
    fp32 copy of a 135M model's vocabulary per wave."""
    if head:
        weight.small_mode, weight.small_max_rows = "f32", 1 << 62
    else:
        weight.small_max_rows = 0


def _packs_small(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return mkl_pack.packed_bytes(n, k) <= MAX_PACKED_GROWTH * weight.numel() * weight.element_size()


@torch.inference_mode()
def prepare_projections(model: nn.Module, role: str | None = None) -> int:
    """Transpose every :class:`Projection`'s weight and, where oneDNN or MKL can, pack it too;
    returns the number packed. ``role``: which forms an engine keeps (the module's docstring).
    A head tied to the embedding stays as it is (the embedding's row gather wants
    ``[vocab, hidden]``, contiguous); it is still packed. A GGUF weight kept quantized
    (:class:`QuantWeight`) computes exactly in the prefill engine (:func:`exact_prefill`) and
    is regrouped into its int8 kernel's tiles elsewhere (:meth:`QuantWeight.tile`, in place: a
    tied embedding gathers its rows from the tiles)."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: one of {ROLES}")
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
            if role == "prefill":
                exact_prefill(module.packed, head=module is head)
            else:
                module.packed.tile()
            continue
        if not isinstance(module, Projection) or module.weight.is_meta:
            continue
        weight = module.weight.detach()
        form: mkl_pack.PackedWeight | onednn_pack.OneDnnWeight | None = None
        if role == "prefill":
            pass
        elif onednn_pack.available(weight.dtype):
            form = onednn_pack.OneDnnWeight(weight)
        elif weight.dtype == torch.float32 and mkl_pack.available() and _packs_small(weight):
            form = mkl_pack.PackedWeight(weight)
        if form is not None:
            module.packed = form
            packed += 1
        if module.weight.data_ptr() in tied:
            continue
        if role == "decode" and form is not None:
            form.min_rows, form.max_rows = 1, 1 << 62  # it serves every row count alone
            module.weight = nn.Parameter(weight.new_empty(weight.shape, device="meta"))
        else:
            module.weight = nn.Parameter(transposed_copy(weight), requires_grad=False)
    return packed
