"""Tier A: the band-norm residual witness, for any cache-preserving quantizer (Lemma 1, Theorem 2).
"""
