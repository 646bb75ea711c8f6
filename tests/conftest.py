"""Suite-wide settings, applied before any test module imports vLLM or Triton.

Without a CUDA device, Triton kernels run in Triton's interpreter. Triton
caches the TRITON_INTERPRET knob the first time it is read (importing vLLM
already reads it), so it must be set here, at the root, before collection.
vLLM's CPU build still disables its own Triton use with the interpreter on.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
