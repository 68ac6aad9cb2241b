"""Compression schemes: the registry of cache-preserving quantizers and the built-in ones.
"""

from witcert.schemes import builtin  # noqa: F401  (the built-in schemes register themselves)
