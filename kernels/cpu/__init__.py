"""The CPU path's kernels: C sources (``csrc/``) compiled once per machine (``build.py``), each
with its ctypes wrapper and torch reference; the ISA the build and the math libraries target
(``cpu_isa.py``); MKL's kernel choice and the MKL / oneDNN packed weights.

The package itself is torch-free: ``cpu_isa`` runs before torch loads.
"""
