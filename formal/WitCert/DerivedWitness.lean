import WitCert.Bands

/-!
# A witness derived from elementwise error bounds

A codec whose reconstruction error has a known elementwise bound, `|r k| ≤ e k` for the residual
`r = k̂ - k` of one band, needs no stored witness: the band norm of the bounds bounds the band norm
of the residual, `‖r_b‖ ≤ √(∑_{k ∈ b} e_k²)`, so `w_b = ‖e_b‖` (rounded up) is a witness and
Theorem 2 bounds the logit error with it.

## Main statements

* `WitCert.band_norm_le_of_abs_le` (`DW`): `(∀ k, |r k| ≤ e k) → ‖r‖ ≤ ‖e‖`.
* `WitCert.abs_inner_div_sqrt_le_derived`: Theorem 2 with the derived witness `‖e_b‖`.
-/

namespace WitCert

variable {β κ : Type*} [Fintype β] [Fintype κ]

/-- **A derived witness (`DW`).** Elementwise bounds `|r k| ≤ e k` give `‖r‖ ≤ ‖e‖`: each square
`r k²` is at most `e k²` (`-e k ≤ r k ≤ e k`), and the square root is monotone. -/
theorem band_norm_le_of_abs_le (r e : κ → ℝ) (h : ∀ k, |r k| ≤ e k) :
    bandNorm r ≤ bandNorm e := by
  unfold bandNorm
  apply Real.sqrt_le_sqrt
  exact Finset.sum_le_sum fun k _ => sq_le_sq' (abs_le.mp (h k)).1 (abs_le.mp (h k)).2

/-- Theorem 2 with the derived witness: elementwise bounds `|r b k| ≤ e b k` give
`|q · r| / √d ≤ (∑_b ‖q_b‖ ‖e_b‖) / √d`. -/
theorem abs_inner_div_sqrt_le_derived (q r e : β → κ → ℝ) (h : ∀ b k, |r b k| ≤ e b k) (d : ℝ) :
    |∑ b, ∑ k, q b k * r b k| / Real.sqrt d ≤ (∑ b, bandNorm (q b) * bandNorm (e b)) / Real.sqrt d :=
  abs_inner_div_sqrt_le_witness q r (fun b => bandNorm (e b))
    (fun b => band_norm_le_of_abs_le (r b) (e b) (h b)) d

end WitCert
