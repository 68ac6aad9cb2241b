import WitCert.DitherLaw
import WitCert.Budget
import Mathlib.Analysis.Real.Sqrt
import Mathlib.Analysis.SpecialFunctions.Log.Basic
import Mathlib.MeasureTheory.Measure.Real

/-!
# Theorem 3: the Tier B radius, from the dither model

Fix one (layer, head, decode step) with `S` cached tokens `ι` and head channels `κ`. Under
subtractive dither the logit error of token `t` is `eps t = d t + ∑_c k t c * U t c`, where

* `U t c` is the dither residual of channel `c`, in units of the quantization step: the
  **model** (the only probabilistic assumption) is that, for each token, the `U t c` are
  independent and each has the law of a residual, `WitCert.gridCell N` (the implementation's
  `N = 2^24`-point grid) or `WitCert.unitCell` (the continuous uniform on the cell);
* `k t c = sm * q c * s t c` is fixed: the query `q` does not depend on the dither
  (non-adaptive queries), `s` is the quantization step, `sm` the softmax scale;
* `d t` is deterministic with `|d t| ≤ β t`: the offset of the grid residual's mean (the
  grid-offset slack `beta_t` of `witcert.tier_b.certificate`).

Chain of the proof: each component is sub-Gaussian with proxy `1/12` (Lemma 2, in
`WitCert.DitherLaw`); the channel sum has proxy `v t = ∑_c k_c² / 12`
(`WitCert.hasSubgaussianMGF_sum_mul`); the two-sided Chernoff bound gives
`P(u < |X|) ≤ 2 exp (-u² / (2 v))` (`WitCert.measure_lt_abs_le_of_subgaussian`), which is
`δ / S` at the radius `u t = √(2 v t log (2 S / δ))` (`WitCert.exp_neg_sq_tierBRadius`); the
union bound over the `S` tokens (Lemma 3, `WitCert.measure_iUnion_le_budget`) gives
`P(∃ t, u t + β t < |eps t|) ≤ δ` (registry key `TB`), and over the (layer, head, step) cells of
a request with
`(number of cells) * δ_loc ≤ δ_req` it gives `δ_req` (`WitCert.tier_b_request`).

## Main definitions

* `WitCert.tierBRadius`: `u = √(2 v log (2 S / δ))`.

## Main statements

* `WitCert.exp_neg_sq_tierBRadius`: `exp (-u² / (2 v)) = δ / (2 S)` at the radius.
* `WitCert.measure_lt_abs_le_of_subgaussian`: two-sided Chernoff bound for a sub-Gaussian variable.
* `WitCert.tier_b_radius_of_subgaussian`: sub-Gaussian errors give `P(∃ t, u t < |eps t|) ≤ δ`.
* `WitCert.tier_b_radius_of_components`: the same from independent components of proxy `1/12`.
* `WitCert.tier_b_radius_continuous`: the continuous-uniform dither model.
* `WitCert.tier_b_radius` (`TB`): the grid dither model with the deterministic offset:
  `P(∃ t, u t + β t < |d t + ∑_c k t c * U t c|) ≤ δ`.
* `WitCert.tier_b_request`: the request-level budget over (layer, head, step) cells.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

namespace WitCert

/-- The Tier B radius `u = √(2 v log (2 S / δ))` for proxy `v`, `S` tokens and budget `δ`. -/
noncomputable def tierBRadius (v S δ : ℝ) : ℝ := Real.sqrt (2 * v * Real.log (2 * S / δ))

/-- At the Tier B radius the sub-Gaussian tail `exp (-u² / (2 v))` equals `δ / (2 S)`. -/
theorem exp_neg_sq_tierBRadius {v S δ : ℝ} (hv : 0 < v) (hS : 0 < S) (hδ : 0 < δ)
    (hδS : δ ≤ 2 * S) :
    Real.exp (-(tierBRadius v S δ ^ 2) / (2 * v)) = δ / (2 * S) := by
  have hx : 0 < 2 * S / δ := div_pos (by linarith [hS]) hδ
  have hL : 0 ≤ Real.log (2 * S / δ) :=
    Real.log_nonneg ((le_div_iff₀ hδ).mpr (by linarith [hδS]))
  have h2v : 2 * v ≠ 0 := (mul_pos two_pos hv).ne'
  unfold tierBRadius
  rw [Real.sq_sqrt (mul_nonneg (mul_nonneg zero_le_two hv.le) hL), neg_div,
    mul_div_cancel_left₀ _ h2v, Real.exp_neg, Real.exp_log hx, inv_div]

/-- **Two-sided Chernoff bound.** A sub-Gaussian variable with proxy `c` exceeds `u ≥ 0` in
absolute value with probability at most `2 exp (-u² / (2 c))` (Mathlib's one-sided
`HasSubgaussianMGF.measure_ge_le` applied to `X` and to `-X`). -/
theorem measure_lt_abs_le_of_subgaussian {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω}
    [IsFiniteMeasure μ] {X : Ω → ℝ} {c : ℝ≥0} (h : HasSubgaussianMGF X c μ) {u : ℝ} (hu : 0 ≤ u) :
    μ {ω | u < |X ω|} ≤ ENNReal.ofReal (2 * Real.exp (-u ^ 2 / (2 * (c : ℝ)))) := by
  have hup : μ {ω | u ≤ X ω} ≤ ENNReal.ofReal (Real.exp (-u ^ 2 / (2 * (c : ℝ)))) :=
    (ofReal_measureReal (measure_ne_top μ _)).symm.le.trans
      (ENNReal.ofReal_le_ofReal (h.measure_ge_le hu))
  -- Mathlib's bound for `-X` is about the set `{ω | u ≤ (-X) ω}`: equal by `Pi.neg_apply`
  have hnegX : μ.real {ω | u ≤ (-X) ω} ≤ Real.exp (-u ^ 2 / (2 * (c : ℝ))) :=
    h.neg.measure_ge_le hu
  have hset : {ω | u ≤ (-X) ω} = {ω | u ≤ -X ω} := by
    ext ω
    rw [Set.mem_setOf_eq, Set.mem_setOf_eq, Pi.neg_apply]
  rw [hset] at hnegX
  have hdown : μ {ω | u ≤ -X ω} ≤ ENNReal.ofReal (Real.exp (-u ^ 2 / (2 * (c : ℝ)))) :=
    (ofReal_measureReal (measure_ne_top μ _)).symm.le.trans (ENNReal.ofReal_le_ofReal hnegX)
  have hsub : {ω | u < |X ω|} ⊆ {ω | u ≤ X ω} ∪ {ω | u ≤ -X ω} := by
    intro ω hω
    rw [Set.mem_setOf_eq] at hω
    rcases lt_abs.mp hω with h1 | h1
    · exact Or.inl h1.le
    · exact Or.inr h1.le
  have hq : 0 ≤ Real.exp (-u ^ 2 / (2 * (c : ℝ))) := (Real.exp_pos _).le
  calc μ {ω | u < |X ω|} ≤ μ ({ω | u ≤ X ω} ∪ {ω | u ≤ -X ω}) := measure_mono hsub
    _ ≤ μ {ω | u ≤ X ω} + μ {ω | u ≤ -X ω} := measure_union_le (μ := μ) _ _
    _ ≤ ENNReal.ofReal (Real.exp (-u ^ 2 / (2 * (c : ℝ))))
          + ENNReal.ofReal (Real.exp (-u ^ 2 / (2 * (c : ℝ)))) := add_le_add hup hdown
    _ = ENNReal.ofReal (2 * Real.exp (-u ^ 2 / (2 * (c : ℝ)))) := by
        rw [two_mul (Real.exp (-u ^ 2 / (2 * (c : ℝ)))), ENNReal.ofReal_add hq hq]

/-- One token at the radius: a sub-Gaussian error with proxy `c` (as a real number, `v`)
exceeds `tierBRadius v S δ` with probability at most `δ / S`. A zero proxy means the error is
zero almost surely, and the radius is `0`. -/
theorem measure_tierBRadius_lt_abs_le {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω}
    [IsFiniteMeasure μ] {X : Ω → ℝ} {c : ℝ≥0} (h : HasSubgaussianMGF X c μ) {v : ℝ}
    (hc : (c : ℝ) = v) {S δ : ℝ} (hS : 0 < S) (hδ : 0 < δ) (hδS : δ ≤ 2 * S) :
    μ {ω | tierBRadius v S δ < |X ω|} ≤ ENNReal.ofReal (δ / S) := by
  subst hc
  -- the root `zero_le` takes its argument implicitly (`@[to_additive] one_le {a : α}`)
  rcases (zero_le (a := c)).eq_or_lt with hc0 | hcpos
  · -- proxy `0`: `X = 0` almost surely and the radius is `0`
    subst hc0
    have hr : tierBRadius ((0 : ℝ≥0) : ℝ) S δ = 0 := by
      unfold tierBRadius
      rw [NNReal.coe_zero, mul_zero, zero_mul, Real.sqrt_zero]
    have hzero : X =ᵐ[μ] 0 := h.ae_eq_zero_of_hasSubgaussianMGF_zero
    have hae : ∀ᵐ ω ∂μ, |X ω| ≤ 0 := by
      filter_upwards [hzero] with ω hω
      exact abs_nonpos_iff.mpr hω
    have hnull : μ {ω | ¬ (|X ω| ≤ 0)} = 0 := ae_iff.mp hae
    calc μ {ω | tierBRadius ((0 : ℝ≥0) : ℝ) S δ < |X ω|} ≤ μ {ω | ¬ (|X ω| ≤ 0)} := by
          refine measure_mono ?_
          intro ω hω
          rw [Set.mem_setOf_eq, hr] at hω
          exact not_le.mpr hω
      _ = 0 := hnull
      _ ≤ ENNReal.ofReal (δ / S) := zero_le
  · have hv : 0 < (c : ℝ) := NNReal.coe_pos.mpr hcpos
    have htwo : 2 * (δ / (2 * S)) = δ / S := by ring
    calc μ {ω | tierBRadius (c : ℝ) S δ < |X ω|}
        ≤ ENNReal.ofReal (2 * Real.exp (-tierBRadius (c : ℝ) S δ ^ 2 / (2 * (c : ℝ)))) :=
          measure_lt_abs_le_of_subgaussian h (Real.sqrt_nonneg _)
      _ = ENNReal.ofReal (δ / S) := by
          rw [exp_neg_sq_tierBRadius hv hS hδ hδS, htwo]

/-- **Union over tokens.** If every token's error `eps t` has sub-Gaussian MGF with proxy `c t`
(`= v t` as a real number), then with `u t = tierBRadius (v t) S δ` (`S` tokens,
`0 < δ ≤ 2 S`), `P(∃ t, u t < |eps t|) ≤ δ`. -/
theorem tier_b_radius_of_subgaussian {Ω ι : Type*} [MeasurableSpace Ω] [Fintype ι] [Nonempty ι]
    (μ : Measure Ω) [IsFiniteMeasure μ] (eps : ι → Ω → ℝ) (c : ι → ℝ≥0) (v : ι → ℝ)
    (hc : ∀ t, (c t : ℝ) = v t) (hsub : ∀ t, HasSubgaussianMGF (eps t) (c t) μ) {δ : ℝ}
    (hδ : 0 < δ) (hδS : δ ≤ 2 * (Fintype.card ι : ℝ)) :
    μ {ω | ∃ t, tierBRadius (v t) (Fintype.card ι) δ < |eps t ω|} ≤ ENNReal.ofReal δ := by
  have hS : (0 : ℝ) < Fintype.card ι := Nat.cast_pos.mpr Fintype.card_pos
  have hsub' : {ω | ∃ t, tierBRadius (v t) (Fintype.card ι) δ < |eps t ω|}
      ⊆ ⋃ t, {ω | tierBRadius (v t) (Fintype.card ι) δ < |eps t ω|} := by
    intro ω hω
    rw [Set.mem_setOf_eq] at hω
    obtain ⟨t, ht⟩ := hω
    exact Set.mem_iUnion.mpr ⟨t, ht⟩
  -- Lemma 3 with `δ_loc = δ / S` per token: `S * (δ / S) = δ`. The cast `ℕ → ℝ≥0∞` is named by
  -- a stated equation elaborated here, so the rewrite below matches it syntactically
  have hcard : ENNReal.ofReal (Fintype.card ι : ℝ) = (Fintype.card ι : ℝ≥0∞) :=
    ENNReal.ofReal_natCast (Fintype.card ι)
  have hbudget : (Fintype.card ι : ℝ≥0∞) * ENNReal.ofReal (δ / Fintype.card ι)
      ≤ ENNReal.ofReal δ :=
    calc (Fintype.card ι : ℝ≥0∞) * ENNReal.ofReal (δ / Fintype.card ι)
        = ENNReal.ofReal (Fintype.card ι) * ENNReal.ofReal (δ / Fintype.card ι) := by
          rw [hcard]
      _ = ENNReal.ofReal ((Fintype.card ι : ℝ) * (δ / Fintype.card ι)) :=
          (ENNReal.ofReal_mul (Nat.cast_nonneg _)).symm
      _ = ENNReal.ofReal δ := by rw [mul_div_cancel₀ δ hS.ne']
      _ ≤ ENNReal.ofReal δ := le_refl _
  calc μ {ω | ∃ t, tierBRadius (v t) (Fintype.card ι) δ < |eps t ω|}
      ≤ μ (⋃ t, {ω | tierBRadius (v t) (Fintype.card ι) δ < |eps t ω|}) := measure_mono hsub'
    _ ≤ ENNReal.ofReal δ :=
        measure_iUnion_le_budget μ _
          (fun t => measure_tierBRadius_lt_abs_le (hsub t) (hc t) hS hδ hδS) hbudget

/-- **From the components.** If, for each token, the residual components `U t c` are independent
and each has sub-Gaussian MGF with proxy `1/12`, then for fixed coefficients `k`, with
`v t = ∑_c k t c ^ 2 / 12`, `P(∃ t, u t < |∑_c k t c * U t c|) ≤ δ`. -/
theorem tier_b_radius_of_components {Ω ι κ : Type*} [MeasurableSpace Ω] [Fintype ι] [Nonempty ι]
    [Fintype κ] (μ : Measure Ω) [IsProbabilityMeasure μ] (U : ι → κ → Ω → ℝ)
    (hU : ∀ t c, HasSubgaussianMGF (U t c) cellProxy μ) (hindep : ∀ t, iIndepFun (U t) μ)
    (k : ι → κ → ℝ) {δ : ℝ} (hδ : 0 < δ) (hδS : δ ≤ 2 * (Fintype.card ι : ℝ)) :
    μ {ω | ∃ t, tierBRadius (∑ c, k t c ^ 2 / 12) (Fintype.card ι) δ
        < |∑ c, k t c * U t c ω|} ≤ ENNReal.ofReal δ :=
  tier_b_radius_of_subgaussian μ (fun t ω => ∑ c, k t c * U t c ω)
    (fun t => ∑ c, (⟨k t c ^ 2, sq_nonneg (k t c)⟩ : ℝ≥0) * cellProxy)
    (fun t => ∑ c, k t c ^ 2 / 12) (fun t => coe_proxy_sum (k t))
    (fun t => hasSubgaussianMGF_sum_mul (hindep t) (hU t) (k t)) hδ hδS

/-- **Theorem 3, continuous dither model.** If, for each token, the residual components are
independent with the uniform law on the cell (`WitCert.unitCell`), then
`P(∃ t, u t < |∑_c k t c * U t c|) ≤ δ` with `u t = √(2 v t log (2 S / δ))`,
`v t = ∑_c k t c ^ 2 / 12`. -/
theorem tier_b_radius_continuous {Ω ι κ : Type*} [MeasurableSpace Ω] [Fintype ι] [Nonempty ι]
    [Fintype κ] (μ : Measure Ω) [IsProbabilityMeasure μ] (U : ι → κ → Ω → ℝ)
    (hlaw : ∀ t c, IdentDistrib (U t c) id μ unitCell) (hindep : ∀ t, iIndepFun (U t) μ)
    (k : ι → κ → ℝ) {δ : ℝ} (hδ : 0 < δ) (hδS : δ ≤ 2 * (Fintype.card ι : ℝ)) :
    μ {ω | ∃ t, tierBRadius (∑ c, k t c ^ 2 / 12) (Fintype.card ι) δ
        < |∑ c, k t c * U t c ω|} ≤ ENNReal.ofReal δ :=
  tier_b_radius_of_components μ U
    (fun t c => unitCell_hasSubgaussianMGF.congr_identDistrib (hlaw t c).symm) hindep k hδ hδS

/-- **Theorem 3 (Tier B radius), the implementation's model.** Let the logit error of token `t`
be `d t + ∑_c k t c * U t c` with fixed coefficients `k` (non-adaptive query), a deterministic
offset `|d t| ≤ β t` (the grid residual's mean), and residual components `U t c` that are, for
each token, independent with the law of the `N`-point dither grid (`WitCert.gridCell N`). Then,
with `S` tokens, `0 < δ ≤ 2 S`, `v t = ∑_c k t c ^ 2 / 12` and `u t = √(2 v t log (2 S / δ))`,
`P(∃ t, u t + β t < |d t + ∑_c k t c * U t c|) ≤ δ`. -/
theorem tier_b_radius {Ω ι κ : Type*} [MeasurableSpace Ω] [Fintype ι] [Nonempty ι] [Fintype κ]
    (μ : Measure Ω) [IsProbabilityMeasure μ] {N : ℕ} (hN : 0 < N) (U : ι → κ → Ω → ℝ)
    (hlaw : ∀ t c, IdentDistrib (U t c) id μ (gridCell N)) (hindep : ∀ t, iIndepFun (U t) μ)
    (k : ι → κ → ℝ) (d β : ι → ℝ) (hd : ∀ t, |d t| ≤ β t) {δ : ℝ} (hδ : 0 < δ)
    (hδS : δ ≤ 2 * (Fintype.card ι : ℝ)) :
    μ {ω | ∃ t, tierBRadius (∑ c, k t c ^ 2 / 12) (Fintype.card ι) δ + β t
        < |d t + ∑ c, k t c * U t c ω|} ≤ ENNReal.ofReal δ := by
  have h := tier_b_radius_of_components μ U
    (fun t c => (gridCell_hasSubgaussianMGF hN).congr_identDistrib (hlaw t c).symm) hindep k hδ hδS
  refine le_trans (measure_mono ?_) h
  intro ω hω
  rw [Set.mem_setOf_eq] at hω ⊢
  obtain ⟨t, ht⟩ := hω
  -- `|d + X| ≤ |d| + |X| ≤ β + |X|`, so `u + β < |d + X|` forces `u < |X|`
  have htri : |d t + ∑ c, k t c * U t c ω| ≤ |d t| + |∑ c, k t c * U t c ω| :=
    abs_le.mpr
      ⟨by linarith only [neg_abs_le (d t), neg_abs_le (∑ c, k t c * U t c ω)],
        by linarith only [le_abs_self (d t), le_abs_self (∑ c, k t c * U t c ω)]⟩
  exact ⟨t, by linarith only [ht, htri, hd t]⟩

/-- **Theorem 3 over a request.** Over finitely many (layer, head, step) cells `g`, each with its
own tokens `ι g`, query coefficients, offsets and independent grid-dither components: if
`(number of cells) * δ_loc ≤ δ_req`, then with probability at least `1 - δ_req` every token of
every cell satisfies `|eps| ≤ u + β` at the per-cell radius with budget `δ_loc` (Lemma 3). -/
theorem tier_b_request {Ω γ κ : Type*} {ι : γ → Type*} [MeasurableSpace Ω] [Fintype γ]
    [∀ g, Fintype (ι g)] [∀ g, Nonempty (ι g)] [Fintype κ] (μ : Measure Ω)
    [IsProbabilityMeasure μ] {N : ℕ} (hN : 0 < N) (U : ∀ g, ι g → κ → Ω → ℝ)
    (hlaw : ∀ g t c, IdentDistrib (U g t c) id μ (gridCell N))
    (hindep : ∀ g t, iIndepFun (U g t) μ) (k : ∀ g, ι g → κ → ℝ) (d β : ∀ g, ι g → ℝ)
    (hd : ∀ g t, |d g t| ≤ β g t) {δloc δreq : ℝ} (hδ : 0 < δloc)
    (hδS : ∀ g, δloc ≤ 2 * (Fintype.card (ι g) : ℝ))
    (hbudget : (Fintype.card γ : ℝ) * δloc ≤ δreq) :
    μ {ω | ∃ g, ∃ t, tierBRadius (∑ c, k g t c ^ 2 / 12) (Fintype.card (ι g)) δloc + β g t
        < |d g t + ∑ c, k g t c * U g t c ω|} ≤ ENNReal.ofReal δreq := by
  have hsub : {ω | ∃ g, ∃ t, tierBRadius (∑ c, k g t c ^ 2 / 12) (Fintype.card (ι g)) δloc
        + β g t < |d g t + ∑ c, k g t c * U g t c ω|}
      ⊆ ⋃ g, {ω | ∃ t, tierBRadius (∑ c, k g t c ^ 2 / 12) (Fintype.card (ι g)) δloc + β g t
        < |d g t + ∑ c, k g t c * U g t c ω|} := by
    intro ω hω
    rw [Set.mem_setOf_eq] at hω
    obtain ⟨g, hg⟩ := hω
    exact Set.mem_iUnion.mpr ⟨g, hg⟩
  have hcard : ENNReal.ofReal (Fintype.card γ : ℝ) = (Fintype.card γ : ℝ≥0∞) :=
    ENNReal.ofReal_natCast (Fintype.card γ)
  have hbudget' : (Fintype.card γ : ℝ≥0∞) * ENNReal.ofReal δloc ≤ ENNReal.ofReal δreq :=
    calc (Fintype.card γ : ℝ≥0∞) * ENNReal.ofReal δloc
        = ENNReal.ofReal (Fintype.card γ) * ENNReal.ofReal δloc := by
          rw [hcard]
      _ = ENNReal.ofReal ((Fintype.card γ : ℝ) * δloc) :=
          (ENNReal.ofReal_mul (Nat.cast_nonneg _)).symm
      _ ≤ ENNReal.ofReal δreq := ENNReal.ofReal_le_ofReal hbudget
  calc μ {ω | ∃ g, ∃ t, tierBRadius (∑ c, k g t c ^ 2 / 12) (Fintype.card (ι g)) δloc + β g t
        < |d g t + ∑ c, k g t c * U g t c ω|}
      ≤ μ (⋃ g, {ω | ∃ t, tierBRadius (∑ c, k g t c ^ 2 / 12) (Fintype.card (ι g)) δloc
        + β g t < |d g t + ∑ c, k g t c * U g t c ω|}) := measure_mono hsub
    _ ≤ ENNReal.ofReal δreq :=
        measure_iUnion_le_budget μ _
          (fun g => tier_b_radius μ hN (U g) (hlaw g) (hindep g) (k g) (d g) (β g) (hd g) hδ
            (hδS g))
          hbudget'

end WitCert
