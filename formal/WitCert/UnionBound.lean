import WitCert.Budget
import WitCert.SpotCheck
import Mathlib.Data.ENNReal.BigOperators
import Mathlib.Topology.Algebra.InfiniteSum.ENNReal

/-!
# Union bounds over budgets: every failure probability the product reports

A certificate that holds with probability `1 - δ` per cell is combined over the cells of a
request, the decode steps of a generation or the rounds of an adaptive check by the union
bound. This file states it for probability budgets given per event, so that each `δ` the
product reports is a proved budget rather than a docstring:

* a countable family of events `E k` with `μ (E k) ≤ δ k` and `∑' k, δ k ≤ δ_req` has
  `μ (⋃ k, E k) ≤ δ_req`; the same for a finite family with `∑ k, δ k ≤ δ_req`;
* an open-ended generation: decode step `k ≥ 1` gets `δ_req * 6 / (π² k²)`, split evenly over
  that step's cells (`witcert.spot.budget.delta_at_step`, registry `SCD`); the union over every
  cell of every step stays within `δ_req`, however many steps there are and however many cells
  each has.

Probabilities are `ℝ≥0∞`-valued (`MeasureTheory.Measure`); budgets computed in floating point
enter through `ENNReal.ofReal`. No measurability is needed: the union bound holds for the outer
measure of any sets.

## Main statements

* `WitCert.measure_iUnion_le_of_tsum_le`: the countable union bound against a budget.
* `WitCert.measure_iUnion_le_of_sum_le`: the finite union bound against a budget.
* `WitCert.natCast_mul_ofReal_div_le`: `n * ofReal (x / n) ≤ ofReal x` (an even split over `n`).
* `WitCert.sum_range_step_share_le`: `∑ k < n, 6 / π² * (1 / (k + 1)²) ≤ 1`.
* `WitCert.sum_range_ofReal_step_budget_le`, `WitCert.tsum_ofReal_step_budget_le`: the budgets
  `δ_req * 6 / (π² (k + 1)²)` of any number of steps, or of all of them, spend at most `δ_req`.
* `WitCert.measure_iUnion_steps_le` (`SCD`): step `k + 1`'s cells each fail with probability at
  most `δ_req * 6 / (π² (k + 1)²) / (its number of cells)`, so any cell of any step fails with
  probability at most `δ_req`.
-/

open MeasureTheory
open scoped ENNReal

namespace WitCert

/-- **Union bound against a budget, countable family.** If `μ (E k) ≤ δ k` for every `k` and
`∑' k, δ k ≤ δ_req`, then `μ (⋃ k, E k) ≤ δ_req`. -/
theorem measure_iUnion_le_of_tsum_le {Ω ι : Type*} [MeasurableSpace Ω] [Countable ι]
    (μ : Measure Ω) (E : ι → Set Ω) (δ : ι → ℝ≥0∞) {δreq : ℝ≥0∞}
    (hE : ∀ k, μ (E k) ≤ δ k) (hδ : ∑' k, δ k ≤ δreq) : μ (⋃ k, E k) ≤ δreq :=
  calc μ (⋃ k, E k) ≤ ∑' k, μ (E k) := measure_iUnion_le E
    _ ≤ ∑' k, δ k := ENNReal.tsum_le_tsum hE
    _ ≤ δreq := hδ

/-- **Union bound against a budget, finite family.** If `μ (E k) ≤ δ k` for every `k` of a
finite type and `∑ k, δ k ≤ δ_req`, then `μ (⋃ k, E k) ≤ δ_req`. -/
theorem measure_iUnion_le_of_sum_le {Ω ι : Type*} [MeasurableSpace Ω] [Fintype ι]
    (μ : Measure Ω) (E : ι → Set Ω) (δ : ι → ℝ≥0∞) {δreq : ℝ≥0∞}
    (hE : ∀ k, μ (E k) ≤ δ k) (hδ : ∑ k, δ k ≤ δreq) : μ (⋃ k, E k) ≤ δreq :=
  calc μ (⋃ k, E k) ≤ ∑ k, μ (E k) := measure_iUnion_fintype_le μ E
    _ ≤ ∑ k, δ k := Finset.sum_le_sum fun k _ => hE k
    _ ≤ δreq := hδ

/-- An even split of a budget `x` over `n` events spends at most `x`:
`n * ofReal (x / n) ≤ ofReal x` (equality for `n > 0`; nothing is spent for `n = 0`). -/
theorem natCast_mul_ofReal_div_le (n : ℕ) (x : ℝ) :
    (n : ℝ≥0∞) * ENNReal.ofReal (x / n) ≤ ENNReal.ofReal x := by
  rcases Nat.eq_zero_or_pos n with hn | hn
  · have h0 : (n : ℝ≥0∞) = 0 := by rw [hn, Nat.cast_zero]
    rw [h0, zero_mul]
    exact zero_le
  · have hn' : (n : ℝ) ≠ 0 := Nat.cast_ne_zero.mpr hn.ne'
    -- the cast `ℕ → ℝ≥0∞` named by a stated equation elaborated here (`rw` matches it)
    have hcast : ENNReal.ofReal (n : ℝ) = (n : ℝ≥0∞) := ENNReal.ofReal_natCast n
    calc (n : ℝ≥0∞) * ENNReal.ofReal (x / n)
        = ENNReal.ofReal (n : ℝ) * ENNReal.ofReal (x / n) := by rw [hcast]
      _ = ENNReal.ofReal ((n : ℝ) * (x / n)) := (ENNReal.ofReal_mul (Nat.cast_nonneg n)).symm
      _ = ENNReal.ofReal x := by rw [mul_div_cancel₀ x hn']
      _ ≤ ENNReal.ofReal x := le_refl _

/-- A budget split evenly over the `n` elements of a finite type spends at most the budget:
`∑ i, ofReal (x / n) ≤ ofReal x` for `n = card ι`. -/
theorem sum_ofReal_div_card_le {ι : Type*} [Fintype ι] (x : ℝ) :
    ∑ _i : ι, ENNReal.ofReal (x / Fintype.card ι) ≤ ENNReal.ofReal x := by
  rw [Finset.sum_const, Finset.card_univ, nsmul_eq_mul]
  exact natCast_mul_ofReal_div_le (Fintype.card ι) x

/-- The shares `6 / π² * (1 / (k + 1)²)` of steps `1, 2, …, n` sum to at most `1`: the `k = 0`
term of `WitCert.sum_step_allocation_le` (`1 / 0² = 0`) is dropped and the rest shifted. -/
theorem sum_range_step_share_le (n : ℕ) :
    ∑ k ∈ Finset.range n, 6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2) ≤ 1 := by
  have hshift : ∑ k ∈ Finset.range (n + 1), 6 / Real.pi ^ 2 * ((1 : ℝ) / (k : ℝ) ^ 2)
      = ∑ k ∈ Finset.range n, 6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2)
        + 6 / Real.pi ^ 2 * ((1 : ℝ) / ((0 : ℕ) : ℝ) ^ 2) :=
    Finset.sum_range_succ' (fun k : ℕ => 6 / Real.pi ^ 2 * ((1 : ℝ) / (k : ℝ) ^ 2)) n
  have hzero : 6 / Real.pi ^ 2 * ((1 : ℝ) / ((0 : ℕ) : ℝ) ^ 2) = 0 := by
    rw [Nat.cast_zero, zero_pow two_ne_zero, div_zero, mul_zero]
  have hall := sum_step_allocation_le (n + 1)
  rw [hshift, hzero, add_zero] at hall
  exact hall

/-- Every step share is nonnegative. -/
theorem step_share_nonneg (k : ℕ) : 0 ≤ 6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2) :=
  mul_nonneg (div_nonneg (by norm_num) (sq_nonneg _)) (div_nonneg zero_le_one (sq_nonneg _))

/-- The step budgets `δ_req * 6 / (π² (k + 1)²)` of the first `n` steps sum to at most `δ_req`. -/
theorem sum_range_ofReal_step_budget_le {δreq : ℝ} (hδ : 0 ≤ δreq) (n : ℕ) :
    ∑ k ∈ Finset.range n,
        ENNReal.ofReal (δreq * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2)))
      ≤ ENNReal.ofReal δreq := by
  have hterm : ∀ k ∈ Finset.range n,
      0 ≤ δreq * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2)) :=
    fun k _ => mul_nonneg hδ (step_share_nonneg k)
  have hsum : ∑ k ∈ Finset.range n, δreq * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2))
      ≤ δreq := by
    rw [← Finset.mul_sum]
    calc δreq * ∑ k ∈ Finset.range n, 6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2)
        ≤ δreq * 1 := mul_le_mul_of_nonneg_left (sum_range_step_share_le n) hδ
      _ = δreq := mul_one δreq
  calc ∑ k ∈ Finset.range n,
        ENNReal.ofReal (δreq * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2)))
      = ENNReal.ofReal (∑ k ∈ Finset.range n,
          δreq * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2))) :=
        (ENNReal.ofReal_sum_of_nonneg hterm).symm
    _ ≤ ENNReal.ofReal δreq := ENNReal.ofReal_le_ofReal hsum

/-- The step budgets `δ_req * 6 / (π² (k + 1)²)` of an open-ended generation sum to at most
`δ_req` over every step (`ENNReal.tsum_le_of_sum_range_le` on the partial sums). -/
theorem tsum_ofReal_step_budget_le {δreq : ℝ} (hδ : 0 ≤ δreq) :
    ∑' k : ℕ, ENNReal.ofReal (δreq * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2)))
      ≤ ENNReal.ofReal δreq :=
  ENNReal.tsum_le_of_sum_range_le (sum_range_ofReal_step_budget_le hδ)

/-- **Spot-check request budget over an open-ended generation (`SCD`).** Decode step `k + 1`
has finitely many cells `cell k`; each cell's certificate fails on an event `E k c` of
probability at most `δ_req * 6 / (π² (k + 1)²) / (number of cells of step k + 1)`. Then the
probability that the certificate of any cell of any step fails is at most `δ_req`. -/
theorem measure_iUnion_steps_le {Ω : Type*} [MeasurableSpace Ω] (μ : Measure Ω)
    {cell : ℕ → Type*} [∀ k, Fintype (cell k)] (E : ∀ k, cell k → Set Ω) {δreq : ℝ}
    (hδ : 0 ≤ δreq)
    (hE : ∀ k (c : cell k), μ (E k c) ≤ ENNReal.ofReal
      (δreq * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2)) / Fintype.card (cell k))) :
    μ (⋃ k, ⋃ c, E k c) ≤ ENNReal.ofReal δreq := by
  -- per step: the union over its cells spends at most the step's budget
  have hstep : ∀ k, μ (⋃ c, E k c)
      ≤ ENNReal.ofReal (δreq * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2))) :=
    fun k => measure_iUnion_le_of_sum_le μ (E k) _ (hE k)
      (sum_ofReal_div_card_le _)
  exact measure_iUnion_le_of_tsum_le μ (fun k => ⋃ c, E k c) _ hstep
    (tsum_ofReal_step_budget_le hδ)

end WitCert
