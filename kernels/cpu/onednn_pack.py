"""oneDNN's prepacked linear for CPU projections (fp32 and bf16): a weight reordered once, at
start-up, into the blocked layout of oneDNN's kernel (AMX tiles for bf16 where the CPU has them).

These are the ops torch inductor's weight freezing emits (``mkldnn._reorder_linear_weight`` then
``mkldnn._linear_pointwise``). Which form wins at which row count is measured, on whole decode
steps of a real-size shape (docs/perf-log.md, "oneDNN prepacked projections"): at prefill's
row counts every form ties; at decode's the prepacked form wins for bf16 at every row count and
for fp32 from 4 to 48 rows (MKL's GEMV on the transposed weight wins at 1-3 rows, and from 64
rows on one thread the transposed weight wins while two threads still favour oneDNN: the lower
edge of the crossover is kept). So bf16 takes the oneDNN form at every row count, fp32 from 4
to 48 rows. Results
equal ``F.linear``'s up to the last bits (another kernel sums in another order); the fp32 parity
tests check greedy output against Hugging Face with it.
"""

from __future__ import annotations

import functools

import torch

# Row counts each dtype's packed form serves (above); outside them F.linear does.
ROWS = {torch.float32: (4, 48), torch.bfloat16: (1, 1 << 62)}
BATCH_HINT = 16  # the row count the reorder is told to expect; the layout it picks fits all rows


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
