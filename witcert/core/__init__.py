"""The meter core: TV bounds from per-token logit-error radii, their rounding enclosures and input checks.

Every quantity here takes compressed logits and radii ``c_t >= |eps_t|``; where the radii come from is
Tier A (:mod:`witcert.tier_a`) or Tier B (:mod:`witcert.tier_b.certificate`).
"""
