"""Implementations of the ``python -m fusible_ops`` commands: demo, bench, info.

The top layer: it may import every subpackage; nothing in the library imports it.
"""
