import WitCert.TwoSided
import Mathlib.Analysis.Real.Sqrt

/-!
# The chi-square (variance) bound

With `A⁻ = ∑ t, p̃ t * exp (-c t)` and `|eps t| ≤ c t` for every token, the exact distribution
`p = p̃ * exp (-eps) / Z` satisfies
`TV(p, p̃) ≤ √(∑ t, p̃ t * (exp (c t) - 1)²) / (2 A⁻)` (registry key `CS`).

Proof (paper sketch). Write `w t = exp (-eps t)`, so `Z = E_p̃ w` and
`TV = E_p̃ |w - Z| / (2 Z)` (`WitCert.tv_reweight_eq`).

1. Cauchy–Schwarz under `p̃`: with `m = E_p̃ |w - Z|`,
   `0 ≤ E_p̃ (|w - Z| - m)² = E_p̃ (w - Z)² - m²`, so `m ≤ √(E_p̃ (w - Z)²)`.
2. Centering lowers the second moment: `E_p̃ (w - 1)² = E_p̃ (w - Z)² + (Z - 1)²`.
3. Pointwise `|exp (-eps) - 1| ≤ exp c - 1`: from above `exp (-eps) ≤ exp c`; from below
   `1 - exp (-eps) ≤ 1 - exp (-c) ≤ c ≤ exp c - 1` (twice `x + 1 ≤ exp x`).
4. `Z ≥ A⁻` (`WitCert.massExpNeg_le_partition`).

Hence `TV ≤ √(E_p̃ (exp c - 1)²) / (2 A⁻)`. To first order this is `1/2 √(E_p̃ c²)`: equal to the
first order of `tanh (c / 2)` when every `c t` is the same, and far below `tanh (max c / 2)` when
the large radii sit on tokens of little mass. Every step is a finite sum over `ι`; the only
Cauchy–Schwarz used is the elementary expansion of step 1.

## Main statements

* `WitCert.sum_mul_sub_sq`: `∑ p̃ (g - k)² = ∑ p̃ g² - 2 k ∑ p̃ g + k²`.
* `WitCert.sq_sum_mul_le_sum_mul_sq`: `(∑ p̃ y)² ≤ ∑ p̃ y²` (weighted Cauchy–Schwarz).
* `WitCert.sum_mul_sub_mean_sq_le`: `∑ p̃ (w - m)² ≤ ∑ p̃ (w - a)²` when `m = ∑ p̃ w`.
* `WitCert.abs_exp_neg_sub_one_le`: `|eps| ≤ c → |exp (-eps) - 1| ≤ exp c - 1`.
* `WitCert.tv_le_chi_square`: `TV(p, p̃) ≤ √(∑ p̃ (exp c - 1)²) / (2 A⁻)`.
-/

namespace WitCert

variable {ι : Type*} [Fintype ι] {pt eps c : ι → ℝ}

/-- Second moment about a constant under a probability vector:
`∑ p̃ (g - k)² = ∑ p̃ g² - 2 k ∑ p̃ g + k²`. -/
theorem sum_mul_sub_sq (hsum : ∑ t, pt t = 1) (g : ι → ℝ) (k : ℝ) :
    ∑ t, pt t * (g t - k) ^ 2 = ∑ t, pt t * g t ^ 2 - 2 * k * ∑ t, pt t * g t + k ^ 2 := by
  have h : ∑ t, pt t * (g t - k) ^ 2
      = ∑ t, (pt t * g t ^ 2 + pt t * (k ^ 2 + (-2 * k) * g t)) :=
    Finset.sum_congr rfl fun t _ => by ring
  rw [h, Finset.sum_add_distrib, sum_mul_affine pt g (k ^ 2) (-2 * k), hsum]
  ring

/-- Weighted Cauchy–Schwarz for a probability vector: `(∑ p̃ y)² ≤ ∑ p̃ y²`, from
`0 ≤ ∑ p̃ (y - m)² = ∑ p̃ y² - m²` with `m = ∑ p̃ y`. -/
theorem sq_sum_mul_le_sum_mul_sq (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1) (y : ι → ℝ) :
    (∑ t, pt t * y t) ^ 2 ≤ ∑ t, pt t * y t ^ 2 := by
  have h0 : 0 ≤ ∑ t, pt t * (y t - ∑ s, pt s * y s) ^ 2 :=
    Finset.sum_nonneg fun t _ => mul_nonneg (hp t) (sq_nonneg _)
  rw [sum_mul_sub_sq hsum y] at h0
  linarith [h0]

/-- Centering lowers the second moment: if `m = ∑ p̃ w`, then `∑ p̃ (w - m)² ≤ ∑ p̃ (w - a)²`
(the difference is `(m - a)²`). -/
theorem sum_mul_sub_mean_sq_le (hsum : ∑ t, pt t = 1) {w : ι → ℝ} {m : ℝ}
    (hm : ∑ t, pt t * w t = m) (a : ℝ) :
    ∑ t, pt t * (w t - m) ^ 2 ≤ ∑ t, pt t * (w t - a) ^ 2 := by
  rw [sum_mul_sub_sq hsum w m, sum_mul_sub_sq hsum w a, hm]
  linarith [sq_nonneg (m - a)]

/-- `|eps| ≤ c` gives `|exp (-eps) - 1| ≤ exp c - 1`: above from `exp (-eps) ≤ exp c`, below from
`1 - exp (-eps) ≤ 1 - exp (-c) ≤ c ≤ exp c - 1`. -/
theorem abs_exp_neg_sub_one_le {e b : ℝ} (h : |e| ≤ b) :
    |Real.exp (-e) - 1| ≤ Real.exp b - 1 := by
  have hhi := exp_neg_le_exp_of_abs_le h
  have hlo := exp_neg_le_exp_neg_of_abs_le h
  have h1 := Real.add_one_le_exp (-b)
  have h2 := Real.add_one_le_exp b
  rw [abs_le]
  constructor
  · linarith [hlo, h1, h2]
  · linarith [hhi]

/-- The squared form: `|eps| ≤ c` gives `(exp (-eps) - 1)² ≤ (exp c - 1)²`. -/
theorem sq_exp_neg_sub_one_le {e b : ℝ} (h : |e| ≤ b) :
    (Real.exp (-e) - 1) ^ 2 ≤ (Real.exp b - 1) ^ 2 := by
  have h1 := abs_exp_neg_sub_one_le h
  have h0 : 0 ≤ |Real.exp (-e) - 1| := abs_nonneg _
  have hprod : 0 ≤ (Real.exp b - 1 - |Real.exp (-e) - 1|) * (Real.exp b - 1 + |Real.exp (-e) - 1|) :=
    mul_nonneg (by linarith [h1]) (by linarith [h0, h1])
  have hdiff : (Real.exp b - 1) ^ 2 - |Real.exp (-e) - 1| ^ 2
      = (Real.exp b - 1 - |Real.exp (-e) - 1|) * (Real.exp b - 1 + |Real.exp (-e) - 1|) := by
    ring
  rw [← sq_abs (Real.exp (-e) - 1)]
  linarith [hprod, hdiff]

/-- **Chi-square bound.** If `|eps t| ≤ c t` for every token, then
`TV(p, p̃) ≤ √(∑ t, p̃ t * (exp (c t) - 1)²) / (2 A⁻)` with `A⁻ = ∑ t, p̃ t * exp (-c t)`. -/
theorem tv_le_chi_square (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) :
    tv (reweight pt eps) pt
      ≤ Real.sqrt (∑ t, pt t * (Real.exp (c t) - 1) ^ 2) / (2 * massExpNeg pt c) := by
  have hZ := partition_pos hp hsum heps
  have hAm := massExpNeg_pos hp hsum (nonneg_of_abs_le heps)
  have hAZ := massExpNeg_le_partition hp heps
  have hZdef : ∑ t, pt t * Real.exp (-eps t) = partition pt eps := rfl
  -- step 1: Cauchy–Schwarz on the absolute deviations
  have hcs : (∑ t, pt t * |Real.exp (-eps t) - partition pt eps|) ^ 2
      ≤ ∑ t, pt t * |Real.exp (-eps t) - partition pt eps| ^ 2 :=
    sq_sum_mul_le_sum_mul_sq hp hsum fun t => |Real.exp (-eps t) - partition pt eps|
  have habs : ∑ t, pt t * |Real.exp (-eps t) - partition pt eps| ^ 2
      = ∑ t, pt t * (Real.exp (-eps t) - partition pt eps) ^ 2 :=
    Finset.sum_congr rfl fun t _ => by rw [sq_abs]
  -- step 2: centering at `Z` instead of `1`
  have hvar : ∑ t, pt t * (Real.exp (-eps t) - partition pt eps) ^ 2
      ≤ ∑ t, pt t * (Real.exp (-eps t) - 1) ^ 2 :=
    sum_mul_sub_mean_sq_le hsum hZdef 1
  -- step 3: the box
  have hbox : ∑ t, pt t * (Real.exp (-eps t) - 1) ^ 2
      ≤ ∑ t, pt t * (Real.exp (c t) - 1) ^ 2 :=
    sum_mul_le_sum_mul hp fun t => sq_exp_neg_sub_one_le (heps t)
  have hm0 : 0 ≤ ∑ t, pt t * |Real.exp (-eps t) - partition pt eps| :=
    Finset.sum_nonneg fun t _ => mul_nonneg (hp t) (abs_nonneg _)
  have hmV : ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|
      ≤ Real.sqrt (∑ t, pt t * (Real.exp (c t) - 1) ^ 2) :=
    Real.le_sqrt_of_sq_le (by linarith [hcs, habs, hvar, hbox])
  -- step 4: `A⁻ ≤ Z` in the denominator
  have h2Z : (0 : ℝ) < 2 * partition pt eps := by linarith [hZ]
  have hq : 0 ≤ (∑ t, pt t * |Real.exp (-eps t) - partition pt eps|) / (2 * partition pt eps) :=
    div_nonneg hm0 h2Z.le
  have hden : (∑ t, pt t * |Real.exp (-eps t) - partition pt eps|) / (2 * partition pt eps)
        * (2 * massExpNeg pt c)
      ≤ (∑ t, pt t * |Real.exp (-eps t) - partition pt eps|) / (2 * partition pt eps)
        * (2 * partition pt eps) :=
    mul_le_mul_of_nonneg_left (by linarith [hAZ]) hq
  rw [div_mul_cancel₀ _ h2Z.ne'] at hden
  rw [tv_reweight_eq hp hZ, le_div_iff₀ (by linarith [hAm] : (0 : ℝ) < 2 * massExpNeg pt c)]
  exact le_trans hden hmV

end WitCert
