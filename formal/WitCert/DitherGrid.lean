import WitCert.Dither
import Mathlib.Analysis.SpecialFunctions.Trigonometric.DerivHyp
import Mathlib.Tactic.LinearCombination

/-!
# Lemma 2 on the dither grid: the discrete uniform MGF is below `exp (λ² / 24)`

The dither of the implementation is not a continuous uniform: it takes `N = 2^24` values, the
midpoints `(j + 1/2) / N - 1/2` (`j < N`) of the `N` equal subcells of the cell `[-1/2, 1/2]`,
each with probability `1 / N`. Its MGF is `sinh (λ/2) / (N sinh (λ/(2N)))`: telescoping,
`2 sinh (λ/(2N)) ∑_j exp (λ m_j) = ∑_j (exp (λ (m_j + 1/(2N))) - exp (λ (m_j - 1/(2N))))
= 2 sinh (λ/2)`. Since `y sinh y ≥ y²` (`sinh` dominates the identity on `[0, ∞)`) and
`x sinh x ≤ x² exp (x²/6)` (Lemma 2), the grid MGF is at most the continuous one,
`sinh (λ/2) / (λ/2) ≤ exp (λ² / 24)`: the grid has the same sub-Gaussian proxy `1/12` as
`U[-1/2, 1/2]`. Everything here is real analysis on finite sums; the probability law built on
these points is `WitCert.gridCell`.

## Main definitions

* `WitCert.gridPoint`: the `j`-th grid point `(j + 1/2) / N - 1/2`.

## Main statements

* `WitCert.mul_self_le_mul_sinh`: `y * y ≤ y * sinh y` for every `y`.
* `WitCert.mul_sinh_le_sq_mul_exp`: `x * sinh x ≤ x ^ 2 * exp (x ^ 2 / 6)` for every `x`.
* `WitCert.sum_exp_gridPoint_mul_sinh`: `(∑_j exp (λ m_j)) * sinh (λ / (2N)) = sinh (λ / 2)`.
* `WitCert.grid_mgf_le`: `N⁻¹ * ∑_j exp (λ m_j) ≤ exp (λ² / 24)`.
-/

namespace WitCert

/-- The `j`-th point of the centred dither grid with `N` points: the midpoint
`(j + 1/2) / N - 1/2` of the `j`-th of the `N` equal subcells of `[-1/2, 1/2]` (`j < N`). -/
noncomputable def gridPoint (N j : ℕ) : ℝ := ((j : ℝ) + 1 / 2) / N - 1 / 2

/-- `y² ≤ y sinh y` for every real `y` (`sinh` lies above the identity on `[0, ∞)` and below it
on `(-∞, 0]`). -/
theorem mul_self_le_mul_sinh (y : ℝ) : y * y ≤ y * Real.sinh y := by
  rcases le_total 0 y with hy | hy
  · exact mul_le_mul_of_nonneg_left (Real.self_le_sinh_iff.mpr hy) hy
  · exact mul_le_mul_of_nonpos_left (Real.sinh_le_self_iff.mpr hy) hy

/-- `x sinh x ≤ x² exp (x² / 6)` for every real `x`: Lemma 2's `sinh x ≤ x exp (x² / 6)`
(`x ≥ 0`), extended by evenness of `x sinh x`. -/
theorem mul_sinh_le_sq_mul_exp (x : ℝ) :
    x * Real.sinh x ≤ x ^ 2 * Real.exp (x ^ 2 / 6) := by
  rcases le_total 0 x with hx | hx
  · calc x * Real.sinh x ≤ x * (x * Real.exp (x ^ 2 / 6)) :=
          mul_le_mul_of_nonneg_left (sinh_le_mul_exp_sq_div_six hx) hx
      _ = x ^ 2 * Real.exp (x ^ 2 / 6) := by ring
  · have hy : 0 ≤ -x := neg_nonneg.mpr hx
    have h := sinh_le_mul_exp_sq_div_six hy
    rw [Real.sinh_neg, neg_sq] at h
    calc x * Real.sinh x = -x * -Real.sinh x := by ring
      _ ≤ -x * (-x * Real.exp (x ^ 2 / 6)) := mul_le_mul_of_nonneg_left h hy
      _ = x ^ 2 * Real.exp (x ^ 2 / 6) := by ring

/-- The telescoping identity of the grid MGF:
`(∑_{j < N} exp (λ m_j)) * sinh (λ / (2N)) = sinh (λ / 2)`. -/
theorem sum_exp_gridPoint_mul_sinh {N : ℕ} (hN : 0 < N) (l : ℝ) :
    (∑ j ∈ Finset.range N, Real.exp (l * gridPoint N j)) * Real.sinh (l / (2 * N))
      = Real.sinh (l / 2) := by
  have hN' : (N : ℝ) ≠ 0 := Nat.cast_ne_zero.mpr hN.ne'
  -- each term is a difference of consecutive values of `F i = exp (λ (i / N - 1/2))`
  have hterm : ∀ j : ℕ,
      Real.exp (l * (((j + 1 : ℕ) : ℝ) / N - 1 / 2)) - Real.exp (l * ((j : ℝ) / N - 1 / 2))
        = Real.exp (l * gridPoint N j) * (2 * Real.sinh (l / (2 * N))) := by
    intro j
    have e1 : l * (((j + 1 : ℕ) : ℝ) / N - 1 / 2) = l * gridPoint N j + l / (2 * N) := by
      rw [Nat.cast_add, Nat.cast_one]
      unfold gridPoint
      ring
    have e2 : l * ((j : ℝ) / N - 1 / 2) = l * gridPoint N j + -(l / (2 * N)) := by
      unfold gridPoint
      ring
    rw [e1, e2, Real.exp_add, Real.exp_add, Real.sinh_eq]
    ring
  have htel : ∑ j ∈ Finset.range N,
        (Real.exp (l * (((j + 1 : ℕ) : ℝ) / N - 1 / 2)) - Real.exp (l * ((j : ℝ) / N - 1 / 2)))
      = Real.exp (l * ((N : ℝ) / N - 1 / 2)) - Real.exp (l * (((0 : ℕ) : ℝ) / N - 1 / 2)) :=
    Finset.sum_range_sub (fun i : ℕ => Real.exp (l * ((i : ℝ) / N - 1 / 2))) N
  have hsum : ∑ j ∈ Finset.range N,
        (Real.exp (l * (((j + 1 : ℕ) : ℝ) / N - 1 / 2)) - Real.exp (l * ((j : ℝ) / N - 1 / 2)))
      = (∑ j ∈ Finset.range N, Real.exp (l * gridPoint N j)) * (2 * Real.sinh (l / (2 * N))) := by
    rw [Finset.sum_mul]
    exact Finset.sum_congr rfl fun j _ => hterm j
  have hends : Real.exp (l * ((N : ℝ) / N - 1 / 2)) - Real.exp (l * (((0 : ℕ) : ℝ) / N - 1 / 2))
      = 2 * Real.sinh (l / 2) := by
    have eN : l * ((N : ℝ) / N - 1 / 2) = l / 2 := by
      rw [div_self hN']
      ring
    have e0 : l * (((0 : ℕ) : ℝ) / N - 1 / 2) = -(l / 2) := by
      rw [Nat.cast_zero, zero_div]
      ring
    rw [eN, e0, Real.sinh_eq]
    ring
  have h2 : (∑ j ∈ Finset.range N, Real.exp (l * gridPoint N j)) * (2 * Real.sinh (l / (2 * N)))
      = 2 * Real.sinh (l / 2) := by
    rw [← hsum, htel, hends]
  linear_combination (1 / 2 : ℝ) * h2

/-- **Lemma 2 on the grid.** The MGF of the uniform law on the `N` grid points is at most that of
`U[-1/2, 1/2]`'s bound: `N⁻¹ * ∑_{j < N} exp (λ m_j) ≤ exp (λ² / 24)`, i.e. sub-Gaussian with
proxy `1/12`. -/
theorem grid_mgf_le {N : ℕ} (hN : 0 < N) (l : ℝ) :
    (N : ℝ)⁻¹ * ∑ j ∈ Finset.range N, Real.exp (l * gridPoint N j) ≤ Real.exp (l ^ 2 / 24) := by
  have hN' : (0 : ℝ) < N := Nat.cast_pos.mpr hN
  have hS0 : 0 ≤ ∑ j ∈ Finset.range N, Real.exp (l * gridPoint N j) :=
    Finset.sum_nonneg fun j _ => (Real.exp_pos _).le
  rcases eq_or_ne l 0 with hl | hl
  · -- `λ = 0`: every term is `1`, the average is `1 = exp 0`
    subst hl
    have h1 : ∀ j ∈ Finset.range N, Real.exp (0 * gridPoint N j) = 1 := fun j _ => by
      rw [zero_mul, Real.exp_zero]
    have hsum1 : ∑ j ∈ Finset.range N, Real.exp (0 * gridPoint N j) = (N : ℝ) := by
      rw [Finset.sum_congr rfl h1, Finset.sum_const, Finset.card_range, nsmul_eq_mul, mul_one]
    rw [hsum1, inv_mul_cancel₀ hN'.ne']
    exact Real.one_le_exp (by positivity)
  · -- `λ ≠ 0`: with `y = λ / (2N)` and `x = λ / 2 = N y`,
    -- `S y² ≤ S y sinh y = y sinh x` and `N y sinh x = x sinh x ≤ x² B = N² y² B`
    obtain ⟨y, hy⟩ : ∃ y, y = l / (2 * N) := ⟨_, rfl⟩
    obtain ⟨x, hx⟩ : ∃ x, x = l / 2 := ⟨_, rfl⟩
    obtain ⟨S, hS⟩ : ∃ S, S = ∑ j ∈ Finset.range N, Real.exp (l * gridPoint N j) := ⟨_, rfl⟩
    obtain ⟨B, hB⟩ : ∃ B, B = Real.exp (x ^ 2 / 6) := ⟨_, rfl⟩
    have hNinv : (N : ℝ) * (N : ℝ)⁻¹ = 1 := mul_inv_cancel₀ hN'.ne'
    have hxy : x = N * y := by
      rw [hx, hy]
      linear_combination (-(l / 2)) * hNinv
    have hy0 : y ≠ 0 := by
      rw [hy]
      exact div_ne_zero hl (mul_pos two_pos hN').ne'
    have hid : S * Real.sinh y = Real.sinh x := by
      rw [hS, hy, hx]
      exact sum_exp_gridPoint_mul_sinh hN l
    rw [← hS] at hS0
    have hstep : y * Real.sinh x ≤ (N * B) * (y * y) := by
      have hN2 : (N : ℝ) * (y * Real.sinh x) ≤ (N : ℝ) * ((N * B) * (y * y)) :=
        calc (N : ℝ) * (y * Real.sinh x) = x * Real.sinh x := by rw [hxy]; ring
          _ ≤ x ^ 2 * Real.exp (x ^ 2 / 6) := mul_sinh_le_sq_mul_exp x
          _ = (N : ℝ) * ((N * B) * (y * y)) := by rw [← hB, hxy]; ring
      by_contra hnot
      exact absurd hN2 (not_le.mpr (mul_lt_mul_of_pos_left (not_le.mp hnot) hN'))
    have hkey : S * (y * y) ≤ (N * B) * (y * y) :=
      calc S * (y * y) ≤ S * (y * Real.sinh y) :=
            mul_le_mul_of_nonneg_left (mul_self_le_mul_sinh y) hS0
        _ = y * Real.sinh x := by rw [← hid]; ring
        _ ≤ (N * B) * (y * y) := hstep
    have hSB : S ≤ N * B := by
      by_contra hnot
      exact absurd hkey
        (not_le.mpr (mul_lt_mul_of_pos_right (not_le.mp hnot) (mul_self_pos.mpr hy0)))
    have hx2 : x ^ 2 / 6 = l ^ 2 / 24 := by
      rw [hx]
      ring
    calc (N : ℝ)⁻¹ * ∑ j ∈ Finset.range N, Real.exp (l * gridPoint N j)
        = (N : ℝ)⁻¹ * S := by rw [hS]
      _ ≤ (N : ℝ)⁻¹ * (N * B) := mul_le_mul_of_nonneg_left hSB (inv_nonneg.mpr hN'.le)
      _ = B := by rw [← mul_assoc, inv_mul_cancel₀ hN'.ne', one_mul]
      _ = Real.exp (l ^ 2 / 24) := by rw [hB, hx2]

end WitCert
