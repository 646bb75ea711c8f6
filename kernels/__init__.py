"""Triton kernels, installed as `vllm_tree_spec.kernels`.

Each kernel module holds `@triton.jit` code only; typed launchers whose
docstrings state the math live beside them, and every kernel has a PyTorch
twin it is tested against. Triton is optional: importing this package does not
import Triton.
"""
