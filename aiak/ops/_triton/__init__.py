"""Triton kernels (imported only when a CUDA/interpreter Triton path is used)."""
