"""Fast meter path: one fused fp64 pass with an a-priori rounding budget, compiled where possible.

- :mod:`witcert.fastpath.budgeted_pass`: the fused pass (moments, meter, risk, value term) and its
  rounding budget;
- :mod:`witcert.fastpath.compiled`: ``torch.compile`` of that pass, with the eager pass as the
  fallback where compilation is unavailable;
- :mod:`witcert.fastpath.fused`: the entry points :func:`~witcert.fastpath.fused.lean_cells` and
  :func:`~witcert.fastpath.fused.fast_meter`.

The eager reference (:mod:`witcert.core`) stays the definition and the oracle; this path computes
a subset of its minimum (``T1``, ``P1``, ``MN``) and is never below the exact value (registry key ``FP``).
"""
