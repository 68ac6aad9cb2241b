import Mathlib.Analysis.Real.Sqrt
import Mathlib.Analysis.SpecialFunctions.Trigonometric.Basic
import Mathlib.Tactic.Linarith
import Mathlib.Tactic.LinearCombination

/-!
# Tier A: band norms under RoPE (Lemma 1) and the band Cauchy–Schwarz witness (Theorem 2)

RoPE acts on each frequency pair by a 2×2 rotation. A band holds whole pairs, so a rotation acting
within each pair preserves every band norm (Lemma 1, registry key `L1`): the witness of a
post-RoPE residual equals the pre-RoPE one and does not depend on the query position. Which
coordinates form a pair (`rotate_half` or interleaved) is abstracted away: pairs are indexed by
`π`, their two coordinates are `x j` and `y j`.

For the witness, coordinates are indexed by (band, position in band); Cauchy–Schwarz per band gives
`|q · r| ≤ ∑_b ‖q_b‖ ‖r_b‖` (Theorem 2, registry key `T2`), so any stored `w_b ≥ ‖r_b‖` bounds the
logit error.

## Main definitions

* `WitCert.pairBandNorm`: `√(∑_j (x j² + y j²))`, the norm of a band of pairs.
* `WitCert.rotX`, `WitCert.rotY`: the pairwise rotation by angles `θ j`.
* `WitCert.bandNorm`: `√(∑_k v k²)`.

## Main statements

* `WitCert.band_norm_rotate` (`L1`).
* `WitCert.abs_inner_le_sum_band_norms` (`T2`).
* `WitCert.abs_inner_div_sqrt_le_witness`: `|q · r| / √d ≤ (∑_b ‖q_b‖ w_b) / √d` when `‖r_b‖ ≤ w_b`.
-/

noncomputable section

namespace WitCert

section Rotation

variable {P : Type*} [Fintype P]

/-- The norm of a band made of pairs `(x j, y j)`. -/
def pairBandNorm (x y : P → ℝ) : ℝ := Real.sqrt (∑ j, (x j ^ 2 + y j ^ 2))

/-- First coordinate of each pair after rotating pair `j` by the angle `θ j`. -/
def rotX (θ x y : P → ℝ) (j : P) : ℝ := Real.cos (θ j) * x j - Real.sin (θ j) * y j

/-- Second coordinate of each pair after rotating pair `j` by the angle `θ j`. -/
def rotY (θ x y : P → ℝ) (j : P) : ℝ := Real.sin (θ j) * x j + Real.cos (θ j) * y j

/-- **Lemma 1 (RoPE band invariance).** Rotating every pair of a band by any angles leaves the
band norm unchanged. -/
theorem band_norm_rotate (θ x y : P → ℝ) :
    pairBandNorm (rotX θ x y) (rotY θ x y) = pairBandNorm x y := by
  unfold pairBandNorm rotX rotY
  congr 1
  refine Finset.sum_congr rfl fun j _ => ?_
  linear_combination (x j ^ 2 + y j ^ 2) * Real.sin_sq_add_cos_sq (θ j)

end Rotation

section Witness

variable {β κ : Type*} [Fintype β] [Fintype κ]

/-- The Euclidean norm of one band `v : κ → ℝ`. -/
def bandNorm (v : κ → ℝ) : ℝ := Real.sqrt (∑ k, v k ^ 2)

/-- Cauchy–Schwarz within one band: `|∑_k q_k r_k| ≤ ‖q‖ ‖r‖`. -/
theorem abs_sum_mul_le_bandNorm_mul (q r : κ → ℝ) :
    |∑ k, q k * r k| ≤ bandNorm q * bandNorm r := by
  unfold bandNorm
  rw [abs_le]
  constructor
  · have h := Real.sum_mul_le_sqrt_mul_sqrt Finset.univ (fun k => -q k) r
    simp only [neg_mul, Finset.sum_neg_distrib, neg_sq] at h
    linarith [h]
  · exact Real.sum_mul_le_sqrt_mul_sqrt Finset.univ q r

/-- **Theorem 2 (band Cauchy–Schwarz).** `|q · r| ≤ ∑_b ‖q_b‖ ‖r_b‖`. -/
theorem abs_inner_le_sum_band_norms (q r : β → κ → ℝ) :
    |∑ b, ∑ k, q b k * r b k| ≤ ∑ b, bandNorm (q b) * bandNorm (r b) :=
  calc |∑ b, ∑ k, q b k * r b k| ≤ ∑ b, |∑ k, q b k * r b k| :=
        Finset.abs_sum_le_sum_abs _ _
    _ ≤ ∑ b, bandNorm (q b) * bandNorm (r b) :=
        Finset.sum_le_sum fun b _ => abs_sum_mul_le_bandNorm_mul (q b) (r b)

/-- The Tier A witness bounds the logit error: with `‖r_b‖ ≤ w_b` for every band,
`|q · r| / √d ≤ (∑_b ‖q_b‖ w_b) / √d`. -/
theorem abs_inner_div_sqrt_le_witness (q r : β → κ → ℝ) (w : β → ℝ)
    (hw : ∀ b, bandNorm (r b) ≤ w b) (d : ℝ) :
    |∑ b, ∑ k, q b k * r b k| / Real.sqrt d ≤ (∑ b, bandNorm (q b) * w b) / Real.sqrt d := by
  have h1 : ∑ b, bandNorm (q b) * bandNorm (r b) ≤ ∑ b, bandNorm (q b) * w b :=
    Finset.sum_le_sum fun b _ => mul_le_mul_of_nonneg_left (hw b) (Real.sqrt_nonneg _)
  exact div_le_div_of_nonneg_right ((abs_inner_le_sum_band_norms q r).trans h1)
    (Real.sqrt_nonneg d)

end Witness

end WitCert

end
