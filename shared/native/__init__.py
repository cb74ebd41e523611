"""Native code outside torch: building C libraries of shared/runtime/csrc, MKL's kernel choice.

Torch-free (it runs before torch loads).
"""
