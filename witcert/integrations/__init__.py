"""Integrations with the runtimes people serve with: transformers (``hf``) and vLLM (``vllm``).

Each is optional: it imports its runtime only when used, and the core library never imports it.
"""
