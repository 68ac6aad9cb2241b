"""Gating and repair: fire on cells whose meter exceeds tau, page exact blocks in from a verified backing store.
"""
