"""oneDNN's prepacked linear for CPU projections (fp32 and bf16): a weight reordered once, at
start-up, into the blocked layout of oneDNN's kernel (AMX tiles for bf16 where the CPU has them).

These are the ops torch inductor's weight freezing emits (``mkldnn._reorder_linear_weight`` then
``mkldnn._linear_pointwise``). Measured on a 2-core Xeon with AMX (2026-12-05), the four
projections of all 24 layers of the qwen2-0.5b bench shape, weights cold, ms per decode step
(``F.linear`` on the plain or transposed weight; MKL packed; oneDNN packed):

| ms per step (rows) | 1 | 4 | 8 | 16 | 32 | 48 | 64 |
|---|---|---|---|---|---|---|---|
| bf16 1T plain / T | 72 / 110 | 76 / 104 | | 78 / 100 | | | 115 / 125 |
| bf16 1T oneDNN | **51** | **57** | | **58** | | | **86** |
| bf16 2T plain / oneDNN | 46 / **31** | | | 44 / **32** | | | 68 / **45** |
| fp32 1T T / MKL | **88**/93 | 165/175 | 202/216 | 250/260 | 292/307 | 332/302 | **292**/304 |
| fp32 1T oneDNN | 100 | **105** | **121** | **161** | **233** | **286** | 346 |
| fp32 2T T / MKL | | 82 / 97 | | 113 / 121 | | | 206 / 214 |
| fp32 2T oneDNN | | **55** | | **85** | | | **175** |

T: the transposed weight. At 2,048 rows (prefill; per layer, one thread) all forms tie: bf16
plain 78, transposed 69, oneDNN 70 ms; fp32 379-385 ms.

So bf16 takes the oneDNN form at every row count, fp32 from 4 to 48 rows (MKL's GEMV on the
transposed weight wins at 1-3 rows, and at 64 rows one thread the transposed weight wins while
two threads still favour oneDNN: the crossover sits near 48-64, the lower edge kept). Results
equal ``F.linear``'s up to the last bits (another kernel sums in another order); the fp32 parity
tests check greedy output against Hugging Face with it.
"""

from __future__ import annotations

import functools

import torch

# Row counts each dtype's packed form serves (the table above); outside them F.linear does.
ROWS = {torch.float32: (4, 48), torch.bfloat16: (1, 1 << 62)}
BATCH_HINT = 16  # the row count the reorder is told to expect; the layout fits all (measured)


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """oneDNN is in this torch build and runs ``dtype`` natively on this CPU (bf16 needs
    avx512_bf16 or AMX: emulated bf16 would be slower than the plain path)."""
    if dtype not in ROWS or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:  # the ops are torch internals: check they exist and run in this build
        w = torch.ones(8, 8, dtype=dtype)
        out = OneDnnWeight(w).linear(torch.ones(4, 8, dtype=dtype))
        return bool((out == 8).all())
    except (RuntimeError, AttributeError):
        return False


class OneDnnWeight:
    """A ``[out, in]`` weight in oneDNN's packed layout; :meth:`linear` is
    ``F.linear(x, weight, bias)`` for 2-D ``x`` of ``min_rows..max_rows`` rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.dtype not in ROWS or weight.device.type != "cpu":
            raise ValueError(f"a 2-D fp32/bf16 CPU weight is required, got {weight.dtype}")
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self.min_rows, self.max_rows = ROWS[weight.dtype]
        # oneDNN's blocked layout holds the same elements (its tensor is opaque: no storage size).
        self.nbytes = weight.numel() * weight.element_size()
        self._weight = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), BATCH_HINT
        )
        self._linear = torch.ops.mkldnn._linear_pointwise

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != self.dtype:
            raise ValueError(f"x must be [rows, {self.in_features}] {self.dtype}, got {x.shape}")
        return self._linear(x.contiguous(), self._weight, bias, "none", [], "")
