"""The core: operation classes and their contracts, caller buffers, settings, split sizes.

Owns :class:`BasicOperation`, :class:`FusedOperation` and their per-call context, the
output-buffer rules, the thread-local settings, split-size and shape helpers, dtype rules
and the registry version counters. It imports only torch: every other subpackage builds
on it, and the few hooks a higher layer fills in (the direct-call runner, the backend
names) are installed from above.
"""
