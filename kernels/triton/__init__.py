"""Triton kernels for the GPU path, one module per op with its torch reference beside it
(``*_ref``); reached through ``kernels.<entry point>`` (kernels/__init__.py)."""
