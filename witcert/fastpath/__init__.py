"""Fast meter path: fp32 passes with a-priori rounding budgets, compiled where possible.

- :mod:`witcert.fastpath.budgeted_pass`: the fused meter pass (moments in fp32, sums in fp64; meter
  ``min(1, T1, P1, MN, CS, MS)``, MS on four low sets of its own; risk and value term) and its rounding budget;
- :mod:`witcert.fastpath.radius`: the Tier A radius as one fp32 band dot over the fp16 witness;
- :mod:`witcert.fastpath.tier_b_radius`: the Tier B bound as two fp32 group dots over the fp16 scales
  (the monitor's Tier B tightening, every written chunk in one pass);
- :mod:`witcert.fastpath.stored_pass`: one function per layer and step from what a compressed cache
  stores (logits, radius, score rounding, the fused meter, the output bound) -- the monitor's path;
- :mod:`witcert.fastpath.compiled`: ``torch.compile`` of these pure functions (``WITCERT_COMPILE=1``),
  with the eager function as the fallback where compilation is unavailable or fails;
- :mod:`witcert.fastpath.fused`: the entry points :func:`~witcert.fastpath.fused.lean_cells`,
  :func:`~witcert.fastpath.fused.tier_a_cells` and :func:`~witcert.fastpath.fused.tier_b_cells` (whole cells:
  the per-token bound and the meter pass) and :func:`~witcert.fastpath.fused.fast_meter`.

The eager reference (:mod:`witcert.core`) stays the definition and the oracle; this path computes
a subset of its minimum and is never below the exact value (registry key ``FP``).
"""
