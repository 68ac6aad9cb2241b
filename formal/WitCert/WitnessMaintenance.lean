import Mathlib.Tactic.Linarith
import WitCert.Bands
import WitCert.RotationRounding

/-!
# Witness maintenance: a band witness that survives re-quantization

A cache that quantizes a token again (transformers' `QuantizedCache` re-quantizes its whole
history at every flush of its exact window) moves the token's reconstruction from `xOld` to
`xNew`. A witness `w ≥ ‖xOld - x‖` of a band against the exact key `x` then no longer describes
the key attention reads. The triangle inequality repairs it without the exact key:
`‖xNew - x‖ ≤ w + ‖xNew - xOld‖` (registry key `WM`). A token held exactly until now
(`xOld = x`, `w = 0`) gets `‖xNew - x‖`, its exact witness. Iterated over any number of
re-quantizations the witness is the first one plus the sum of the moves; with Theorem 2 the
maintained witness bounds the logit error of every query.

## Main statements

* `WitCert.bandNorm_sub_le_add_of_le` (`WM`): `‖xOld - x‖ ≤ w → ‖xNew - x‖ ≤ w + ‖xNew - xOld‖`.
* `WitCert.bandNorm_sub_le_add_sum`: after the moves `xh 0 → xh 1 → ⋯ → xh n`,
  `‖xh n - x‖ ≤ w + ∑_{i < n} ‖xh (i + 1) - xh i‖`.
* `WitCert.abs_inner_div_sqrt_le_maintained`: Theorem 2 with a maintained witness.
-/

noncomputable section

namespace WitCert

section Maintenance

variable {κ : Type*} [Fintype κ]

/-- **Witness maintenance (`WM`).** If `w` bounds the band residual of the old reconstruction,
then `w + ‖xNew - xOld‖` bounds the band residual of the new one. -/
theorem bandNorm_sub_le_add_of_le (x xOld xNew : κ → ℝ) (w : ℝ)
    (hw : bandNorm (xOld - x) ≤ w) :
    bandNorm (xNew - x) ≤ w + bandNorm (xNew - xOld) := by
  have hsplit : xNew - x = (xOld - x) + (xNew - xOld) := by abel
  have htri : bandNorm (xNew - x) ≤ bandNorm (xOld - x) + bandNorm (xNew - xOld) := by
    rw [hsplit]
    exact bandNorm_add_le (xOld - x) (xNew - xOld)
  linarith

/-- Witness maintenance over a chain of re-quantizations `xh 0, xh 1, …, xh n`: the first
witness plus the sum of the band norms of the moves bounds the last residual. -/
theorem bandNorm_sub_le_add_sum (x : κ → ℝ) (xh : ℕ → κ → ℝ) (w : ℝ)
    (hw : bandNorm (xh 0 - x) ≤ w) (n : ℕ) :
    bandNorm (xh n - x) ≤ w + ∑ i ∈ Finset.range n, bandNorm (xh (i + 1) - xh i) := by
  induction n with
  | zero => simpa using hw
  | succ n ih =>
    have hstep := bandNorm_sub_le_add_of_le x (xh n) (xh (n + 1)) _ ih
    rw [Finset.sum_range_succ]
    linarith

end Maintenance

section Logit

variable {β κ : Type*} [Fintype β] [Fintype κ]

/-- Theorem 2 with a maintained witness: if `w b` bounds every band residual of the old
reconstruction, the logit error of the new one is bounded by the maintained witness
`w b + ‖xNew b - xOld b‖`. -/
theorem abs_inner_div_sqrt_le_maintained (q x xOld xNew : β → κ → ℝ) (w : β → ℝ)
    (hw : ∀ b, bandNorm (xOld b - x b) ≤ w b) (d : ℝ) :
    |∑ b, ∑ k, q b k * (xNew b - x b) k| / Real.sqrt d ≤
      (∑ b, bandNorm (q b) * (w b + bandNorm (xNew b - xOld b))) / Real.sqrt d :=
  abs_inner_div_sqrt_le_witness q (fun b => xNew b - x b) (fun b => w b + bandNorm (xNew b - xOld b))
    (fun b => bandNorm_sub_le_add_of_le (x b) (xOld b) (xNew b) (w b) (hw b)) d

end Logit

end WitCert

end
