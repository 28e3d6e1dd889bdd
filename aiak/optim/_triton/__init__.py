"""The layer-wise optimizers' Triton kernels and their launchers; imported only where the Triton path runs (CUDA
parameters, or CPU ones under ``TRITON_INTERPRET=1`` in the tests)."""
