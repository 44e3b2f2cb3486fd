"""The cuDNN frontend backend (Hopper/Blackwell grouped GEMMs): probe, adapter, backend.

``nvidia-cudnn-frontend`` is optional and imported only when this backend is first asked
for. Built on the shared kernel code (``fusible_ops.kernels``) and ``kernels.pytorch``;
imports nothing above ``kernels``.
"""
