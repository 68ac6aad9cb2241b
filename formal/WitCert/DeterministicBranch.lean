import Mathlib.Algebra.Order.BigOperators.Group.Finset
import Mathlib.Algebra.Order.Ring.Abs
import Mathlib.Data.Real.Basic
import Mathlib.Tactic.Ring

/-!
# Tier B with the rounding of the keys attention reads

The dithered INT8 cache guarantees `|s_c (n_c - ξ_c) - x_c| ≤ s_c / 2` in exact arithmetic. The
keys attention reads are that value rounded (an fp32 kernel chain, then a cast to the model's
dtype: fp16 or bf16 round far more than fp32), so the per-element error `r_c` of the keys read is
only bounded by `s_c / 2 + e_c`, with `e_c` the rounding bound of that element (derived per dtype
in `witcert/tier_b/certificate.py`). Both branches of the Tier B bound then carry the term
`sm ∑_c |q_c| e_c` (registry key `DB`):

* the deterministic branch, valid for every query (adaptive ones included):
  `|sm ∑_c q_c r_c| ≤ sm ∑_c |q_c| (s_c / 2 + e_c)`;
* the probabilistic branch: when `r_c = s_c (μ_c + X_c) + f_c` with a grid offset `|μ_c| ≤ g / 2`,
  a rounding `|f_c| ≤ e_c` and, on the Tier B event, `|sm ∑_c q_c s_c X_c| ≤ u`, then
  `|sm ∑_c q_c r_c| ≤ u + sm ∑_c |q_c| (s_c g / 2 + e_c)`: the radius `u_t` of Theorem 3
  (`WitCert.tier_b_radius`) plus the slacks `β_t` and `ρ_t`.

Both are the triangle inequality, channel by channel; what they fix is the shape of the bound the
code must compute.

## Main statements

* `WitCert.abs_smul_sum_le`: `|w_c| ≤ b_c` for every `c` gives `|sm ∑ q_c w_c| ≤ sm ∑ |q_c| b_c`.
* `WitCert.abs_logit_error_le_deterministic` (`DB`).
* `WitCert.abs_logit_error_le_probabilistic`.
-/

namespace WitCert

variable {ι : Type*} [Fintype ι]

/-- A weighted sum of per-channel errors, each bounded by `b c`, is bounded by the
`|q|`-weighted sum of the `b c` (`sm ≥ 0`). -/
theorem abs_smul_sum_le (q w b : ι → ℝ) {sm : ℝ} (hsm : 0 ≤ sm) (hw : ∀ c, |w c| ≤ b c) :
    |sm * ∑ c, q c * w c| ≤ sm * ∑ c, |q c| * b c := by
  rw [abs_mul, abs_of_nonneg hsm]
  refine mul_le_mul_of_nonneg_left ?_ hsm
  calc |∑ c, q c * w c| ≤ ∑ c, |q c * w c| := Finset.abs_sum_le_sum_abs _ _
    _ = ∑ c, |q c| * |w c| := Finset.sum_congr rfl fun c _ => abs_mul (q c) (w c)
    _ ≤ ∑ c, |q c| * b c :=
        Finset.sum_le_sum fun c _ => mul_le_mul_of_nonneg_left (hw c) (abs_nonneg (q c))

/-- **Deterministic branch with rounding (`DB`).** If every channel's error in the keys read is
at most `s c / 2 + e c` (half a quantization step plus that element's rounding bound), the logit
error `sm ∑ q c r c` is at most `sm ∑ |q c| (s c / 2 + e c)`, for every query. -/
theorem abs_logit_error_le_deterministic (q r s e : ι → ℝ) {sm : ℝ} (hsm : 0 ≤ sm)
    (hr : ∀ c, |r c| ≤ s c / 2 + e c) :
    |sm * ∑ c, q c * r c| ≤ sm * ∑ c, |q c| * (s c / 2 + e c) :=
  abs_smul_sum_le q r (fun c => s c / 2 + e c) hsm hr

/-- **Probabilistic branch with rounding.** If `r c - s c (μ c + X c)` (the rounding of channel
`c`) is at most `e c`, the grid offset `|μ c| ≤ g / 2`, the scales are nonnegative and the random
part obeys `|sm ∑ q c s c X c| ≤ u`, then `|sm ∑ q c r c| ≤ u + sm ∑ |q c| (s c g / 2 + e c)`. -/
theorem abs_logit_error_le_probabilistic (q r s μ X e : ι → ℝ) {sm g u : ℝ} (hsm : 0 ≤ sm)
    (hs : ∀ c, 0 ≤ s c) (hμ : ∀ c, |μ c| ≤ g / 2) (hf : ∀ c, |r c - s c * (μ c + X c)| ≤ e c)
    (hX : |sm * ∑ c, q c * (s c * X c)| ≤ u) :
    |sm * ∑ c, q c * r c| ≤ u + sm * ∑ c, |q c| * (s c * (g / 2) + e c) := by
  have hw : ∀ c, |r c - s c * X c| ≤ s c * (g / 2) + e c := by
    intro c
    have hsplit : r c - s c * X c = s c * μ c + (r c - s c * (μ c + X c)) := by ring
    rw [hsplit]
    calc |s c * μ c + (r c - s c * (μ c + X c))|
        ≤ |s c * μ c| + |r c - s c * (μ c + X c)| := abs_add_le _ _
      _ = s c * |μ c| + |r c - s c * (μ c + X c)| := by rw [abs_mul, abs_of_nonneg (hs c)]
      _ ≤ s c * (g / 2) + e c := add_le_add (mul_le_mul_of_nonneg_left (hμ c) (hs c)) (hf c)
  have hrest : |sm * ∑ c, q c * (r c - s c * X c)| ≤ sm * ∑ c, |q c| * (s c * (g / 2) + e c) :=
    abs_smul_sum_le q (fun c => r c - s c * X c) (fun c => s c * (g / 2) + e c) hsm hw
  have hsum : ∑ c, q c * r c = ∑ c, q c * (s c * X c) + ∑ c, q c * (r c - s c * X c) :=
    calc ∑ c, q c * r c = ∑ c, (q c * (s c * X c) + q c * (r c - s c * X c)) :=
          Finset.sum_congr rfl fun c _ => by ring
      _ = ∑ c, q c * (s c * X c) + ∑ c, q c * (r c - s c * X c) := Finset.sum_add_distrib
  rw [hsum, mul_add]
  calc |sm * ∑ c, q c * (s c * X c) + sm * ∑ c, q c * (r c - s c * X c)|
      ≤ |sm * ∑ c, q c * (s c * X c)| + |sm * ∑ c, q c * (r c - s c * X c)| := abs_add_le _ _
    _ ≤ u + sm * ∑ c, |q c| * (s c * (g / 2) + e c) := add_le_add hX hrest

end WitCert
