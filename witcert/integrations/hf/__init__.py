"""transformers integration: the ``"witcert"`` attention implementation, compressed cache twins, per-cell measurement.
"""
