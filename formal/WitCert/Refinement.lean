import WitCert.Core.Refinement
import Mathlib

/-!
# Lemma 4: refinement

A per-block radius `u j` used for every token of block `j` gives the same e-form mass whether it
is summed block by block (block mass times `exp (u j)`) or token by token (registry key `L4`).
The abstract identity over any structure with associative addition and right distributivity is
`WitCert.Core.SumRing.block_sum_eq_token_sum`; this file states it for real weights over a finite
token type with an arbitrary block assignment.

## Main statements

* `WitCert.block_sum_eq_token_sum`:
  `∑ j, (∑ t with blk t = j, p t) * exp (u j) = ∑ t, p t * exp (u (blk t))`.
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

end WitCert
