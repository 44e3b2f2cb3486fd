"""Implementations of the ``python -m fusible_ops`` commands."""
