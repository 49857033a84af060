"""Loaded before any test module: without a GPU, Triton's kernels (``csrc_triton``) run under
its interpreter on CPU tensors (tests/test_triton_interpret.py).  The variable must be set
before Triton is first imported: Triton's own library functions are made interpreted or
compiled then."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
