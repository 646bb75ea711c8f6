"""Kernel tests run natively on a CUDA GPU, else on CPU under Triton's interpreter.

TRITON_INTERPRET must be set before any `@triton.jit` function is defined
(Triton reads it at decoration time), so it is set here, when pytest collects
this directory and before the test modules import the kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
