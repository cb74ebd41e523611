"""Without CUDA, run the Triton kernels in Triton's CPU interpreter.

This must happen before any kernel module is imported: triton.jit decides at decoration time
whether a kernel is compiled or interpreted. It lives in the top-level conftest, which pytest
loads before any test module: a module that builds a tiny model at import (transformers then
probes for a package named ``kernels`` and finds ours) would otherwise decorate the kernels
first — which is what a clean clone, with no model built yet, did.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
