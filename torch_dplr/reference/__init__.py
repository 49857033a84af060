"""Plain-PyTorch stages: the CPU kernels, the oracle for GPU kernels, the fallback path."""
