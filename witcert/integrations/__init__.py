"""Integrations with the runtimes people serve with (transformers, vLLM).
"""
