import WitCert.Core.Factorial
import Mathlib.Analysis.SpecialFunctions.Integrals.Basic
import Mathlib.Analysis.SpecialFunctions.Trigonometric.Series
import Mathlib.Data.Nat.Factorial.Basic
import Mathlib.Tactic.Linarith
import Mathlib.Tactic.NormNum
import Mathlib.Tactic.Positivity
import Mathlib.Tactic.Ring

/-!
# Lemma 2: the uniform sub-Gaussian proxy of subtractive dither

For `X ~ U[-a, a]`, `E exp (λ X) = sinh (λ a) / (λ a) ≤ exp (λ² a² / 6)`: the residual of
subtractive dither with step `s` (uniform on `[-s/2, s/2]`) is sub-Gaussian with proxy `s² / 12`,
its variance. The key inequality `sinh x ≤ x exp (x² / 6)` is not in Mathlib; it follows from the
power series termwise, using `6 ^ n n! ≤ (2 n + 1)!` (proved in core Lean in
`WitCert.Core.Factorial`).

## Main statements

* `WitCert.six_pow_mul_factorial_le`: `6 ^ n * n ! ≤ (2 n + 1)!`.
* `WitCert.sinh_le_mul_exp_sq_div_six` (`L2s`): `0 ≤ x → sinh x ≤ x * exp (x ^ 2 / 6)`.
* `WitCert.uniform_mgf_le` (`L2`): `1/(2a) ∫_{-a}^{a} exp (λ x) dx ≤ exp (λ² a² / 6)`.
* `WitCert.uniform_variance` (`L2v`): the variance of `U[-s/2, s/2]` is `s² / 12`.
-/

namespace WitCert

/-- The core-Lean factorial agrees with Mathlib's `Nat.factorial`. -/
theorem core_fact_eq_factorial : ∀ n : ℕ, WitCert.Core.fact n = n.factorial
  | 0 => rfl
  | n + 1 => by rw [WitCert.Core.fact_succ, Nat.factorial_succ, core_fact_eq_factorial n]

/-- `6 ^ n * n ! ≤ (2 n + 1)!`, transported from the core-Lean proof. -/
theorem six_pow_mul_factorial_le (n : ℕ) : 6 ^ n * n.factorial ≤ (2 * n + 1).factorial := by
  -- stated here, so `6 ^ n` carries this file's `HPow ℕ ℕ ℕ` instance (the core lemma's is
  -- `instPowNat`, definitionally equal), and the rewrites below match the goal syntactically
  have h : 6 ^ n * WitCert.Core.fact n ≤ WitCert.Core.fact (2 * n + 1) :=
    WitCert.Core.six_pow_mul_fact_le n
  rw [core_fact_eq_factorial, core_fact_eq_factorial] at h
  exact h

/-- Termwise comparison of the two series: `x^(2n+1)/(2n+1)! ≤ x (x²/6)^n / n!` for `x ≥ 0`. -/
theorem sinh_term_le {x : ℝ} (hx : 0 ≤ x) (n : ℕ) :
    x ^ (2 * n + 1) / ((2 * n + 1).factorial : ℝ)
      ≤ x * ((x ^ 2 / 6) ^ n / (n.factorial : ℝ)) := by
  have h6 : (6 : ℝ) ^ n * (n.factorial : ℝ) ≤ ((2 * n + 1).factorial : ℝ) := by
    exact_mod_cast six_pow_mul_factorial_le n
  have hden : (0 : ℝ) < 6 ^ n * (n.factorial : ℝ) :=
    mul_pos (pow_pos (by norm_num) n) (Nat.cast_pos.mpr (Nat.factorial_pos n))
  have hnum : 0 ≤ x * (x ^ 2) ^ n := mul_nonneg hx (pow_nonneg (sq_nonneg x) n)
  have hl : x ^ (2 * n + 1) = x * (x ^ 2) ^ n := by ring
  -- `(x²/6)ⁿ / n! = (x²)ⁿ / (6ⁿ n!)` by named rewrites (no `ring` through inverses of casts)
  have hr : x * (x ^ 2) ^ n / (6 ^ n * (n.factorial : ℝ))
      = x * ((x ^ 2 / 6) ^ n / (n.factorial : ℝ)) := by
    rw [div_pow, div_div, mul_div_assoc]
  calc x ^ (2 * n + 1) / ((2 * n + 1).factorial : ℝ)
      = x * (x ^ 2) ^ n / ((2 * n + 1).factorial : ℝ) := by rw [hl]
    _ ≤ x * (x ^ 2) ^ n / (6 ^ n * (n.factorial : ℝ)) := div_le_div_of_nonneg_left hnum hden h6
    _ = x * ((x ^ 2 / 6) ^ n / (n.factorial : ℝ)) := hr

/-- **Lemma 2 (sinh bound).** For `x ≥ 0`, `sinh x ≤ x * exp (x ^ 2 / 6)`. -/
theorem sinh_le_mul_exp_sq_div_six {x : ℝ} (hx : 0 ≤ x) :
    Real.sinh x ≤ x * Real.exp (x ^ 2 / 6) := by
  refine le_of_tendsto' (Real.hasSum_sinh x).tendsto_sum_nat fun N => ?_
  calc ∑ n ∈ Finset.range N, x ^ (2 * n + 1) / ((2 * n + 1).factorial : ℝ)
      ≤ ∑ n ∈ Finset.range N, x * ((x ^ 2 / 6) ^ n / (n.factorial : ℝ)) :=
        Finset.sum_le_sum fun n _ => sinh_term_le hx n
    _ = x * ∑ n ∈ Finset.range N, (x ^ 2 / 6) ^ n / (n.factorial : ℝ) := by
        rw [Finset.mul_sum]
    _ ≤ x * Real.exp (x ^ 2 / 6) :=
        mul_le_mul_of_nonneg_left (Real.sum_le_exp_of_nonneg (by positivity) N) hx

/-- `sinh y / y ≤ exp (y ^ 2 / 6)` for `y ≠ 0` (both sides are even in `y`). -/
theorem sinh_div_le_exp_sq_div_six {y : ℝ} (hy : y ≠ 0) :
    Real.sinh y / y ≤ Real.exp (y ^ 2 / 6) := by
  rcases lt_trichotomy y 0 with hneg | hzero | hpos
  · have hz : 0 < -y := neg_pos.mpr hneg
    have h := sinh_le_mul_exp_sq_div_six hz.le
    rw [neg_sq] at h
    have h2 : Real.sinh (-y) / -y ≤ Real.exp (y ^ 2 / 6) := by
      rw [div_le_iff₀ hz]
      linarith [h]
    rwa [Real.sinh_neg, neg_div_neg_eq] at h2
  · exact absurd hzero hy
  · have h := sinh_le_mul_exp_sq_div_six hpos.le
    rw [div_le_iff₀ hpos]
    linarith [h]

/-- **Lemma 2 (uniform MGF).** For `a > 0` and every `λ`,
`1/(2a) ∫_{-a}^{a} exp (λ x) dx ≤ exp (λ² a² / 6)`. -/
theorem uniform_mgf_le {a : ℝ} (ha : 0 < a) (l : ℝ) :
    1 / (2 * a) * ∫ x in (-a)..a, Real.exp (l * x) ≤ Real.exp (l ^ 2 * a ^ 2 / 6) := by
  have h2a : (2 : ℝ) * a ≠ 0 := (mul_pos two_pos ha).ne'
  rcases eq_or_ne l 0 with hl | hl
  · subst hl
    have hint : ∫ x in (-a)..a, Real.exp (0 * x) = 2 * a := by
      simp only [zero_mul, Real.exp_zero, integral_one]
      ring
    rw [hint, one_div, inv_mul_cancel₀ h2a]
    exact Real.one_le_exp (by positivity)
  · have hla : l * a ≠ 0 := mul_ne_zero hl ha.ne'
    -- substitution `x ↦ l x` in Mathlib's real-valued form `l * ∫ f (l x) = ∫ f` (no `•` on `ℝ`
    -- in this proof: the scalar action is Mathlib's business inside its own proof), then
    -- `∫ exp = exp b - exp a`, each a stated equation
    have hsubst : l * ∫ x in (-a)..a, Real.exp (l * x) = ∫ x in l * -a..l * a, Real.exp x :=
      intervalIntegral.mul_integral_comp_mul_left (f := Real.exp) l
    have hexp : ∫ x in l * -a..l * a, Real.exp x = Real.exp (l * a) - Real.exp (l * -a) :=
      integral_exp
    have hcancel : ∫ x in (-a)..a, Real.exp (l * x)
        = l⁻¹ * (l * ∫ x in (-a)..a, Real.exp (l * x)) := by
      rw [← mul_assoc, inv_mul_cancel₀ hl, one_mul]
    have hint : ∫ x in (-a)..a, Real.exp (l * x)
        = l⁻¹ * (Real.exp (l * a) - Real.exp (-(l * a))) := by
      rw [hcancel, hsubst, hexp, mul_neg]
    have hsinh : 1 / (2 * a) * (l⁻¹ * (Real.exp (l * a) - Real.exp (-(l * a))))
        = Real.sinh (l * a) / (l * a) := by
      rw [Real.sinh_eq]
      ring
    rw [hint, hsinh, show l ^ 2 * a ^ 2 / 6 = (l * a) ^ 2 / 6 by ring]
    exact sinh_div_le_exp_sq_div_six hla

/-- The dither residual on `[-s/2, s/2]` has mean zero. -/
theorem uniform_mean_zero (s : ℝ) : ∫ x in (-(s / 2))..(s / 2), x = 0 := by
  rw [integral_id]
  ring

/-- The second moment of `U[-s/2, s/2]` is `s² / 12`. -/
theorem uniform_second_moment {s : ℝ} (hs : 0 < s) :
    1 / s * ∫ x in (-(s / 2))..(s / 2), x ^ 2 = s ^ 2 / 12 := by
  -- `integral_pow 2` stated with the cast `((2 : ℕ) : ℝ) + 1` it leaves in the denominator, then
  -- that cast rewritten to `3` by a stated equation (both elaborated here, so `rw` matches them
  -- syntactically; no `show` up to unfolding of the numeral cast)
  have hpow : ∫ x in (-(s / 2))..(s / 2), x ^ 2
      = ((s / 2) ^ (2 + 1) - (-(s / 2)) ^ (2 + 1)) / (((2 : ℕ) : ℝ) + 1) :=
    integral_pow 2
  have hthree : ((2 : ℕ) : ℝ) + 1 = 3 := by norm_num
  have hint : ∫ x in (-(s / 2))..(s / 2), x ^ 2 = s * (s ^ 2 / 12) := by
    rw [hpow, hthree]
    ring
  rw [hint, one_div, ← mul_assoc, inv_mul_cancel₀ hs.ne', one_mul]

/-- **Lemma 2 (proxy = variance).** The variance of `U[-s/2, s/2]`,
`E[X²] - E[X]²`, is `s² / 12`: the sub-Gaussian proxy `s²/12` is exactly the variance. -/
theorem uniform_variance {s : ℝ} (hs : 0 < s) :
    1 / s * (∫ x in (-(s / 2))..(s / 2), x ^ 2)
      - (1 / s * ∫ x in (-(s / 2))..(s / 2), x) ^ 2 = s ^ 2 / 12 := by
  rw [uniform_second_moment hs, uniform_mean_zero s]
  ring

end WitCert
