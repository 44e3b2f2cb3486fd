"""The CPU backend: grouped GEMMs and the fused grouped MLP with ATen CPU ops, a buffer pool.

Built on the shared kernel code (``fusible_ops.kernels``: base classes, activation math)
and the pure-PyTorch backends in ``kernels.pytorch``; imports nothing above ``kernels``.
"""
