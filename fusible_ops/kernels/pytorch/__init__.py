"""Backends written with plain PyTorch ops on any device: ``torch._grouped_mm`` and a per-group loop.

Built on the shared kernel code (``fusible_ops.kernels``); imports nothing above ``kernels``.
"""
