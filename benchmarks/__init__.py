"""WitCert benchmarks: ``python -m benchmarks.run`` (``make bench``) writes ``benchmarks/results/``."""
