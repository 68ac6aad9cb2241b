"""Executable specification: pure Python + mpmath mirrors of every theorem (no torch)."""
