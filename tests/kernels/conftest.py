"""Without CUDA, run the Triton kernels in Triton's CPU interpreter.

This must happen before any kernel module is imported: triton.jit decides at decoration time
whether a kernel is compiled or interpreted. The kernels package imports its modules lazily,
so setting the variable here, when pytest loads this conftest, is early enough.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
