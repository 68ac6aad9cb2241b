"""Adversarial verification: the sup-box adversary, ``witcert fuzz`` and its attack classes.
"""
