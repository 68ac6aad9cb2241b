"""Tier B: the subtractively dithered INT8 cache and its probabilistic certificate (Lemmas 2-3, Theorem 3).
"""
