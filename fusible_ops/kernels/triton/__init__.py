"""The Triton backend for CUDA: grouped GEMM and fused activation kernels, and their launchers.

``triton`` is optional and imported only when this backend is first asked for. Built on
the shared kernel code (``fusible_ops.kernels``); imports nothing above ``kernels``.
"""
