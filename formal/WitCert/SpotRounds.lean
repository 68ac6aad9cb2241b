import WitCert.UnionBound
import Mathlib.Data.Fintype.BigOperators

/-!
# Adaptive spot-check rounds: the reported bound fails with probability at most `∑_r δ_r`

A cell's spot check reads keys in rounds `r = 1, …, R` (`witcert.spot.rounds`). After round `r`
it holds a bound `B r ω` on the cell's total variation `T ω`: a statement that fails
(`B r ω < T ω`) with probability at most `δ_r`. The cell stops at the first round whose bound
is at most `τ`, or after round `R`, and reports that round's bound. Whatever the stopping rule
(it may look at every key drawn so far), the reported bound `B (ρ ω) ω` fails only where the
statement of the round it reports fails, so by the union bound it fails with probability at
most `∑_r δ_r ≤ δ`. Two splits of `δ` over the rounds are provided: `δ / R` each for a known
number `R` of rounds, and `δ * 6 / (π² r²)` for round `r` (any number of rounds).

Rounds are indexed by `Fin R` (round `r + 1` is `r`); the randomness is `μ`, the meter's own
draws after the query is fixed. No independence between rounds and no measurability of the
stopping rule is needed.

## Main statements

* `WitCert.measure_selected_lt_le`: for any selection `ρ` of a round,
  `μ {ω | B (ρ ω) ω < T ω} ≤ δ` when `μ {B r < T} ≤ δ_r` and `∑_r δ_r ≤ δ`.
* `WitCert.sum_uniform_round_budget_le`: `∑_{r < R} δ / R ≤ δ`.
* `WitCert.sum_zeta_round_budget_le`: `∑_{r < R} δ * 6 / (π² (r + 1)²) ≤ δ`.
* `WitCert.measure_selected_lt_le_uniform`, `WitCert.measure_selected_lt_le_zeta`: the reported
  bound with either split fails with probability at most `δ`.
-/

open MeasureTheory
open scoped ENNReal

namespace WitCert

/-- **Adaptive rounds.** If round `r`'s bound fails (`B r ω < T ω`) with probability at most
`δ r` and `∑ r, δ r ≤ δ`, then the bound of the round `ρ ω` selected by any rule (the first round
whose bound is at most `τ`, or the last) fails with probability at most `δ`. -/
theorem measure_selected_lt_le {Ω ι : Type*} [MeasurableSpace Ω] [Fintype ι] (μ : Measure Ω)
    (B : ι → Ω → ℝ) (T : Ω → ℝ) (ρ : Ω → ι) (δ : ι → ℝ≥0∞) {δtot : ℝ≥0∞}
    (hB : ∀ r, μ {ω | B r ω < T ω} ≤ δ r) (hδ : ∑ r, δ r ≤ δtot) :
    μ {ω | B (ρ ω) ω < T ω} ≤ δtot := by
  -- the reported bound fails only where the selected round's statement fails
  have hsub : {ω | B (ρ ω) ω < T ω} ⊆ ⋃ r, {ω | B r ω < T ω} := by
    intro ω hω
    rw [Set.mem_setOf_eq] at hω
    refine Set.mem_iUnion.mpr ⟨ρ ω, ?_⟩
    rw [Set.mem_setOf_eq]
    exact hω
  calc μ {ω | B (ρ ω) ω < T ω} ≤ μ (⋃ r, {ω | B r ω < T ω}) := measure_mono hsub
    _ ≤ δtot := measure_iUnion_le_of_sum_le μ (fun r => {ω | B r ω < T ω}) δ hB hδ

/-- **Uniform split.** `R` rounds at `δ / R` each spend at most `δ`. -/
theorem sum_uniform_round_budget_le (R : ℕ) (δ : ℝ) :
    ∑ _r : Fin R, ENNReal.ofReal (δ / R) ≤ ENNReal.ofReal δ := by
  rw [Finset.sum_const, Finset.card_univ, Fintype.card_fin, nsmul_eq_mul]
  exact natCast_mul_ofReal_div_le R δ

/-- **`6 / (π² r²)` split.** Round `r + 1` at `δ * 6 / (π² (r + 1)²)`: any number `R` of rounds
spends at most `δ` (`WitCert.sum_range_ofReal_step_budget_le`). -/
theorem sum_zeta_round_budget_le (R : ℕ) {δ : ℝ} (hδ : 0 ≤ δ) :
    ∑ r : Fin R, ENNReal.ofReal (δ * (6 / Real.pi ^ 2 * ((1 : ℝ) / (((r : ℕ) + 1 : ℕ) : ℝ) ^ 2)))
      ≤ ENNReal.ofReal δ := by
  have hrange : ∑ r : Fin R,
        ENNReal.ofReal (δ * (6 / Real.pi ^ 2 * ((1 : ℝ) / (((r : ℕ) + 1 : ℕ) : ℝ) ^ 2)))
      = ∑ k ∈ Finset.range R,
        ENNReal.ofReal (δ * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2))) :=
    Fin.sum_univ_eq_sum_range
      (fun k : ℕ => ENNReal.ofReal (δ * (6 / Real.pi ^ 2 * ((1 : ℝ) / ((k + 1 : ℕ) : ℝ) ^ 2)))) R
  rw [hrange]
  exact sum_range_ofReal_step_budget_le hδ R

/-- The reported round's bound with the uniform split: `R` rounds, each failing with probability
at most `δ / R`, report a bound that fails with probability at most `δ`. -/
theorem measure_selected_lt_le_uniform {Ω : Type*} [MeasurableSpace Ω] (μ : Measure Ω) {R : ℕ}
    (B : Fin R → Ω → ℝ) (T : Ω → ℝ) (ρ : Ω → Fin R) {δ : ℝ}
    (hB : ∀ r, μ {ω | B r ω < T ω} ≤ ENNReal.ofReal (δ / R)) :
    μ {ω | B (ρ ω) ω < T ω} ≤ ENNReal.ofReal δ :=
  measure_selected_lt_le μ B T ρ (fun _ => ENNReal.ofReal (δ / R)) hB
    (sum_uniform_round_budget_le R δ)

/-- The reported round's bound with the `6 / (π² r²)` split: round `r + 1` failing with
probability at most `δ * 6 / (π² (r + 1)²)` for every round of any number `R`, the reported bound
fails with probability at most `δ`. -/
theorem measure_selected_lt_le_zeta {Ω : Type*} [MeasurableSpace Ω] (μ : Measure Ω) {R : ℕ}
    (B : Fin R → Ω → ℝ) (T : Ω → ℝ) (ρ : Ω → Fin R) {δ : ℝ} (hδ : 0 ≤ δ)
    (hB : ∀ r : Fin R, μ {ω | B r ω < T ω}
      ≤ ENNReal.ofReal (δ * (6 / Real.pi ^ 2 * ((1 : ℝ) / (((r : ℕ) + 1 : ℕ) : ℝ) ^ 2)))) :
    μ {ω | B (ρ ω) ω < T ω} ≤ ENNReal.ofReal δ :=
  measure_selected_lt_le μ B T ρ _ hB (sum_zeta_round_budget_le R hδ)

end WitCert
