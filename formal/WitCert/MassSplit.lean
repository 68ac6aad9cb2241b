import WitCert.ChiSquare
import WitCert.MaxNorm

/-!
# The mass-split bound

Split the tokens into a "low" set `L` and the rest `H` (at run time `L = {t | c t ≤ g}` for a
threshold `g`). Move the errors in two steps: first only those on `L`
(`p' = reweight p̃ (eps 1_L)`), then those on `H`. The triangle inequality gives
`TV(p, p̃) ≤ TV(p, p') + TV(p', p̃)`.

* `TV(p', p̃)` is the TV of an error in the box `c 1_L`: any sound bound `B_L` on that box applies
  (e-form, chi-square, `tanh (max_L c / 2)`, ...).
* `p` is the reweighting of `p'` by `eps 1_H` (`WitCert.reweight_reweight`), so the e-form with
  base `p'` gives `TV(p, p') ≤ 1/2 (A'² - 1)` with `A' = ∑ p' e^{c 1_H}`. Only tokens of `H`
  move, and there `p'_t = p̃_t / Z'`, `Z' ≥ A⁻_L = ∑ p̃ e^{-c 1_L}`, so
  `A' - 1 = ∑_H p̃ (e^c - 1) / Z' ≤ ∑_H p̃ (e^c - 1) / A⁻_L = δ`.

Hence `TV(p, p̃) ≤ B_L + 1/2 ((1 + δ)² - 1)` (registry key `MS`). With `L` every token, `δ = 0` and
the bound is `B_L` itself, so minimising over a set of thresholds that contains `max c` never
does worse than the base bound. The statement is for an arbitrary `L`; the first term is any bound
the caller proves for the box `c 1_L` (the corollaries instantiate it).

## Main definitions

* `WitCert.lowPart L f`: `f` on `L`, `0` off it; `WitCert.highPart L f`: `0` on `L`, `f` off it.

## Main statements

* `WitCert.tv_le_tv_add_tv`: the triangle inequality for `tv`.
* `WitCert.reweight_nonneg`, `WitCert.sum_reweight`: `reweight p̃ eps` is a probability vector.
* `WitCert.reweight_reweight`: reweighting by `e₁`, then by `e₂`, is reweighting by `e₁ + e₂`.
* `WitCert.massExp_reweight_eq`: `A' = 1 + ∑ p̃ (e^{c₂} - 1) / Z₁` when the two steps move
  disjoint tokens.
* `WitCert.tv_le_split`: the two-step bound for any split `eps = e₁ + e₂`.
* `WitCert.tv_le_mass_split`: the bound for a set `L` and any sound first term `B_L`.
* `WitCert.tv_le_mass_split_eform`, `WitCert.tv_le_mass_split_chi_square`,
  `WitCert.tv_le_mass_split_tanh_half`, `WitCert.tv_le_mass_split_min`: `B_L` instantiated with
  the e-form, the chi-square bound, `tanh (D / 2)` and their minimum.
-/

noncomputable section

namespace WitCert

section Parts

variable {ι : Type*} [DecidableEq ι]

/-- `f` on the tokens of `L`, `0` elsewhere (the errors or radii of the low set). -/
def lowPart (L : Finset ι) (f : ι → ℝ) (t : ι) : ℝ := if t ∈ L then f t else 0

/-- `0` on the tokens of `L`, `f` elsewhere (the errors or radii of the high set). -/
def highPart (L : Finset ι) (f : ι → ℝ) (t : ι) : ℝ := if t ∈ L then 0 else f t

end Parts

variable {ι : Type*} [Fintype ι] {pt eps c : ι → ℝ}

/-- Triangle inequality for total variation: `TV(p, r) ≤ TV(p, q) + TV(q, r)`. -/
theorem tv_le_tv_add_tv (p q r : ι → ℝ) : tv p r ≤ tv p q + tv q r := by
  have h : ∑ t, |p t - r t| ≤ ∑ t, (|p t - q t| + |q t - r t|) :=
    Finset.sum_le_sum fun t _ => abs_sub_le (p t) (q t) (r t)
  rw [Finset.sum_add_distrib] at h
  -- scale by `1/2` with a named lemma (no reliance on `linarith`'s denominator cancelling)
  calc tv p r = 1 / 2 * ∑ t, |p t - r t| := rfl
    _ ≤ 1 / 2 * (∑ t, |p t - q t| + ∑ t, |q t - r t|) :=
        mul_le_mul_of_nonneg_left h (by norm_num)
    _ = tv p q + tv q r := mul_add (1 / 2 : ℝ) _ _

/-- The reweighted distribution is nonnegative. -/
theorem reweight_nonneg (hp : ∀ t, 0 ≤ pt t) (hZ : 0 < partition pt eps) (t : ι) :
    0 ≤ reweight pt eps t :=
  div_nonneg (mul_nonneg (hp t) (Real.exp_pos _).le) hZ.le

/-- The reweighted distribution sums to one. -/
theorem sum_reweight (hZ : 0 < partition pt eps) : ∑ t, reweight pt eps t = 1 := by
  show ∑ t, pt t * Real.exp (-eps t) / partition pt eps = 1
  rw [← Finset.sum_div]
  exact div_self hZ.ne'

/-- Reweighting twice composes: if `e₁ t + e₂ t = eps t` for every token, reweighting `p̃` by `e₁`
and then the result by `e₂` is reweighting `p̃` by `eps`. -/
theorem reweight_reweight {e₁ e₂ : ι → ℝ} (hZ₁ : 0 < partition pt e₁)
    (hsplit : ∀ t, e₁ t + e₂ t = eps t) :
    reweight (reweight pt e₁) e₂ = reweight pt eps := by
  have hprod : ∀ t, Real.exp (-e₁ t) * Real.exp (-e₂ t) = Real.exp (-eps t) := fun t => by
    rw [← Real.exp_add, ← hsplit t, neg_add]
  have hinv : partition pt e₁ * (partition pt e₁)⁻¹ = 1 := mul_inv_cancel₀ hZ₁.ne'
  have hterm : ∑ t, reweight pt e₁ t * Real.exp (-e₂ t)
      = ∑ t, pt t * Real.exp (-eps t) / partition pt e₁ :=
    Finset.sum_congr rfl fun t _ => by
      show pt t * Real.exp (-e₁ t) / partition pt e₁ * Real.exp (-e₂ t) = _
      rw [← hprod t]
      ring
  have hZ : partition (reweight pt e₁) e₂ = partition pt eps / partition pt e₁ := by
    show ∑ t, reweight pt e₁ t * Real.exp (-e₂ t)
      = (∑ t, pt t * Real.exp (-eps t)) / partition pt e₁
    rw [hterm, Finset.sum_div]
  funext t
  show reweight pt e₁ t * Real.exp (-e₂ t) / partition (reweight pt e₁) e₂
    = pt t * Real.exp (-eps t) / partition pt eps
  rw [hZ, ← hprod t, div_div_eq_mul_div]
  show pt t * Real.exp (-e₁ t) / partition pt e₁ * Real.exp (-e₂ t) * partition pt e₁
      / partition pt eps
    = pt t * (Real.exp (-e₁ t) * Real.exp (-e₂ t)) / partition pt eps
  linear_combination
    (pt t * Real.exp (-e₁ t) * Real.exp (-e₂ t) * (partition pt eps)⁻¹) * hinv

/-- The e-form mass of the second step. If on every token `e₁ t = 0` or `c₂ t = 0` (the two steps
move disjoint tokens), then `∑ p' e^{c₂} = 1 + ∑ p̃ (e^{c₂} - 1) / Z₁` for `p' = reweight p̃ e₁`. -/
theorem massExp_reweight_eq {e₁ c₂ : ι → ℝ} (hZ₁ : 0 < partition pt e₁)
    (hdisj : ∀ t, e₁ t = 0 ∨ c₂ t = 0) :
    massExp (reweight pt e₁) c₂
      = 1 + (∑ t, pt t * (Real.exp (c₂ t) - 1)) / partition pt e₁ := by
  have hkey : ∀ t, Real.exp (-e₁ t) * (Real.exp (c₂ t) - 1) = Real.exp (c₂ t) - 1 := fun t => by
    rcases hdisj t with h | h
    · rw [h, neg_zero, Real.exp_zero, one_mul]
    · rw [h, Real.exp_zero, sub_self, mul_zero]
  have hterm : ∑ t, reweight pt e₁ t * Real.exp (c₂ t)
      = ∑ t, (pt t * Real.exp (-e₁ t) / partition pt e₁
          + pt t * (Real.exp (c₂ t) - 1) / partition pt e₁) :=
    Finset.sum_congr rfl fun t _ => by
      show pt t * Real.exp (-e₁ t) / partition pt e₁ * Real.exp (c₂ t) = _
      linear_combination (pt t / partition pt e₁) * hkey t
  have hZdef : ∑ t, pt t * Real.exp (-e₁ t) = partition pt e₁ := rfl
  show ∑ t, reweight pt e₁ t * Real.exp (c₂ t) = _
  rw [hterm, Finset.sum_add_distrib, ← Finset.sum_div, ← Finset.sum_div, hZdef,
    div_self hZ₁.ne']

/-- `(1 + x)² ≤ (1 + y)²` for `0 ≤ x ≤ y`: the difference is `(y - x)(2 + y + x) ≥ 0`. -/
theorem one_add_sq_le_one_add_sq {x y : ℝ} (hx : 0 ≤ x) (hxy : x ≤ y) :
    (1 + x) ^ 2 ≤ (1 + y) ^ 2 := by
  have hprod : 0 ≤ (y - x) * (2 + y + x) :=
    mul_nonneg (sub_nonneg.mpr hxy) (add_nonneg (add_nonneg zero_le_two (hx.trans hxy)) hx)
  have hdiff : (1 + y) ^ 2 - (1 + x) ^ 2 = (y - x) * (2 + y + x) := by ring
  rw [← sub_nonneg, hdiff]
  exact hprod

/-- **Two-step bound.** Split the error as `eps = e₁ + e₂` with `|e₁| ≤ c₁`, `|e₂| ≤ c₂` and, on
every token, `e₁ t = 0` or `c₂ t = 0`. If `B` bounds `TV(p', p̃)` for `p' = reweight p̃ e₁`, then
`TV(p, p̃) ≤ B + 1/2 ((1 + δ)² - 1)` with `δ = ∑ p̃ (e^{c₂} - 1) / A⁻(c₁)`. -/
theorem tv_le_split (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1) {e₁ e₂ c₁ c₂ : ι → ℝ}
    (hsplit : ∀ t, e₁ t + e₂ t = eps t) (h₁ : ∀ t, |e₁ t| ≤ c₁ t) (h₂ : ∀ t, |e₂ t| ≤ c₂ t)
    (hdisj : ∀ t, e₁ t = 0 ∨ c₂ t = 0) {B : ℝ} (hB : tv (reweight pt e₁) pt ≤ B) :
    tv (reweight pt eps) pt
      ≤ B + 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (c₂ t) - 1)) / massExpNeg pt c₁) ^ 2 - 1) := by
  have hZ₁ := partition_pos hp hsum h₁
  have hAm := massExpNeg_pos hp hsum (nonneg_of_abs_le h₁)
  have hAZ := massExpNeg_le_partition hp h₁
  -- the second step: the e-form with base `p' = reweight p̃ e₁`
  have hT1 := tv_le_eform (reweight_nonneg hp hZ₁) (sum_reweight hZ₁) h₂
  rw [reweight_reweight hZ₁ hsplit, massExp_reweight_eq hZ₁ hdisj] at hT1
  -- `A' - 1 = N / Z₁ ≤ N / A⁻(c₁)`
  have hN : 0 ≤ ∑ t, pt t * (Real.exp (c₂ t) - 1) :=
    Finset.sum_nonneg fun t _ =>
      mul_nonneg (hp t) (by linarith [Real.one_le_exp (nonneg_of_abs_le h₂ t)])
  have hq : 0 ≤ (∑ t, pt t * (Real.exp (c₂ t) - 1)) / partition pt e₁ := div_nonneg hN hZ₁.le
  have hδ : (∑ t, pt t * (Real.exp (c₂ t) - 1)) / partition pt e₁
      ≤ (∑ t, pt t * (Real.exp (c₂ t) - 1)) / massExpNeg pt c₁ := by
    rw [le_div_iff₀ hAm]
    calc (∑ t, pt t * (Real.exp (c₂ t) - 1)) / partition pt e₁ * massExpNeg pt c₁
        ≤ (∑ t, pt t * (Real.exp (c₂ t) - 1)) / partition pt e₁ * partition pt e₁ :=
          mul_le_mul_of_nonneg_left hAZ hq
      _ = ∑ t, pt t * (Real.exp (c₂ t) - 1) := div_mul_cancel₀ _ hZ₁.ne'
  have hsq : (1 + (∑ t, pt t * (Real.exp (c₂ t) - 1)) / partition pt e₁) ^ 2
      ≤ (1 + (∑ t, pt t * (Real.exp (c₂ t) - 1)) / massExpNeg pt c₁) ^ 2 :=
    one_add_sq_le_one_add_sq hq hδ
  -- the `1/2` factor applied by a named lemma, then a calc of named steps (no `linarith`)
  have hhalf : 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (c₂ t) - 1)) / partition pt e₁) ^ 2 - 1)
      ≤ 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (c₂ t) - 1)) / massExpNeg pt c₁) ^ 2 - 1) :=
    mul_le_mul_of_nonneg_left (sub_le_sub_right hsq 1) (div_nonneg zero_le_one zero_le_two)
  calc tv (reweight pt eps) pt
      ≤ tv (reweight pt eps) (reweight pt e₁) + tv (reweight pt e₁) pt :=
        tv_le_tv_add_tv (reweight pt eps) (reweight pt e₁) pt
    _ ≤ 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (c₂ t) - 1)) / partition pt e₁) ^ 2 - 1) + B :=
        add_le_add hT1 hB
    _ ≤ 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (c₂ t) - 1)) / massExpNeg pt c₁) ^ 2 - 1) + B :=
        add_le_add hhalf le_rfl
    _ = B + 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (c₂ t) - 1)) / massExpNeg pt c₁) ^ 2 - 1) :=
        add_comm _ _

section Threshold

variable [DecidableEq ι]

/-- **Mass-split bound.** Let `L` be any set of tokens and `p' = reweight p̃ (eps 1_L)`. If `B`
bounds `TV(p', p̃)` for every error in the box `c 1_L`, then
`TV(p, p̃) ≤ B + 1/2 ((1 + δ)² - 1)` with `δ = ∑ p̃ (e^{c 1_H} - 1) / A⁻(c 1_L)`, `H` the tokens
outside `L`. -/
theorem tv_le_mass_split (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (L : Finset ι) {B : ℝ}
    (hB : ∀ e : ι → ℝ, (∀ t, |e t| ≤ lowPart L c t) → tv (reweight pt e) pt ≤ B) :
    tv (reweight pt eps) pt
      ≤ B + 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (highPart L c t) - 1))
          / massExpNeg pt (lowPart L c)) ^ 2 - 1) := by
  have hlow : ∀ t, |lowPart L eps t| ≤ lowPart L c t := fun t => by
    by_cases h : t ∈ L
    · simpa only [lowPart, if_pos h] using heps t
    · simp only [lowPart, if_neg h, abs_zero, le_refl]
  have hhigh : ∀ t, |highPart L eps t| ≤ highPart L c t := fun t => by
    by_cases h : t ∈ L
    · simp only [highPart, if_pos h, abs_zero, le_refl]
    · simpa only [highPart, if_neg h] using heps t
  have hsplit : ∀ t, lowPart L eps t + highPart L eps t = eps t := fun t => by
    by_cases h : t ∈ L
    · simp only [lowPart, highPart, if_pos h, add_zero]
    · simp only [lowPart, highPart, if_neg h, zero_add]
  have hdisj : ∀ t, lowPart L eps t = 0 ∨ highPart L c t = 0 := fun t => by
    by_cases h : t ∈ L
    · exact Or.inr (by simp only [highPart, if_pos h])
    · exact Or.inl (by simp only [lowPart, if_neg h])
  exact tv_le_split hp hsum hsplit hlow hhigh hdisj (hB _ hlow)

/-- Mass split with the e-form as first term: `B_L = 1/2 (A_L² - 1)`, `A_L = ∑ p̃ e^{c 1_L}`. -/
theorem tv_le_mass_split_eform (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (L : Finset ι) :
    tv (reweight pt eps) pt
      ≤ 1 / 2 * (massExp pt (lowPart L c) ^ 2 - 1)
        + 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (highPart L c t) - 1))
          / massExpNeg pt (lowPart L c)) ^ 2 - 1) :=
  tv_le_mass_split hp hsum heps L fun _ he => tv_le_eform hp hsum he

/-- Mass split with the chi-square bound as first term:
`B_L = √(∑ p̃ (e^{c 1_L} - 1)²) / (2 A⁻(c 1_L))`. -/
theorem tv_le_mass_split_chi_square (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (L : Finset ι) :
    tv (reweight pt eps) pt
      ≤ Real.sqrt (∑ t, pt t * (Real.exp (lowPart L c t) - 1) ^ 2)
          / (2 * massExpNeg pt (lowPart L c))
        + 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (highPart L c t) - 1))
          / massExpNeg pt (lowPart L c)) ^ 2 - 1) :=
  tv_le_mass_split hp hsum heps L fun _ he => tv_le_chi_square hp hsum he

omit [Fintype ι] in
/-- `D ≥ c` on `L` and `D ≥ 0` give `D ≥ c 1_L` everywhere. -/
theorem lowPart_le {L : Finset ι} {D : ℝ} (hD : ∀ t ∈ L, c t ≤ D) (hD0 : 0 ≤ D) (t : ι) :
    lowPart L c t ≤ D := by
  by_cases h : t ∈ L
  · simpa only [lowPart, if_pos h] using hD t h
  · simpa only [lowPart, if_neg h] using hD0

/-- Mass split with the max-norm bound as first term: `B_L = tanh (D / 2)` for any
`D ≥ max_L c`, `D ≥ 0` (for `L = {c ≤ g}`, `D = g` is allowed). -/
theorem tv_le_mass_split_tanh_half (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (L : Finset ι) {D : ℝ} (hD : ∀ t ∈ L, c t ≤ D) (hD0 : 0 ≤ D) :
    tv (reweight pt eps) pt
      ≤ Real.tanh (D / 2)
        + 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (highPart L c t) - 1))
          / massExpNeg pt (lowPart L c)) ^ 2 - 1) :=
  tv_le_mass_split hp hsum heps L fun _ he =>
    tv_le_tanh_half hp hsum fun t => (he t).trans (lowPart_le hD hD0 t)

/-- Mass split with the minimum of the e-form, the two-sided bound, the chi-square bound and
`tanh (D / 2)` as first term (the form the spec mirror evaluates per threshold). -/
theorem tv_le_mass_split_min (hp : ∀ t, 0 ≤ pt t) (hsum : ∑ t, pt t = 1)
    (heps : ∀ t, |eps t| ≤ c t) (L : Finset ι) {D : ℝ} (hD : ∀ t ∈ L, c t ≤ D) (hD0 : 0 ≤ D) :
    tv (reweight pt eps) pt
      ≤ min (min (1 / 2 * (massExp pt (lowPart L c) ^ 2 - 1))
              (1 / 2 * (massExp pt (lowPart L c) / massExpNeg pt (lowPart L c)
                - massExpNeg pt (lowPart L c) / massExp pt (lowPart L c))))
            (min (Real.sqrt (∑ t, pt t * (Real.exp (lowPart L c t) - 1) ^ 2)
                / (2 * massExpNeg pt (lowPart L c)))
              (Real.tanh (D / 2)))
        + 1 / 2 * ((1 + (∑ t, pt t * (Real.exp (highPart L c t) - 1))
          / massExpNeg pt (lowPart L c)) ^ 2 - 1) :=
  tv_le_mass_split hp hsum heps L fun _ he =>
    le_min (le_min (tv_le_eform hp hsum he) (tv_le_two_sided hp hsum he))
      (le_min (tv_le_chi_square hp hsum he)
        (tv_le_tanh_half hp hsum fun t => (he t).trans (lowPart_le hD hD0 t)))

end Threshold

end WitCert

end
