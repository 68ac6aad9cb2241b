import WitCert.RotationRounding

/-!
# A quantized query: the logit error with a query-side radius

An attention kernel may read a quantized query `q' = q + e` (`witcert.tier_a.query_radius`)
while the keys it reads are `k̂ = k + (k̂ - k)`. The logit error is then
`q' · k̂ - q · k = q · (k̂ - k) + e · k̂`, and band Cauchy–Schwarz (Theorem 2) on each part gives
`|ε| ≤ (1/√d) (∑_b ‖q_b‖ w_b + ∑_b ‖e_b‖ ‖k̂_b‖)` for any key witness `w_b ≥ ‖(k̂ - k)_b‖`: the
key-side band bound plus a query-side term that needs no witness, only the stored key's band
norms and the query's rounding.

## Main statements

* `WitCert.inner_add_sub_inner_eq`: `(q + e) · k̂ - q · k = q · (k̂ - k) + e · k̂`, band by band.
* `WitCert.abs_logit_error_le_query_radius`: the bound above.
-/

namespace WitCert

variable {β κ : Type*} [Fintype β] [Fintype κ]

/-- The logit error of a perturbed query against perturbed keys splits into a key part and a
query part: `(q + e) · k̂ - q · k = q · (k̂ - k) + e · k̂`. -/
theorem inner_add_sub_inner_eq (q e k kh : β → κ → ℝ) :
    ∑ b, ∑ j, (q b j + e b j) * kh b j - ∑ b, ∑ j, q b j * k b j
      = ∑ b, ∑ j, q b j * (kh b - k b) j + ∑ b, ∑ j, e b j * kh b j := by
  rw [← Finset.sum_sub_distrib, ← Finset.sum_add_distrib]
  refine Finset.sum_congr rfl fun b _ => ?_
  rw [← Finset.sum_sub_distrib, ← Finset.sum_add_distrib]
  refine Finset.sum_congr rfl fun j _ => ?_
  rw [Pi.sub_apply]
  ring

/-- **Query-side radius.** With the quantized query `q + e`, keys `k̂` and a key witness
`‖(k̂ - k)_b‖ ≤ w_b`, the logit error satisfies
`|(q + e) · k̂ - q · k| / √d ≤ (∑_b ‖q_b‖ w_b + ∑_b ‖e_b‖ ‖k̂_b‖) / √d`. -/
theorem abs_logit_error_le_query_radius (q e k kh : β → κ → ℝ) (w : β → ℝ)
    (hw : ∀ b, bandNorm (kh b - k b) ≤ w b) (d : ℝ) :
    |∑ b, ∑ j, (q b j + e b j) * kh b j - ∑ b, ∑ j, q b j * k b j| / Real.sqrt d
      ≤ (∑ b, bandNorm (q b) * w b + ∑ b, bandNorm (e b) * bandNorm (kh b)) / Real.sqrt d := by
  have hq : |∑ b, ∑ j, q b j * (kh b - k b) j| ≤ ∑ b, bandNorm (q b) * w b :=
    (abs_inner_le_sum_band_norms q fun b => kh b - k b).trans
      (Finset.sum_le_sum fun b _ => mul_le_mul_of_nonneg_left (hw b) (bandNorm_nonneg (q b)))
  have he : |∑ b, ∑ j, e b j * kh b j| ≤ ∑ b, bandNorm (e b) * bandNorm (kh b) :=
    abs_inner_le_sum_band_norms e kh
  rw [inner_add_sub_inner_eq q e k kh]
  exact div_le_div_of_nonneg_right ((abs_add_le _ _).trans (add_le_add hq he))
    (Real.sqrt_nonneg d)

end WitCert
