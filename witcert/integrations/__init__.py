"""Integrations of the WitCert meter into serving engines (``witcert.integrations.vllm``).

Each integration is an optional plugin: it imports its engine only when enabled, and the core
library never imports it.
"""
