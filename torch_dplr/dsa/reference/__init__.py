"""Plain-PyTorch DSA kernels: the CPU kernels, the fallback on CUDA, the oracle for GPU kernels.

Each function computes one op in blocks of queries (the ``[T, T]`` score matrix is never
held), accumulates in fp32 (fp64 for fp64 inputs) and writes into caller-allocated outputs.
"""
