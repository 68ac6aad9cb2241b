import WitCert.EForm

/-!
# Proposition 1: the two-sided bound and its per-token retention form

With `A = ∑ t, p̃ t * exp (c t)` and `A⁻ = ∑ t, p̃ t * exp (-c t)`, `A⁻ ≤ Z ≤ A`, so the likelihood
ratio `exp (-eps t) / Z` lies in `[exp (-c t) / A, exp (c t) / A⁻]`, an interval containing `1`.
Hence `|ratio - 1| ≤ exp (c t) / A⁻ - exp (-c t) / A`, and averaging under `p̃` gives
`TV(p, p̃) ≤ 1/2 (A / A⁻ - A⁻ / A)` (registry key `P1`). Keeping, per token, the better of the
e-form and the two one-sided deviations gives the retention form (registry key `P1r`).

## Main statements

* `WitCert.massExpNeg_pos`, `WitCert.massExpNeg_le_one`, `WitCert.massExpNeg_le_partition`.
* `WitCert.tv_le_two_sided`: `TV(p, p̃) ≤ 1/2 (A / A⁻ - A⁻ / A)`.
* `WitCert.tv_le_retention`:
  `TV ≤ 1/2 ∑ p̃ t * min (A e^{c t} - 1) (max (e^{c t}/A⁻ - 1) (1 - e^{-c t}/A))`.
-/

namespace WitCert

variable {ι : Type*} [Fintype ι] {pt eps c : ι → ℝ}

/-- `0 < A⁻`: it is the partition function of the admissible error `eps = c`. -/
theorem massExpNeg_pos (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1) (hc : ∀ t, 0 ≤ c t) :
    0 < massExpNeg pt c :=
  partition_pos (c := c) hp hsum fun t => (abs_of_nonneg (hc t)).le

/-- `A⁻ ≤ 1`: every `exp (-c t) ≤ 1`. -/
theorem massExpNeg_le_one (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1) (hc : ∀ t, 0 ≤ c t) :
    massExpNeg pt c ≤ 1 := by
  have h : massExpNeg pt c ≤ ∑ t, pt t * 1 :=
    sum_mul_le_sum_mul hp fun t => Real.exp_le_one_iff.mpr (by linarith [hc t])
  rwa [sum_mul_const hsum] at h

/-- `A⁻ ≤ Z`: `exp (-c t) ≤ exp (-eps t)`. -/
theorem massExpNeg_le_partition (hp : ∀ t, 0 ≤ pt t) (heps : ∀ t, |eps t| ≤ c t) :
    massExpNeg pt c ≤ partition pt eps :=
  sum_mul_le_sum_mul hp fun t => exp_neg_le_exp_neg_of_abs_le (heps t)

/-- The upper deviation: `exp (-eps t) - Z ≤ (exp (c t) / A⁻ - 1) Z`. -/
theorem exp_neg_sub_partition_le (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (t : ι) :
    Real.exp (-eps t) - partition pt eps
      ≤ (Real.exp (c t) / massExpNeg pt c - 1) * partition pt eps := by
  have hAm := massExpNeg_pos hp hsum (nonneg_of_abs_le heps)
  have hR : Real.exp (c t) ≤ Real.exp (c t) / massExpNeg pt c * partition pt eps := by
    rw [div_mul_eq_mul_div, le_div_iff₀ hAm]
    exact mul_le_mul_of_nonneg_left (massExpNeg_le_partition hp heps) (Real.exp_pos _).le
  linarith [hR, exp_neg_le_exp_of_abs_le (heps t)]

/-- The lower deviation: `Z - exp (-eps t) ≤ (1 - exp (-c t) / A) Z`. -/
theorem partition_sub_exp_neg_le (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (t : ι) :
    partition pt eps - Real.exp (-eps t)
      ≤ (1 - Real.exp (-c t) / massExp pt c) * partition pt eps := by
  have hA : 0 < massExp pt c := by
    linarith [one_le_massExp hp hsum (nonneg_of_abs_le heps)]
  have hL : Real.exp (-c t) / massExp pt c * partition pt eps ≤ Real.exp (-c t) := by
    rw [div_mul_eq_mul_div, div_le_iff₀ hA]
    exact mul_le_mul_of_nonneg_left (partition_le_massExp hp heps) (Real.exp_pos _).le
  linarith [hL, exp_neg_le_exp_neg_of_abs_le (heps t)]

/-- The interval `[exp (-c t) / A, exp (c t) / A⁻]` contains `1`. -/
theorem one_mem_ratio_interval (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (hc : ∀ t, 0 ≤ c t) (t : ι) :
    Real.exp (-c t) / massExp pt c ≤ 1 ∧ 1 ≤ Real.exp (c t) / massExpNeg pt c := by
  have hA1 := one_le_massExp hp hsum hc
  have hAm := massExpNeg_pos hp hsum hc
  have hAm1 := massExpNeg_le_one hp hsum hc
  have hy : Real.exp (-c t) ≤ 1 := Real.exp_le_one_iff.mpr (by linarith [hc t])
  have hx : 1 ≤ Real.exp (c t) := Real.one_le_exp (hc t)
  have hA : 0 < massExp pt c := by linarith [hA1]
  constructor
  · rw [div_le_iff₀ hA, one_mul]
    linarith [hy, hA1]
  · rw [le_div_iff₀ hAm, one_mul]
    linarith [hx, hAm1]

/-- The two-sided pointwise bound `|exp (-eps t) - Z| ≤ (exp (c t)/A⁻ - exp (-c t)/A) Z`. -/
theorem abs_exp_neg_sub_partition_le_two_sided (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (t : ι) :
    |Real.exp (-eps t) - partition pt eps|
      ≤ (Real.exp (c t) / massExpNeg pt c - Real.exp (-c t) / massExp pt c)
        * partition pt eps := by
  have hZ := partition_pos hp hsum heps
  obtain ⟨hL1, hR1⟩ := one_mem_ratio_interval hp hsum (nonneg_of_abs_le heps) t
  have hup := exp_neg_sub_partition_le hp hsum heps t
  have hlo := partition_sub_exp_neg_le hp hsum heps t
  have hLZ : Real.exp (-c t) / massExp pt c * partition pt eps ≤ 1 * partition pt eps :=
    mul_le_mul_of_nonneg_right hL1 hZ.le
  have hRZ : 1 * partition pt eps ≤ Real.exp (c t) / massExpNeg pt c * partition pt eps :=
    mul_le_mul_of_nonneg_right hR1 hZ.le
  rw [abs_le]
  constructor
  · linarith [hlo, hRZ]
  · linarith [hup, hLZ]

/-- **Proposition 1 (two-sided form).** If `|eps t| ≤ c t` for every token, then
`TV(p, p̃) ≤ 1/2 (A / A⁻ - A⁻ / A)`. -/
theorem tv_le_two_sided (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) :
    tv (reweight pt eps) pt
      ≤ 1 / 2 * (massExp pt c / massExpNeg pt c - massExpNeg pt c / massExp pt c) := by
  have h : tv (reweight pt eps) pt
      ≤ 1 / 2 * ∑ t, pt t * (Real.exp (c t) / massExpNeg pt c
          - Real.exp (-c t) / massExp pt c) :=
    tv_reweight_le_of_abs_sub_le hp (partition_pos hp hsum heps)
      fun t => abs_exp_neg_sub_partition_le_two_sided hp hsum heps t
  have hs : ∑ t, pt t * (Real.exp (c t) / massExpNeg pt c - Real.exp (-c t) / massExp pt c)
      = (∑ t, pt t * Real.exp (c t)) / massExpNeg pt c
        - (∑ t, pt t * Real.exp (-c t)) / massExp pt c := by
    rw [Finset.sum_div, Finset.sum_div, ← Finset.sum_sub_distrib]
    exact Finset.sum_congr rfl fun t _ => by ring
  have hA : ∑ t, pt t * Real.exp (c t) = massExp pt c := rfl
  have hAm : ∑ t, pt t * Real.exp (-c t) = massExpNeg pt c := rfl
  rw [hs, hA, hAm] at h
  linarith [h]

/-- The per-token retention bound: `|exp (-eps t) - Z| ≤ g t * Z` with
`g t = min (A e^{c t} - 1) (max (e^{c t}/A⁻ - 1) (1 - e^{-c t}/A))`. -/
theorem abs_exp_neg_sub_partition_le_retention (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (t : ι) :
    |Real.exp (-eps t) - partition pt eps|
      ≤ min (massExp pt c * Real.exp (c t) - 1)
          (max (Real.exp (c t) / massExpNeg pt c - 1) (1 - Real.exp (-c t) / massExp pt c))
        * partition pt eps := by
  have hZ := partition_pos hp hsum heps
  have he := abs_exp_neg_sub_partition_le_eform hp hsum heps t
  have hup := exp_neg_sub_partition_le hp hsum heps t
  have hlo := partition_sub_exp_neg_le hp hsum heps t
  have hmax : |Real.exp (-eps t) - partition pt eps|
      ≤ max (Real.exp (c t) / massExpNeg pt c - 1) (1 - Real.exp (-c t) / massExp pt c)
        * partition pt eps := by
    have h1 : (Real.exp (c t) / massExpNeg pt c - 1) * partition pt eps
        ≤ max (Real.exp (c t) / massExpNeg pt c - 1) (1 - Real.exp (-c t) / massExp pt c)
          * partition pt eps :=
      mul_le_mul_of_nonneg_right (le_max_left _ _) hZ.le
    have h2 : (1 - Real.exp (-c t) / massExp pt c) * partition pt eps
        ≤ max (Real.exp (c t) / massExpNeg pt c - 1) (1 - Real.exp (-c t) / massExp pt c)
          * partition pt eps :=
      mul_le_mul_of_nonneg_right (le_max_right _ _) hZ.le
    rw [abs_le]
    constructor
    · linarith [hlo, h2]
    · linarith [hup, h1]
  rcases le_total (massExp pt c * Real.exp (c t) - 1)
      (max (Real.exp (c t) / massExpNeg pt c - 1) (1 - Real.exp (-c t) / massExp pt c)) with
    hle | hle
  · rw [min_eq_left hle]
    exact he
  · rw [min_eq_right hle]
    exact hmax

/-- **Proposition 1 (per-token retention form).** If `|eps t| ≤ c t` for every token, then
`TV(p, p̃) ≤ 1/2 ∑ t, p̃ t * min (A e^{c t} - 1) (max (e^{c t}/A⁻ - 1) (1 - e^{-c t}/A))`. -/
theorem tv_le_retention (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) :
    tv (reweight pt eps) pt
      ≤ 1 / 2 * ∑ t, pt t * min (massExp pt c * Real.exp (c t) - 1)
          (max (Real.exp (c t) / massExpNeg pt c - 1) (1 - Real.exp (-c t) / massExp pt c)) :=
  tv_reweight_le_of_abs_sub_le hp (partition_pos hp hsum heps)
    fun t => abs_exp_neg_sub_partition_le_retention hp hsum heps t

end WitCert
