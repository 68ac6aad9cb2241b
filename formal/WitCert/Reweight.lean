import WitCert.Defs
import Mathlib.Algebra.BigOperators.Field
import Mathlib.Tactic.Linarith
import Mathlib.Tactic.LinearCombination
import Mathlib.Tactic.Ring

/-!
# General facts about the reweighted distribution

Sum manipulations and the reduction of total variation to the pointwise quantity
`|exp (-eps t) - Z|`, shared by the e-form (T1), two-sided (P1) and max-norm bounds.

## Main statements

* `WitCert.tv_reweight_eq`: `TV(p, p̃) = (∑ t, p̃ t * |exp (-eps t) - Z|) / (2 Z)`.
* `WitCert.tv_reweight_le_of_abs_sub_le`: a pointwise bound `|exp (-eps t) - Z| ≤ g t * Z` gives
  `TV(p, p̃) ≤ 1/2 * ∑ t, p̃ t * g t`.
-/

namespace WitCert

variable {ι : Type*} [Fintype ι] {pt eps c : ι → ℝ}

/-- Weighted sums are monotone in the summand for nonnegative weights. -/
theorem sum_mul_le_sum_mul {f g : ι → ℝ} (hp : ∀ t, 0 ≤ pt t) (h : ∀ t, f t ≤ g t) :
    ∑ t, pt t * f t ≤ ∑ t, pt t * g t :=
  Finset.sum_le_sum fun t _ => mul_le_mul_of_nonneg_left (h t) (hp t)

/-- A probability vector averages a constant to itself. -/
theorem sum_mul_const (hsum : ∑ t, pt t = 1) (m : ℝ) : ∑ t, pt t * m = m := by
  rw [← Finset.sum_mul, hsum, one_mul]

/-- Expectation of an affine function: `∑ p̃ (α + β w) = α ∑ p̃ + β ∑ p̃ w`. -/
theorem sum_mul_affine (pt w : ι → ℝ) (α β : ℝ) :
    ∑ t, pt t * (α + β * w t) = α * ∑ t, pt t + β * ∑ t, pt t * w t := by
  rw [Finset.mul_sum, Finset.mul_sum, ← Finset.sum_add_distrib]
  exact Finset.sum_congr rfl fun t _ => by ring

/-- `|eps| ≤ c` gives `exp (-eps) ≤ exp c`. -/
theorem exp_neg_le_exp_of_abs_le {e b : ℝ} (h : |e| ≤ b) : Real.exp (-e) ≤ Real.exp b :=
  Real.exp_le_exp.mpr (by linarith [(abs_le.mp h).1])

/-- `|eps| ≤ c` gives `exp (-c) ≤ exp (-eps)`. -/
theorem exp_neg_le_exp_neg_of_abs_le {e b : ℝ} (h : |e| ≤ b) : Real.exp (-b) ≤ Real.exp (-e) :=
  Real.exp_le_exp.mpr (by linarith [(abs_le.mp h).2])

omit [Fintype ι] in
/-- A bound on `|eps t|` is nonnegative. -/
theorem nonneg_of_abs_le (heps : ∀ t, |eps t| ≤ c t) (t : ι) : 0 ≤ c t :=
  (abs_nonneg (eps t)).trans (heps t)

/-- Pointwise: `|p t - p̃ t| = p̃ t * |exp (-eps t) - Z| / Z`. -/
theorem abs_reweight_sub (t : ι) (hp : 0 ≤ pt t) (hZ : 0 < partition pt eps) :
    |reweight pt eps t - pt t|
      = pt t * |Real.exp (-eps t) - partition pt eps| / partition pt eps := by
  have hZinv : partition pt eps * (partition pt eps)⁻¹ = 1 := mul_inv_cancel₀ hZ.ne'
  have h : reweight pt eps t - pt t
      = pt t * (Real.exp (-eps t) - partition pt eps) / partition pt eps := by
    unfold reweight
    linear_combination (pt t) * hZinv
  rw [h, abs_div, abs_mul, abs_of_nonneg hp, abs_of_pos hZ]

/-- Total variation of the reweighting: `TV(p, p̃) = (∑ t, p̃ t * |exp (-eps t) - Z|) / (2 Z)`. -/
theorem tv_reweight_eq (hp : ∀ t, 0 ≤ pt t) (hZ : 0 < partition pt eps) :
    tv (reweight pt eps) pt
      = (∑ t, pt t * |Real.exp (-eps t) - partition pt eps|) / (2 * partition pt eps) := by
  have h : ∑ t, |reweight pt eps t - pt t|
      = ∑ t, pt t * |Real.exp (-eps t) - partition pt eps| / partition pt eps :=
    Finset.sum_congr rfl fun t _ => abs_reweight_sub t (hp t) hZ
  unfold tv
  rw [h, ← Finset.sum_div]
  ring

/-- A pointwise bound `|exp (-eps t) - Z| ≤ g t * Z` gives `TV(p, p̃) ≤ 1/2 * ∑ t, p̃ t * g t`. -/
theorem tv_reweight_le_of_abs_sub_le (hp : ∀ t, 0 ≤ pt t) (hZ : 0 < partition pt eps)
    {g : ι → ℝ}
    (h : ∀ t, |Real.exp (-eps t) - partition pt eps| ≤ g t * partition pt eps) :
    tv (reweight pt eps) pt ≤ 1 / 2 * ∑ t, pt t * g t := by
  have hS : ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|
      ≤ ∑ t, pt t * (g t * partition pt eps) := sum_mul_le_sum_mul hp h
  have hS' : ∑ t, pt t * (g t * partition pt eps)
      = (∑ t, pt t * g t) * partition pt eps := by
    rw [Finset.sum_mul]
    exact Finset.sum_congr rfl fun t _ => by ring
  rw [tv_reweight_eq hp hZ, div_le_iff₀ (mul_pos two_pos hZ)]
  calc ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|
      ≤ ∑ t, pt t * (g t * partition pt eps) := hS
    _ = (∑ t, pt t * g t) * partition pt eps := hS'
    _ = 1 / 2 * (∑ t, pt t * g t) * (2 * partition pt eps) := by ring

end WitCert
