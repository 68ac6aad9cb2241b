import WitCert.Core.Refinement
import Mathlib.Analysis.SpecialFunctions.Exp
import Mathlib.Tactic.Ring

/-!
# Lemma 4: refinement

A per-block radius `u j` used for every token of block `j` gives the same e-form mass whether it
is summed block by block (block mass times `exp (u j)`) or token by token (registry key `L4`).
And `A`, a linear functional of `p̃`, merges across split-KV partitions with the same weights
`Z_j / Z = exp (lse_j - LSE)` as the attention output.
The abstract identity over any structure with associative addition and right distributivity is
`WitCert.Core.SumRing.block_sum_eq_token_sum`; this file states it for real weights over a finite
token type with an arbitrary block assignment.

## Main statements

* `WitCert.block_sum_eq_token_sum`:
  `∑ j, (∑ t with blk t = j, p t) * exp (u j) = ∑ t, p t * exp (u (blk t))`.
* `WitCert.massExp_merge`: with positive softmax weights `w`, the global average
  `∑ t, (w t / Z) g t` equals `∑ j, (Z_j / Z) * A_j`, `A_j = ∑_{t ∈ J_j} (w t / Z_j) g t`.
-/

namespace WitCert

/-- **Lemma 4 (refinement).** Blockwise `A` with the block radius equals per-token `A` when each
token carries its block's radius. -/
theorem block_sum_eq_token_sum {ι β : Type*} [Fintype ι] [Fintype β] [DecidableEq β]
    (blk : ι → β) (p : ι → ℝ) (u : β → ℝ) :
    ∑ j, (∑ t ∈ Finset.univ.filter (fun t => blk t = j), p t) * Real.exp (u j)
      = ∑ t, p t * Real.exp (u (blk t)) := by
  rw [← Finset.sum_fiberwise Finset.univ blk (fun t => p t * Real.exp (u (blk t)))]
  refine Finset.sum_congr rfl fun j _ => ?_
  rw [Finset.sum_mul]
  refine Finset.sum_congr rfl fun t ht => ?_
  simp only [(Finset.mem_filter.mp ht).2]

/-- One token's weight regrouped through its block: `a / W * g = (b / W) * (a / b * g)` for a
block mass `b ≠ 0` (stated on plain reals, so no abbreviation of a sum is needed). -/
theorem div_mul_eq_block_split {a b : ℝ} (W g : ℝ) (hb : b ≠ 0) :
    a / W * g = b / W * (a / b * g) :=
  calc a / W * g = b * (a / b) / W * g := by rw [mul_div_cancel₀ a hb]
    _ = b / W * (a / b * g) := by ring

/-- **Lemma 4 (split-KV merge).** For positive weights `w t = exp (l̃ t)` split into partitions
`J_j = {t | part t = j}` with local masses `Z_j`, the softmax average of `g` (for `g = exp c` this
is `A`) equals `∑ j, (Z_j / Z) * A_j` with the partition-local averages `A_j`. -/
theorem massExp_merge {ι κ : Type*} [Fintype ι] [Fintype κ] [DecidableEq κ] (part : ι → κ)
    (w g : ι → ℝ) (hw : ∀ t, 0 < w t) :
    ∑ t, w t / (∑ s, w s) * g t
      = ∑ j, (∑ t ∈ Finset.univ.filter (fun t => part t = j), w t) / (∑ s, w s)
          * ∑ t ∈ Finset.univ.filter (fun t => part t = j),
              w t / (∑ s ∈ Finset.univ.filter (fun s => part s = j), w s) * g t := by
  rw [← Finset.sum_fiberwise Finset.univ part (fun t => w t / (∑ s, w s) * g t)]
  refine Finset.sum_congr rfl fun j _ => ?_
  rw [Finset.mul_sum]
  refine Finset.sum_congr rfl fun t ht => ?_
  have hWj : 0 < ∑ s ∈ Finset.univ.filter (fun s => part s = j), w s :=
    (hw t).trans_le (Finset.single_le_sum (fun i _ => (hw i).le) ht)
  exact div_mul_eq_block_split (∑ s, w s) (g t) hWj.ne'

end WitCert
