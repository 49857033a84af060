"""Triton kernels (sm_90a).  Pure kernel modules: ``@triton.jit`` functions and the launch
wrappers' grid / block arithmetic; no torch dispatch logic (that lives in ``torch_dplr.ops``).

Every kernel also runs under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, so
the CPU tests check the kernels' logic against the PyTorch kernels; ``_common.dot`` works
around the interpreter's bf16 products.
"""
