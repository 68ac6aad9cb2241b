import Mathlib

/-!
# Theorem 3: the Tier B radius

Each token's logit error `eps t` under subtractive dither is sub-Gaussian with proxy `v t`
(Lemma 2), so both tails obey `P(± eps t ≥ u) ≤ exp (-u² / (2 v t))`. At the radius
`u t = √(2 v t log (2 S / δ))` each tail is exactly `δ / (2 S)`; a union bound over the `2 S`
tails gives `P(∃ t, |eps t| > u t) ≤ δ`: with probability at least `1 - δ`, jointly over the `S`
tokens, `|eps t| ≤ u t` (registry key `TB`). Scope: non-adaptive queries (the query must not
depend on the dither).

The tail bounds are hypotheses here: the Chernoff step from the moment generating function bound
of Lemma 2 (`WitCert.uniform_mgf_le`) to the tails is not formalized.

## Main definitions

* `WitCert.tierBRadius`: `u = √(2 v log (2 S / δ))`.

## Main statements

* `WitCert.exp_neg_sq_tierBRadius`: `exp (-u² / (2 v)) = δ / (2 S)` at the radius.
* `WitCert.tier_b_radius`: `P(∃ t, u t < |eps t|) ≤ δ`.
-/

open MeasureTheory
open scoped ENNReal

namespace WitCert

/-- The Tier B radius `u = √(2 v log (2 S / δ))` for proxy `v`, `S` tokens and budget `δ`. -/
noncomputable def tierBRadius (v S δ : ℝ) : ℝ := Real.sqrt (2 * v * Real.log (2 * S / δ))

/-- At the Tier B radius the sub-Gaussian tail `exp (-u² / (2 v))` equals `δ / (2 S)`. -/
theorem exp_neg_sq_tierBRadius {v S δ : ℝ} (hv : 0 < v) (hS : 0 < S) (hδ : 0 < δ)
    (hδS : δ ≤ 2 * S) :
    Real.exp (-(tierBRadius v S δ ^ 2) / (2 * v)) = δ / (2 * S) := by
  have hx : 0 < 2 * S / δ := div_pos (by linarith [hS]) hδ
  have hL : 0 ≤ Real.log (2 * S / δ) :=
    Real.log_nonneg ((le_div_iff₀ hδ).mpr (by linarith [hδS]))
  have h2v : 2 * v ≠ 0 := (mul_pos two_pos hv).ne'
  unfold tierBRadius
  rw [Real.sq_sqrt (mul_nonneg (mul_nonneg zero_le_two hv.le) hL), neg_div,
    mul_div_cancel_left₀ _ h2v, Real.exp_neg, Real.exp_log hx, inv_div]

/-- **Theorem 3 (Tier B radius).** If every token's logit error has sub-Gaussian tails with
proxy `v t`, then with `u t = √(2 v t log (2 S / δ))` (`S` tokens, `0 < δ ≤ 2 S`),
`P(∃ t, u t < |eps t|) ≤ δ`. -/
theorem tier_b_radius {Ω ι : Type*} [MeasurableSpace Ω] [Fintype ι] [Nonempty ι]
    (μ : Measure Ω) (eps : ι → Ω → ℝ) (v : ι → ℝ) (hv : ∀ t, 0 < v t) {δ : ℝ} (hδ : 0 < δ)
    (hδS : δ ≤ 2 * (Fintype.card ι : ℝ))
    (htail : ∀ t, ∀ u : ℝ, 0 ≤ u →
      μ {ω | u ≤ eps t ω} ≤ ENNReal.ofReal (Real.exp (-(u ^ 2) / (2 * v t))) ∧
        μ {ω | u ≤ -eps t ω} ≤ ENNReal.ofReal (Real.exp (-(u ^ 2) / (2 * v t)))) :
    μ {ω | ∃ t, tierBRadius (v t) (Fintype.card ι : ℝ) δ < |eps t ω|} ≤ ENNReal.ofReal δ := by
  have hS : (0 : ℝ) < (Fintype.card ι : ℝ) := Nat.cast_pos.mpr Fintype.card_pos
  have hq : 0 ≤ δ / (2 * (Fintype.card ι : ℝ)) := div_nonneg hδ.le (by linarith [hS])
  have hbound : ∀ t, μ {ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ eps t ω}
        + μ {ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ -eps t ω}
      ≤ ENNReal.ofReal (δ / (2 * (Fintype.card ι : ℝ)))
        + ENNReal.ofReal (δ / (2 * (Fintype.card ι : ℝ))) := by
    intro t
    have h := htail t (tierBRadius (v t) (Fintype.card ι : ℝ) δ) (Real.sqrt_nonneg _)
    rw [exp_neg_sq_tierBRadius (hv t) hS hδ hδS] at h
    exact add_le_add h.1 h.2
  have hsub : {ω | ∃ t, tierBRadius (v t) (Fintype.card ι : ℝ) δ < |eps t ω|}
      ⊆ ⋃ t, ({ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ eps t ω}
        ∪ {ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ -eps t ω}) := by
    intro ω hω
    obtain ⟨t, ht⟩ := hω
    refine Set.mem_iUnion.mpr ⟨t, ?_⟩
    rcases lt_abs.mp ht with h | h
    · exact Or.inl h.le
    · exact Or.inr h.le
  have h2S : 2 * (Fintype.card ι : ℝ) ≠ 0 := (mul_pos two_pos hS).ne'
  calc μ {ω | ∃ t, tierBRadius (v t) (Fintype.card ι : ℝ) δ < |eps t ω|}
      ≤ μ (⋃ t, ({ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ eps t ω}
          ∪ {ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ -eps t ω})) := measure_mono hsub
    _ ≤ ∑ t, μ ({ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ eps t ω}
          ∪ {ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ -eps t ω}) :=
        measure_iUnion_fintype_le μ _
    _ ≤ ∑ t, (μ {ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ eps t ω}
          + μ {ω | tierBRadius (v t) (Fintype.card ι : ℝ) δ ≤ -eps t ω}) :=
        Finset.sum_le_sum fun _ _ => measure_union_le (μ := μ) _ _
    _ ≤ ∑ _t : ι, (ENNReal.ofReal (δ / (2 * (Fintype.card ι : ℝ)))
          + ENNReal.ofReal (δ / (2 * (Fintype.card ι : ℝ)))) :=
        Finset.sum_le_sum fun t _ => hbound t
    _ = ENNReal.ofReal δ := by
        rw [← ENNReal.ofReal_add hq hq,
          ← ENNReal.ofReal_sum_of_nonneg fun _ _ => add_nonneg hq hq,
          Finset.sum_const, Finset.card_univ, nsmul_eq_mul]
        congr 1
        calc (Fintype.card ι : ℝ)
              * (δ / (2 * (Fintype.card ι : ℝ)) + δ / (2 * (Fintype.card ι : ℝ)))
            = 2 * (Fintype.card ι : ℝ) * (δ / (2 * (Fintype.card ι : ℝ))) := by ring
          _ = δ := mul_div_cancel₀ δ h2S

end WitCert
