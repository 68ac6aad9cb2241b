import WitCert.Reweight

/-!
# Theorem 1: the e-form bound

With `A = ∑ t, p̃ t * exp (c t)` and `|eps t| ≤ c t` for every token, the exact distribution
`p = p̃ * exp (-eps) / Z` satisfies `TV(p, p̃) ≤ 1/2 (A² - 1)` (registry key `T1`).

Proof outline (paper, Theorem 1): `1 ≤ A`, `Z ≤ A` and `1 ≤ A Z` (the last from
`exp (-c) (A - exp c)² ≥ 0`, a pointwise Cauchy–Schwarz step), so the likelihood ratio
`exp (-eps t) / Z` lies in `[exp (-c t) / A, A exp (c t)]` and `|ratio - 1| ≤ A exp (c t) - 1`;
averaging under `p̃` gives `A² - 1`.

## Main statements

* `WitCert.one_le_massExp`: `1 ≤ A`.
* `WitCert.partition_le_massExp`: `Z ≤ A`.
* `WitCert.one_le_massExp_mul_partition`: `1 ≤ A * Z`.
* `WitCert.partition_pos`: `0 < Z`.
* `WitCert.ratio_mem_eform`: the pointwise ratio bound
  `exp (-c t) / A ≤ exp (-eps t) / Z ≤ A * exp (c t)`.
* `WitCert.tv_le_eform`: `TV(p, p̃) ≤ 1/2 (A² - 1)`.
-/

namespace WitCert

variable {ι : Type*} [Fintype ι] {pt eps c : ι → ℝ}

/-- `1 ≤ A`: every `exp (c t) ≥ 1` and `p̃` sums to one. -/
theorem one_le_massExp (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1) (hc : ∀ t, 0 ≤ c t) :
    1 ≤ massExp pt c := by
  have h : ∑ t, pt t * 1 ≤ massExp pt c :=
    sum_mul_le_sum_mul hp fun t => Real.one_le_exp (hc t)
  rwa [sum_mul_const hsum] at h

/-- `Z ≤ A`: `exp (-eps t) ≤ exp (c t)`. -/
theorem partition_le_massExp (hp : ∀ t, 0 ≤ pt t) (heps : ∀ t, |eps t| ≤ c t) :
    partition pt eps ≤ massExp pt c :=
  sum_mul_le_sum_mul hp fun t => exp_neg_le_exp_of_abs_le (heps t)

/-- The pointwise step of `1 ≤ A Z`: `2 A ≤ A² exp (-eps t) + exp (c t)`, from
`exp (-c) (A - exp c)² ≥ 0` and `exp (-c) ≤ exp (-eps)`. -/
theorem two_mul_le_sq_mul_exp_neg_add_exp {A e b : ℝ} (h : |e| ≤ b) :
    2 * A ≤ A ^ 2 * Real.exp (-e) + Real.exp b := by
  have hxy : Real.exp b * Real.exp (-b) = 1 := by
    rw [← Real.exp_add, show b + -b = 0 by ring, Real.exp_zero]
  have hy : 0 < Real.exp (-b) := Real.exp_pos _
  have h1 : 0 ≤ Real.exp (-b) * (A - Real.exp b) ^ 2 := mul_nonneg hy.le (sq_nonneg _)
  have h2 : Real.exp (-b) * (A - Real.exp b) ^ 2
      = A ^ 2 * Real.exp (-b) + Real.exp b - 2 * A := by
    linear_combination (Real.exp b - 2 * A) * hxy
  have h3 : A ^ 2 * Real.exp (-b) ≤ A ^ 2 * Real.exp (-e) :=
    mul_le_mul_of_nonneg_left (exp_neg_le_exp_neg_of_abs_le h) (sq_nonneg A)
  linarith [h1, h2, h3]

/-- `1 ≤ A Z` (the paper's Cauchy–Schwarz step `E[e^c] E[e^-c] ≥ 1`). -/
theorem one_le_massExp_mul_partition (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) : 1 ≤ massExp pt c * partition pt eps := by
  have hA1 : 1 ≤ massExp pt c := one_le_massExp hp hsum (nonneg_of_abs_le heps)
  have hA : massExp pt c = ∑ t, pt t * Real.exp (c t) := rfl
  have hZ : partition pt eps = ∑ t, pt t * Real.exp (-eps t) := rfl
  have hk : ∑ t, pt t * (2 * massExp pt c)
      ≤ ∑ t, pt t * (massExp pt c ^ 2 * Real.exp (-eps t) + Real.exp (c t)) :=
    sum_mul_le_sum_mul hp fun t => two_mul_le_sq_mul_exp_neg_add_exp (heps t)
  have hL : ∑ t, pt t * (2 * massExp pt c) = 2 * massExp pt c := sum_mul_const hsum _
  have hR : ∑ t, pt t * (massExp pt c ^ 2 * Real.exp (-eps t) + Real.exp (c t))
      = massExp pt c ^ 2 * ∑ t, pt t * Real.exp (-eps t) + ∑ t, pt t * Real.exp (c t) := by
    rw [Finset.mul_sum, ← Finset.sum_add_distrib]
    exact Finset.sum_congr rfl fun t _ => by ring
  rw [← hA, ← hZ] at hR
  have h4 : massExp pt c ≤ massExp pt c * (massExp pt c * partition pt eps) := by
    linarith [hk, hL, hR]
  by_contra hnot
  have hlt : massExp pt c * partition pt eps < 1 := not_le.mp hnot
  have h5 : 0 ≤ (massExp pt c - 1) * (1 - massExp pt c * partition pt eps) :=
    mul_nonneg (by linarith [hA1]) (by linarith [hlt])
  linarith [h4, h5, hlt]

/-- `0 < Z`, from `1 ≤ A Z` and `1 ≤ A`. -/
theorem partition_pos (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) : 0 < partition pt eps := by
  have h1 := one_le_massExp_mul_partition hp hsum heps
  have h2 := one_le_massExp hp hsum (nonneg_of_abs_le heps)
  by_contra hnot
  have hle : partition pt eps ≤ 0 := (not_lt.mp hnot)
  have h3 : 0 ≤ (massExp pt c - 1) * -partition pt eps :=
    mul_nonneg (by linarith [h2]) (by linarith [hle])
  linarith [h1, h3, hle]

/-- The pointwise ratio bound: `exp (-c t) / A ≤ exp (-eps t) / Z ≤ A * exp (c t)`. -/
theorem ratio_mem_eform (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (t : ι) :
    Real.exp (-c t) / massExp pt c ≤ Real.exp (-eps t) / partition pt eps ∧
      Real.exp (-eps t) / partition pt eps ≤ massExp pt c * Real.exp (c t) := by
  have hZ := partition_pos hp hsum heps
  have hA1 := one_le_massExp hp hsum (nonneg_of_abs_le heps)
  have hA : 0 < massExp pt c := by linarith [hA1]
  constructor
  · rw [le_div_iff₀ hZ]
    have h1 : Real.exp (-c t) / massExp pt c * partition pt eps
        ≤ Real.exp (-c t) / massExp pt c * massExp pt c :=
      mul_le_mul_of_nonneg_left (partition_le_massExp hp heps)
        (div_nonneg (Real.exp_pos _).le hA.le)
    rw [div_mul_cancel₀ _ hA.ne'] at h1
    linarith [h1, exp_neg_le_exp_neg_of_abs_le (heps t)]
  · rw [div_le_iff₀ hZ]
    have h1 : Real.exp (c t) * 1 ≤ Real.exp (c t) * (massExp pt c * partition pt eps) :=
      mul_le_mul_of_nonneg_left (one_le_massExp_mul_partition hp hsum heps)
        (Real.exp_pos _).le
    linarith [h1, exp_neg_le_exp_of_abs_le (heps t)]

/-- The e-form pointwise bound `|exp (-eps t) - Z| ≤ (A exp (c t) - 1) Z`, i.e.
`|ratio - 1| ≤ A exp (c t) - 1`. -/
theorem abs_exp_neg_sub_partition_le_eform (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (t : ι) :
    |Real.exp (-eps t) - partition pt eps|
      ≤ (massExp pt c * Real.exp (c t) - 1) * partition pt eps := by
  have hZ := partition_pos hp hsum heps
  have hA1 := one_le_massExp hp hsum (nonneg_of_abs_le heps)
  have hAZ := one_le_massExp_mul_partition hp hsum heps
  have hZA := partition_le_massExp hp heps
  have hlo := exp_neg_le_exp_neg_of_abs_le (heps t)
  have hhi := exp_neg_le_exp_of_abs_le (heps t)
  have hx := Real.exp_pos (c t)
  have hxy : Real.exp (c t) * Real.exp (-c t) = 1 := by
    rw [← Real.exp_add, show c t + -c t = 0 by ring, Real.exp_zero]
  -- upper side: `exp (-eps) ≤ exp c ≤ exp c * (A Z)`
  have hup : Real.exp (c t) * 1 ≤ Real.exp (c t) * (massExp pt c * partition pt eps) :=
    mul_le_mul_of_nonneg_left hAZ hx.le
  -- lower side: `A exp c (A exp c Z + exp (-c) - 2 Z) = Z (A exp c - 1)² + (A - Z) ≥ 0`
  have hAx : 0 < massExp pt c * Real.exp (c t) := mul_pos (by linarith [hA1]) hx
  have hF : massExp pt c * Real.exp (c t)
        * (massExp pt c * Real.exp (c t) * partition pt eps + Real.exp (-c t)
          - 2 * partition pt eps)
      = partition pt eps * (massExp pt c * Real.exp (c t) - 1) ^ 2
        + (massExp pt c - partition pt eps) := by
    linear_combination (massExp pt c) * hxy
  have hF0 : 0 ≤ massExp pt c * Real.exp (c t)
        * (massExp pt c * Real.exp (c t) * partition pt eps + Real.exp (-c t)
          - 2 * partition pt eps) := by
    rw [hF]
    exact add_nonneg (mul_nonneg hZ.le (sq_nonneg _)) (by linarith [hZA])
  have hF1 : 0 ≤ massExp pt c * Real.exp (c t) * partition pt eps + Real.exp (-c t)
      - 2 * partition pt eps := by
    by_contra hnot
    have hlt := mul_lt_mul_of_pos_left (not_le.mp hnot) hAx
    linarith [hF0, hlt]
  rw [abs_le]
  constructor
  · linarith only [hF1, hlo]
  · linarith only [hhi, hup]

/-- **Theorem 1 (e-form).** If `|eps t| ≤ c t` for every token, then
`TV(p, p̃) ≤ 1/2 (A² - 1)` with `A = ∑ t, p̃ t * exp (c t)`. -/
theorem tv_le_eform (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) :
    tv (reweight pt eps) pt ≤ 1 / 2 * (massExp pt c ^ 2 - 1) := by
  have h : tv (reweight pt eps) pt
      ≤ 1 / 2 * ∑ t, pt t * (massExp pt c * Real.exp (c t) - 1) :=
    tv_reweight_le_of_abs_sub_le hp (partition_pos hp hsum heps)
      fun t => abs_exp_neg_sub_partition_le_eform hp hsum heps t
  have hs : ∑ t, pt t * (massExp pt c * Real.exp (c t) - 1)
      = massExp pt c * ∑ t, pt t * Real.exp (c t) - ∑ t, pt t := by
    rw [Finset.mul_sum, ← Finset.sum_sub_distrib]
    exact Finset.sum_congr rfl fun t _ => by ring
  have hA : ∑ t, pt t * Real.exp (c t) = massExp pt c := rfl
  rw [hs, hA, hsum] at h
  linarith [h]

end WitCert
