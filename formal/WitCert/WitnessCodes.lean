import WitCert.EForm
import WitCert.RotationRounding

/-!
# Witness codes rounded up keep the meter an upper bound

Tier A stores each band norm of a key's residual `r_t = k̂_t - k_t` as a short code (8 bits,
rounded up), so the value the meter reads, `w' t b`, is at least the exact bound
`w t b ≥ ‖r_{t,b}‖`. The band bound `c_t = (1/√d) ∑_b ‖q_b‖ w_{t,b}` (Theorem 2) is monotone in
each `w_{t,b}` (the weights `‖q_b‖` are nonnegative), and T1's meter `1/2 (A² - 1)`,
`A = ∑_t p̃_t exp (c_t)`, is monotone in each `c_t`. So any stored `w' ≥ w` gives radii
`c' ≥ c ≥ |eps|` and a meter at least the one with exact norms, itself at least the total
variation: rounding codes up never breaks the certificate, rounding down may.

## Main statements

* `WitCert.bandBound_mono`: `(∑_b ‖q_b‖ w_b) / √d ≤ (∑_b ‖q_b‖ w'_b) / √d` when `w ≤ w'`.
* `WitCert.massExp_mono`: `A(c) ≤ A(c')` when `c ≤ c'`.
* `WitCert.eform_meter_mono`: `1/2 (A(c)² - 1) ≤ 1/2 (A(c')² - 1)` when `c ≤ c'`.
* `WitCert.tv_le_eform_of_rounded_witness`: the e-form meter computed from stored codes
  `w' ≥ w ≥ ‖r_{t,b}‖` bounds `TV(p, p̃)`.
-/

namespace WitCert

/-- **The band bound is monotone in the witness.** `w b ≤ w' b` for every band gives
`(∑_b ‖q_b‖ w_b) / √d ≤ (∑_b ‖q_b‖ w'_b) / √d`. -/
theorem bandBound_mono {β κ : Type*} [Fintype β] [Fintype κ] (q : β → κ → ℝ) {w w' : β → ℝ}
    (hw : ∀ b, w b ≤ w' b) (d : ℝ) :
    (∑ b, bandNorm (q b) * w b) / Real.sqrt d ≤ (∑ b, bandNorm (q b) * w' b) / Real.sqrt d :=
  div_le_div_of_nonneg_right
    (Finset.sum_le_sum fun b _ => mul_le_mul_of_nonneg_left (hw b) (bandNorm_nonneg (q b)))
    (Real.sqrt_nonneg d)

variable {ι : Type*} [Fintype ι] {pt : ι → ℝ}

/-- **The e-form mass is monotone in the radii.** `c t ≤ c' t` for every token gives
`∑ p̃ exp c ≤ ∑ p̃ exp c'` (`p̃ ≥ 0`). -/
theorem massExp_mono (hp : ∀ t, 0 ≤ pt t) {c c' : ι → ℝ} (hc : ∀ t, c t ≤ c' t) :
    massExp pt c ≤ massExp pt c' :=
  sum_mul_le_sum_mul hp fun t => Real.exp_le_exp.mpr (hc t)

/-- The e-form mass is nonnegative. -/
theorem massExp_nonneg (hp : ∀ t, 0 ≤ pt t) (c : ι → ℝ) : 0 ≤ massExp pt c :=
  Finset.sum_nonneg fun t _ => mul_nonneg (hp t) (Real.exp_pos (c t)).le

/-- **T1's meter is monotone in the radii.** `c ≤ c'` gives
`1/2 (A(c)² - 1) ≤ 1/2 (A(c')² - 1)`: `A(c') ≥ A(c) ≥ 0` and squaring is monotone there. -/
theorem eform_meter_mono (hp : ∀ t, 0 ≤ pt t) {c c' : ι → ℝ} (hc : ∀ t, c t ≤ c' t) :
    1 / 2 * (massExp pt c ^ 2 - 1) ≤ 1 / 2 * (massExp pt c' ^ 2 - 1) := by
  have hA : massExp pt c ≤ massExp pt c' := massExp_mono hp hc
  have hprod : 0 ≤ (massExp pt c' - massExp pt c) * (massExp pt c' + massExp pt c) :=
    mul_nonneg (sub_nonneg.mpr hA) (add_nonneg (massExp_nonneg hp c') (massExp_nonneg hp c))
  have hdiff : massExp pt c' ^ 2 - massExp pt c ^ 2
      = (massExp pt c' - massExp pt c) * (massExp pt c' + massExp pt c) := by ring
  have hsq : massExp pt c ^ 2 ≤ massExp pt c' ^ 2 := by
    rw [← sub_nonneg, hdiff]
    exact hprod
  exact mul_le_mul_of_nonneg_left (sub_le_sub_right hsq 1) (div_nonneg zero_le_one zero_le_two)

/-- **Rounded-up witness codes keep T1 sound.** Let the logit error of token `t` be
`eps t = (∑_b ∑_k q_{b,k} r_{t,b,k}) / √d` (the residual `r_t = k̂_t - k_t` of its key), with
`‖r_{t,b}‖ ≤ w t b` and stored codes `w t b ≤ w' t b`. Then the e-form meter with the stored
radii `c'_t = (∑_b ‖q_b‖ w'_{t,b}) / √d` bounds `TV(p, p̃)`. -/
theorem tv_le_eform_of_rounded_witness {β κ : Type*} [Fintype β] [Fintype κ]
    (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1) (q : β → κ → ℝ) (r : ι → β → κ → ℝ)
    {w w' : ι → β → ℝ} (hw : ∀ t b, bandNorm (r t b) ≤ w t b) (hround : ∀ t b, w t b ≤ w' t b)
    (d : ℝ) :
    tv (reweight pt fun t => (∑ b, ∑ k, q b k * r t b k) / Real.sqrt d) pt
      ≤ 1 / 2 * (massExp pt (fun t => (∑ b, bandNorm (q b) * w' t b) / Real.sqrt d) ^ 2 - 1) := by
  refine tv_le_eform hp hsum fun t => ?_
  show |(∑ b, ∑ k, q b k * r t b k) / Real.sqrt d| ≤ (∑ b, bandNorm (q b) * w' t b) / Real.sqrt d
  rw [abs_div, abs_of_nonneg (Real.sqrt_nonneg d)]
  exact abs_inner_div_sqrt_le_witness q (r t) (w' t) (fun b => (hw t b).trans (hround t b)) d

end WitCert
