import WitCert.Reweight
import WitCert.MassSplit
import Mathlib.NumberTheory.ZetaValues

/-!
# The spot-check certificate: the deterministic inequality and the step allocation

The spot check (registry keys `SC`, `SCD`) bounds total variation through means under `p̃` that it
estimates from a few exact keys. The deterministic part proved here: with `W t = exp (-eps t)`,
`Z = ∑ t, p̃ t * W t` and **any** constant `z > 0`,
`TV(p, p̃) ≤ (1/2 * ∑ t, p̃ t * |W t - z| + 1/2 * |z - Z|) / z`.

Proof: `z (W - Z) = Z (W - z) + W (z - Z)`, so `z |W - Z| ≤ Z |W - z| + W |z - Z|`; averaging
under `p̃` (with `∑ p̃ W = Z`) and dividing by `2 z Z` gives the bound through
`WitCert.tv_reweight_eq`. The confidence bounds on the two means (betting, empirical Bernstein)
are published results that are not proved here (registry key `SCB`).

For open-ended generation the per-step budget `δ * 6 / (π² k²)` sums to at most `δ` over every
step, from Mathlib's `hasSum_zeta_two`; the union bound over every cell of every step is
`WitCert.measure_iUnion_steps_le` (`WitCert.UnionBound`).

## Main statements

* `WitCert.mul_abs_sub_le_spot`: `z |w - Z| ≤ Z |w - z| + w |z - Z|` for `w, z, Z ≥ 0`.
* `WitCert.tv_le_spot_identity`: the deterministic inequality above.
* `WitCert.tv_le_spot_one_sided`: for every `zU ≥ Z`,
  `TV(p, p̃) ≤ ∑ t, p̃ t * max 0 (1 - W t / zU)` (the one-sided estimator, registry `SCO`).
* `WitCert.spot_one_sided_term_le`: with `|eps t| ≤ c t` that term lies in
  `[0, max 0 (1 - exp (-c t) / zU)] ⊆ [0, 1]`.
* `WitCert.sum_range_one_div_sq_le`: `∑ k < n, 1 / k² ≤ π² / 6` (the `k = 0` term is `0`).
* `WitCert.sum_step_allocation_le`: `∑ k < n, 6 / π² * (1 / k²) ≤ 1`.
-/

namespace WitCert

variable {ι : Type*} [Fintype ι] {pt eps : ι → ℝ}

/-- Pointwise form of the spot identity: `z |w - Z| ≤ Z |w - z| + w |z - Z|`, from
`z (w - Z) = Z (w - z) + w (z - Z)` and the triangle inequality. -/
theorem mul_abs_sub_le_spot {w z Z : ℝ} (hw : 0 ≤ w) (hz : 0 ≤ z) (hZ : 0 ≤ Z) :
    z * |w - Z| ≤ Z * |w - z| + w * |z - Z| := by
  have h : z * (w - Z) = Z * (w - z) + w * (z - Z) := by ring
  calc z * |w - Z| = |z * (w - Z)| := by rw [abs_mul, abs_of_nonneg hz]
    _ = |Z * (w - z) + w * (z - Z)| := by rw [h]
    _ ≤ |Z * (w - z)| + |w * (z - Z)| := abs_add_le _ _
    _ = Z * |w - z| + w * |z - Z| := by rw [abs_mul, abs_mul, abs_of_nonneg hZ, abs_of_nonneg hw]

/-- **Spot-check identity.** For every constant `z > 0`,
`TV(p, p̃) ≤ (1/2 * ∑ t, p̃ t * |exp (-eps t) - z| + 1/2 * |z - Z|) / z`, `Z` the partition
function. No bound on `eps` is needed: both sums are means under `p̃` that the spot check
estimates. -/
theorem tv_le_spot_identity (hp : ∀ t, 0 ≤ pt t) (hZ : 0 < partition pt eps) {z : ℝ} (hz : 0 < z) :
    tv (reweight pt eps) pt
      ≤ (1 / 2 * ∑ t, pt t * |Real.exp (-eps t) - z| + 1 / 2 * |z - partition pt eps|) / z := by
  have hpoint : ∀ t, z * (pt t * |Real.exp (-eps t) - partition pt eps|)
      ≤ partition pt eps * (pt t * |Real.exp (-eps t) - z|)
        + pt t * Real.exp (-eps t) * |z - partition pt eps| := by
    intro t
    have h1 := mul_le_mul_of_nonneg_left
      (mul_abs_sub_le_spot (Real.exp_pos (-eps t)).le hz.le hZ.le) (hp t)
    calc z * (pt t * |Real.exp (-eps t) - partition pt eps|)
        = pt t * (z * |Real.exp (-eps t) - partition pt eps|) := by ring
      _ ≤ pt t * (partition pt eps * |Real.exp (-eps t) - z|
            + Real.exp (-eps t) * |z - partition pt eps|) := h1
      _ = partition pt eps * (pt t * |Real.exp (-eps t) - z|)
            + pt t * Real.exp (-eps t) * |z - partition pt eps| := by ring
  have hsum : z * ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|
      ≤ partition pt eps * ∑ t, pt t * |Real.exp (-eps t) - z|
        + (∑ t, pt t * Real.exp (-eps t)) * |z - partition pt eps| := by
    rw [Finset.mul_sum, Finset.mul_sum, Finset.sum_mul, ← Finset.sum_add_distrib]
    exact Finset.sum_le_sum fun t _ => hpoint t
  have hZdef : ∑ t, pt t * Real.exp (-eps t) = partition pt eps := rfl
  rw [hZdef] at hsum
  have h2Z : (0 : ℝ) < 2 * partition pt eps := by linarith [hZ]
  rw [tv_reweight_eq hp hZ, le_div_iff₀ hz]
  have hmove : (∑ t, pt t * |Real.exp (-eps t) - partition pt eps|) / (2 * partition pt eps) * z
      = (z * ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|) / (2 * partition pt eps) := by ring
  rw [hmove, div_le_iff₀ h2Z]
  calc z * ∑ t, pt t * |Real.exp (-eps t) - partition pt eps|
      ≤ partition pt eps * ∑ t, pt t * |Real.exp (-eps t) - z|
        + partition pt eps * |z - partition pt eps| := hsum
    _ = (1 / 2 * ∑ t, pt t * |Real.exp (-eps t) - z| + 1 / 2 * |z - partition pt eps|)
          * (2 * partition pt eps) := by ring

/-- Pointwise step of the one-sided form: `|a| ≤ a + 2 y` whenever `0 ≤ y` and `-a ≤ y`. -/
theorem abs_le_add_two_mul {a y : ℝ} (hy : 0 ≤ y) (ha : -a ≤ y) : |a| ≤ a + 2 * y :=
  abs_le.mpr ⟨by linarith, by linarith⟩

/-- **One-sided spot-check bound.** If `p̃` is a probability vector and `zU` is at least the
partition function `Z`, then `TV(p, p̃) ≤ ∑ t, p̃ t * max 0 (1 - exp (-eps t) / zU)`.

Proof: `TV = ∑ t, (p̃ t - p t)⁺` because both vectors sum to one (`|a| = a + 2 (-a)⁺` summed,
`∑ (p - p̃) = 0`), and `p̃ t - p t = p̃ t * (1 - W t / Z) ≤ p̃ t * (1 - W t / zU)` since
`W t / zU ≤ W t / Z`. With `zU` an upper confidence bound on `Z` the right side is a mean under
`p̃` of a variable in `[0, 1]` (`WitCert.spot_one_sided_term_le`): two confidence statements. -/
theorem tv_le_spot_one_sided (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (hZ : 0 < partition pt eps) {zU : ℝ} (hzU : partition pt eps ≤ zU) :
    tv (reweight pt eps) pt ≤ ∑ t, pt t * max 0 (1 - Real.exp (-eps t) / zU) := by
  have hpoint : ∀ t, |reweight pt eps t - pt t|
      ≤ (reweight pt eps t - pt t) + 2 * (pt t * max 0 (1 - Real.exp (-eps t) / zU)) := by
    intro t
    have hy : 0 ≤ pt t * max 0 (1 - Real.exp (-eps t) / zU) :=
      mul_nonneg (hp t) (le_max_left _ _)
    have hdiff : pt t - reweight pt eps t = pt t * (1 - Real.exp (-eps t) / partition pt eps) := by
      unfold reweight
      ring
    have hdiv : Real.exp (-eps t) / zU ≤ Real.exp (-eps t) / partition pt eps :=
      div_le_div_of_nonneg_left (Real.exp_pos (-eps t)).le hZ hzU
    have h1 : pt t * (1 - Real.exp (-eps t) / partition pt eps)
        ≤ pt t * (1 - Real.exp (-eps t) / zU) :=
      mul_le_mul_of_nonneg_left (by linarith) (hp t)
    have h2 : pt t * (1 - Real.exp (-eps t) / zU)
        ≤ pt t * max 0 (1 - Real.exp (-eps t) / zU) :=
      mul_le_mul_of_nonneg_left (le_max_right _ _) (hp t)
    exact abs_le_add_two_mul hy (by linarith)
  have hsum_le : ∑ t, |reweight pt eps t - pt t|
      ≤ ∑ t, ((reweight pt eps t - pt t) + 2 * (pt t * max 0 (1 - Real.exp (-eps t) / zU))) :=
    Finset.sum_le_sum fun t _ => hpoint t
  have hzero : ∑ t, (reweight pt eps t - pt t) = 0 := by
    rw [Finset.sum_sub_distrib, sum_reweight hZ, hsum, sub_self]
  rw [Finset.sum_add_distrib, hzero, zero_add, ← Finset.mul_sum] at hsum_le
  calc tv (reweight pt eps) pt = 1 / 2 * ∑ t, |reweight pt eps t - pt t| := rfl
    _ ≤ 1 / 2 * (2 * ∑ t, pt t * max 0 (1 - Real.exp (-eps t) / zU)) :=
        mul_le_mul_of_nonneg_left hsum_le (by norm_num)
    _ = ∑ t, pt t * max 0 (1 - Real.exp (-eps t) / zU) := by ring

/-- **Range of the one-sided term.** With `|eps| ≤ c` and `zU > 0`,
`0 ≤ max 0 (1 - exp (-eps) / zU) ≤ max 0 (1 - exp (-c) / zU) ≤ 1`: importance sampling with
weights `p̃ t * max 0 (1 - exp (-c t) / zU)` gives ratios in `[0, 1]`. -/
theorem spot_one_sided_term_le {e b zU : ℝ} (h : |e| ≤ b) (hzU : 0 < zU) :
    max 0 (1 - Real.exp (-e) / zU) ≤ max 0 (1 - Real.exp (-b) / zU)
      ∧ max 0 (1 - Real.exp (-b) / zU) ≤ 1 := by
  have hdiv : Real.exp (-b) / zU ≤ Real.exp (-e) / zU :=
    div_le_div_of_nonneg_right (exp_neg_le_exp_neg_of_abs_le h) hzU.le
  have hnonneg : 0 ≤ Real.exp (-b) / zU := div_nonneg (Real.exp_pos (-b)).le hzU.le
  exact ⟨max_le_max (le_refl 0) (by linarith), max_le zero_le_one (by linarith)⟩

/-- **Range of the normaliser's ratio.** With `|eps| ≤ c`,
`exp (-c) - 1 ≤ exp (-eps) - 1 ≤ exp c - 1`: importance sampling `Z - ∑ p̃` with weights
`p̃ t * (exp (c t) - 1)` gives ratios in `[-1, 1]` whose upper end is what an upper bound on `Z`
has to fear. -/
theorem exp_neg_sub_one_mem {e b : ℝ} (h : |e| ≤ b) :
    Real.exp (-b) - 1 ≤ Real.exp (-e) - 1 ∧ Real.exp (-e) - 1 ≤ Real.exp b - 1 :=
  ⟨by linarith [exp_neg_le_exp_neg_of_abs_le h], by linarith [exp_neg_le_exp_of_abs_le h]⟩

/-- Partial sums of `1 / k²` (with `1 / 0² = 0`) stay below `π² / 6` (Mathlib's `hasSum_zeta_two`). -/
theorem sum_range_one_div_sq_le (n : ℕ) :
    ∑ k ∈ Finset.range n, (1 : ℝ) / (k : ℝ) ^ 2 ≤ Real.pi ^ 2 / 6 := by
  have hnonneg : ∀ i : ℕ, i ∉ Finset.range n → (0 : ℝ) ≤ 1 / (i : ℝ) ^ 2 :=
    fun _ _ => div_nonneg zero_le_one (sq_nonneg _)
  exact sum_le_hasSum (Finset.range n) hnonneg hasSum_zeta_two

/-- **Step allocation.** The per-step shares `6 / π² * (1 / k²)` of a request budget sum to at
most `1` over any number of decode steps, so `δ_k = δ_req * 6 / (π² k²)` (steps `k ≥ 1`) keeps an
open-ended generation within `δ_req` (the union bound: `WitCert.measure_iUnion_steps_le`). -/
theorem sum_step_allocation_le (n : ℕ) :
    ∑ k ∈ Finset.range n, 6 / Real.pi ^ 2 * ((1 : ℝ) / (k : ℝ) ^ 2) ≤ 1 := by
  rw [← Finset.mul_sum]
  calc 6 / Real.pi ^ 2 * ∑ k ∈ Finset.range n, (1 : ℝ) / (k : ℝ) ^ 2
      ≤ 6 / Real.pi ^ 2 * (Real.pi ^ 2 / 6) :=
        mul_le_mul_of_nonneg_left (sum_range_one_div_sq_le n) (by positivity)
    _ = 1 := by
      rw [div_mul_div_comm, mul_comm (6 : ℝ), div_self]
      positivity

end WitCert
