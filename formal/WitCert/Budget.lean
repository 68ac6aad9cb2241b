import WitCert.Core.Budget
import Mathlib.MeasureTheory.Measure.MeasureSpaceDef
import Mathlib.MeasureTheory.OuterMeasure.Basic

/-!
# Lemma 3: the request-level failure budget

Tier B's per-cell certificate fails with probability at most `δ_loc`. Over a finite family of
cells (layers × heads × decode steps) the union bound gives a request-level failure probability
at most `n δ_loc`, so `n δ_loc ≤ δ_req` keeps the request within budget; the allocation
`δ_loc = δ_req / (L H T)` meets it with equality.

## Main statements

* `WitCert.measure_iUnion_le_budget` (`L3`): `μ (E i) ≤ δ_loc` for all `i` and
  `card ι * δ_loc ≤ δ_req` give `μ (⋃ i, E i) ≤ δ_req`.
* `WitCert.delta_loc_allocation`: `(L H T) * (δ_req / (L H T)) = δ_req`.
-/

open MeasureTheory
open scoped ENNReal

namespace WitCert

/-- **Lemma 3 (request budget).** If each of finitely many failure events has probability at
most `δ_loc` and `card ι * δ_loc ≤ δ_req`, the probability that any of them occurs is at most
`δ_req`. -/
theorem measure_iUnion_le_budget {Ω ι : Type*} [MeasurableSpace Ω] [Fintype ι]
    (μ : Measure Ω) (E : ι → Set Ω) {δloc δreq : ℝ≥0∞} (hE : ∀ i, μ (E i) ≤ δloc)
    (hbudget : (Fintype.card ι : ℝ≥0∞) * δloc ≤ δreq) : μ (⋃ i, E i) ≤ δreq :=
  calc μ (⋃ i, E i) ≤ ∑ i, μ (E i) := measure_iUnion_fintype_le μ E
    _ ≤ ∑ _i : ι, δloc := Finset.sum_le_sum fun i _ => hE i
    _ = (Fintype.card ι : ℝ≥0∞) * δloc := by
      rw [Finset.sum_const, Finset.card_univ, nsmul_eq_mul]
    _ ≤ δreq := hbudget

/-- The allocation `δ_loc = δ_req / (L H T)` spends exactly the request budget over `L` layers,
`H` heads and `T` decode steps. -/
theorem delta_loc_allocation (L H T : ℕ) (hL : 0 < L) (hH : 0 < H) (hT : 0 < T) (δreq : ℝ) :
    ((L * H * T : ℕ) : ℝ) * (δreq / ((L * H * T : ℕ) : ℝ)) = δreq := by
  have hne : ((L * H * T : ℕ) : ℝ) ≠ 0 :=
    Nat.cast_ne_zero.mpr (mul_pos (mul_pos hL hH) hT).ne'
  exact mul_div_cancel₀ δreq hne

end WitCert
