import WitCert.EForm
import Mathlib.Analysis.SpecialFunctions.Trigonometric.Basic

/-!
# The max-norm bound `TV ≤ tanh (D / 2)` and the competitor's looser `tanh D`

If `|eps t| ≤ D` for every token, every weight `w t = exp (-eps t)` and the partition function `Z`
lie in `[e^{-D}, e^{D}]`. The map `w ↦ |w - Z|` is convex, so on that interval it lies below its
chord; averaging the chord under `p̃` gives
`(e^D - e^{-D}) ∑ p̃ |w - Z| ≤ 2 (e^D - Z)(Z - e^{-D}) ≤ 2 Z (e^{D/2} - e^{-D/2})²`, which is
`TV(p, p̃) ≤ tanh (D / 2)` (registry key `MN`). The competitor [5] reports `tanh D`, which is sound
and looser (registry key `RC`).

## Main statements

* `WitCert.tv_le_tanh_half`: `|eps t| ≤ D` for all `t` gives `TV(p, p̃) ≤ tanh (D / 2)`.
* `WitCert.tanh_half_le_tanh`: `0 ≤ D → tanh (D / 2) ≤ tanh D`.
-/

namespace WitCert

variable {ι : Type*} [Fintype ι] {pt eps : ι → ℝ}

/-- `tanh x (e^x + e^{-x}) = e^x - e^{-x}`. -/
theorem tanh_mul_exp_add_exp_neg (x : ℝ) :
    Real.tanh x * (Real.exp x + Real.exp (-x)) = Real.exp x - Real.exp (-x) := by
  have hc : Real.cosh x ≠ 0 := (Real.cosh_pos x).ne'
  have h : Real.tanh x * Real.cosh x = Real.sinh x := by
    rw [Real.tanh_eq_sinh_div_cosh, div_mul_cancel₀ _ hc]
  rw [Real.cosh_eq, Real.sinh_eq] at h
  linear_combination 2 * h

/-- The chord of `w ↦ |w - Z|` on `[m, M]`: for `w, Z ∈ [m, M]`,
`(M - m) |w - Z| ≤ (M - w)(Z - m) + (w - m)(M - Z)`. -/
theorem mul_abs_sub_le_chord {m M w Z : ℝ} (hw : m ≤ w ∧ w ≤ M) (hZ : m ≤ Z ∧ Z ≤ M) :
    (M - m) * |w - Z| ≤ (M - w) * (Z - m) + (w - m) * (M - Z) := by
  rcases le_total w Z with h | h
  · have hneg : w - Z ≤ 0 := by linarith [h]
    rw [abs_of_nonpos hneg]
    linarith [mul_nonneg (sub_nonneg.mpr hw.1) (sub_nonneg.mpr hZ.2)]
  · have hpos : 0 ≤ w - Z := by linarith [h]
    rw [abs_of_nonneg hpos]
    linarith [mul_nonneg (sub_nonneg.mpr hw.2) (sub_nonneg.mpr hZ.1)]

/-- **Max-norm bound.** If `|eps t| ≤ D` for every token, then `TV(p, p̃) ≤ tanh (D / 2)`. -/
theorem tv_le_tanh_half (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1) {D : ℝ}
    (heps : ∀ t, |eps t| ≤ D) : tv (reweight pt eps) pt ≤ Real.tanh (D / 2) := by
  have hZ : 0 < partition pt eps := partition_pos (c := fun _ => D) hp hsum heps
  have hD : 0 ≤ D := by
    rcases isEmpty_or_nonempty ι with hι | ⟨t⟩
    · rw [Finset.univ_eq_empty, Finset.sum_empty] at hsum
      exact absurd hsum zero_ne_one
    · exact (abs_nonneg (eps t)).trans (heps t)
  rcases hD.eq_or_lt with h0 | hDpos
  · -- `D = 0`: no error, the two distributions coincide.
    subst h0
    have hw : ∀ t, Real.exp (-eps t) = 1 := fun t => by
      rw [abs_nonpos_iff.mp (heps t), neg_zero, Real.exp_zero]
    have hZ1 : partition pt eps = 1 := by
      unfold partition
      simp only [hw, mul_one]
      exact hsum
    have h : tv (reweight pt eps) pt ≤ 1 / 2 * ∑ t, pt t * 0 :=
      tv_reweight_le_of_abs_sub_le hp hZ fun t =>
        le_of_eq (by rw [hw t, hZ1, sub_self, abs_zero, zero_mul])
    have h0 : ∑ t, pt t * (0 : ℝ) = 0 := Finset.sum_eq_zero fun t _ => mul_zero (pt t)
    calc tv (reweight pt eps) pt ≤ 1 / 2 * ∑ t, pt t * 0 := h
      _ = Real.tanh (0 / 2) := by rw [h0, mul_zero, zero_div, Real.tanh_zero]
  · -- `D > 0`: chord bound, then optimise over `Z`.
    obtain ⟨a, ha⟩ : ∃ a, a = Real.exp (D / 2) := ⟨_, rfl⟩
    obtain ⟨b, hb⟩ : ∃ b, b = Real.exp (-(D / 2)) := ⟨_, rfl⟩
    have hab : a * b = 1 := by
      rw [ha, hb, ← Real.exp_add, show D / 2 + -(D / 2) = 0 by ring, Real.exp_zero]
    have haa : a * a = Real.exp D := by
      rw [ha, ← Real.exp_add, show D / 2 + D / 2 = D by ring]
    have hbb : b * b = Real.exp (-D) := by
      rw [hb, ← Real.exp_add, show -(D / 2) + -(D / 2) = -D by ring]
    have hb0 : 0 < b := by
      rw [hb]
      exact Real.exp_pos _
    have hba : b < a := by
      rw [ha, hb]
      exact Real.exp_lt_exp.mpr (neg_lt_self (half_pos hDpos))
    have hT : Real.tanh (D / 2) * (a + b) = a - b := by
      rw [ha, hb]
      exact tanh_mul_exp_add_exp_neg (D / 2)
    have hw : ∀ t, b * b ≤ Real.exp (-eps t) ∧ Real.exp (-eps t) ≤ a * a := fun t => by
      rw [haa, hbb]
      exact ⟨exp_neg_le_exp_neg_of_abs_le (heps t), exp_neg_le_exp_of_abs_le (heps t)⟩
    have hZlo : b * b ≤ partition pt eps := by
      have h : ∑ t, pt t * (b * b) ≤ partition pt eps :=
        sum_mul_le_sum_mul hp fun t => (hw t).1
      rwa [sum_mul_const hsum] at h
    have hZhi : partition pt eps ≤ a * a := by
      have h : partition pt eps ≤ ∑ t, pt t * (a * a) :=
        sum_mul_le_sum_mul hp fun t => (hw t).2
      rwa [sum_mul_const hsum] at h
    have hZdef : ∑ t, pt t * Real.exp (-eps t) = partition pt eps := rfl
    -- the chord, averaged under `p̃`
    have hS : (a * a - b * b) * ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|
        ≤ 2 * (a * a - partition pt eps) * (partition pt eps - b * b) := by
      rw [Finset.mul_sum]
      calc ∑ t, (a * a - b * b) * (pt t * |Real.exp (-eps t) - partition pt eps|)
          = ∑ t, pt t * ((a * a - b * b) * |Real.exp (-eps t) - partition pt eps|) :=
            Finset.sum_congr rfl fun t _ => by ring
        _ ≤ ∑ t, pt t * ((a * a - Real.exp (-eps t)) * (partition pt eps - b * b)
              + (Real.exp (-eps t) - b * b) * (a * a - partition pt eps)) :=
            sum_mul_le_sum_mul hp fun t => mul_abs_sub_le_chord (hw t) ⟨hZlo, hZhi⟩
        _ = ∑ t, pt t * ((a * a * (partition pt eps - b * b)
                - b * b * (a * a - partition pt eps))
              + ((a * a - partition pt eps) - (partition pt eps - b * b))
                * Real.exp (-eps t)) :=
            Finset.sum_congr rfl fun t _ => by ring
        _ = (a * a * (partition pt eps - b * b) - b * b * (a * a - partition pt eps))
              * ∑ t, pt t
            + ((a * a - partition pt eps) - (partition pt eps - b * b))
              * ∑ t, pt t * Real.exp (-eps t) :=
            sum_mul_affine _ _ _ _
        _ = 2 * (a * a - partition pt eps) * (partition pt eps - b * b) := by
            rw [hsum, hZdef]
            ring
    -- optimising over `Z`: `(a² - Z)(Z - b²) ≤ Z (a - b)²` since `a b = 1`
    have hquad_eq : partition pt eps * (a - b) ^ 2
        - (a * a - partition pt eps) * (partition pt eps - b * b)
        = (partition pt eps - 1) ^ 2 := by
      linear_combination (a * b + 1 - 2 * partition pt eps) * hab
    have htanh : (a * a - b * b) * (Real.tanh (D / 2) * (2 * partition pt eps))
        = 2 * partition pt eps * (a - b) ^ 2 := by
      linear_combination (2 * partition pt eps * (a - b)) * hT
    have hpos : 0 < a * a - b * b :=
      calc (0 : ℝ) < (a - b) * (a + b) := mul_pos (sub_pos.mpr hba) (add_pos (hb0.trans hba) hb0)
        _ = a * a - b * b := by ring
    -- `2 (a² - Z)(Z - b²) = 2 Z (a - b)² - 2 (Z - 1)² ≤ 2 Z (a - b)²`, step by step
    have key : (a * a - b * b) * ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|
        ≤ (a * a - b * b) * (Real.tanh (D / 2) * (2 * partition pt eps)) :=
      calc (a * a - b * b) * ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|
          ≤ 2 * (a * a - partition pt eps) * (partition pt eps - b * b) := hS
        _ ≤ 2 * (a * a - partition pt eps) * (partition pt eps - b * b)
              + 2 * (partition pt eps - 1) ^ 2 :=
            le_add_of_nonneg_right (mul_nonneg zero_le_two (sq_nonneg _))
        _ = 2 * partition pt eps * (a - b) ^ 2 := by linear_combination (-2 : ℝ) * hquad_eq
        _ = (a * a - b * b) * (Real.tanh (D / 2) * (2 * partition pt eps)) := htanh.symm
    have hsumle : ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|
        ≤ Real.tanh (D / 2) * (2 * partition pt eps) := by
      by_contra hnot
      exact absurd key (not_le.mpr (mul_lt_mul_of_pos_left (not_le.mp hnot) hpos))
    rw [tv_reweight_eq hp hZ, div_le_iff₀ (mul_pos two_pos hZ)]
    exact hsumle

/-- **Competitor shape.** For `0 ≤ D`, `tanh (D / 2) ≤ tanh D`: the competitor's `tanh (max c)` is
sound (it dominates our bound) and looser. -/
theorem tanh_half_le_tanh {D : ℝ} (hD : 0 ≤ D) : Real.tanh (D / 2) ≤ Real.tanh D := by
  obtain ⟨a, ha⟩ : ∃ a, a = Real.exp (D / 2) := ⟨_, rfl⟩
  obtain ⟨b, hb⟩ : ∃ b, b = Real.exp (-(D / 2)) := ⟨_, rfl⟩
  have hab : a * b = 1 := by
    rw [ha, hb, ← Real.exp_add, show D / 2 + -(D / 2) = 0 by ring, Real.exp_zero]
  have haa : a * a = Real.exp D := by
    rw [ha, ← Real.exp_add, show D / 2 + D / 2 = D by ring]
  have hbb : b * b = Real.exp (-D) := by
    rw [hb, ← Real.exp_add, show -(D / 2) + -(D / 2) = -D by ring]
  have hb0 : 0 < b := by
    rw [hb]
    exact Real.exp_pos _
  have hba : b ≤ a := by
    rw [ha, hb]
    exact Real.exp_le_exp.mpr (neg_le_self (div_nonneg hD zero_le_two))
  have hT1 : Real.tanh (D / 2) * (a + b) = a - b := by
    rw [ha, hb]
    exact tanh_mul_exp_add_exp_neg (D / 2)
  have hT2 : Real.tanh D * (a * a + b * b) = a * a - b * b := by
    rw [haa, hbb]
    exact tanh_mul_exp_add_exp_neg D
  have e : (Real.tanh D - Real.tanh (D / 2)) * ((a + b) * (a * a + b * b))
      = 2 * (a * b) * (a - b) := by
    linear_combination (a + b) * hT2 - (a * a + b * b) * hT1
  have ha0 : 0 < a := hb0.trans_le hba
  have hP : 0 < (a + b) * (a * a + b * b) :=
    mul_pos (add_pos ha0 hb0) (add_pos (mul_pos ha0 ha0) (mul_pos hb0 hb0))
  have hQ : 0 ≤ 2 * (a * b) * (a - b) := by
    rw [hab]
    linarith [hba]
  by_contra hnot
  have hlt : Real.tanh D * ((a + b) * (a * a + b * b))
      < Real.tanh (D / 2) * ((a + b) * (a * a + b * b)) :=
    mul_lt_mul_of_pos_right (not_le.mp hnot) hP
  have hneg : (Real.tanh D - Real.tanh (D / 2)) * ((a + b) * (a * a + b * b)) < 0 := by
    rw [sub_mul]
    exact sub_neg.mpr hlt
  rw [e] at hneg
  exact absurd hQ (not_le.mpr hneg)

end WitCert
