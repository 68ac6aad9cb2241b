import WitCert.DitherGrid
import Mathlib.MeasureTheory.Integral.Bochner.Basic
import Mathlib.MeasureTheory.Integral.IntegrableOn
import Mathlib.MeasureTheory.Measure.Dirac
import Mathlib.Probability.Independence.Basic
import Mathlib.Probability.Moments.SubGaussian
import Mathlib.Tactic.FunProp

/-!
# The dither model as probability laws, and the sub-Gaussian channel sum

Tier B's only probabilistic assumption is the law of the dither residual, in units of the
quantization step: each component is uniform on the cell, and the components of one token are
independent. Two laws are provided:

* `WitCert.unitCell`: the continuous uniform law on `(-1/2, 1/2]` (Lebesgue measure on a set of
  measure one);
* `WitCert.gridCell N`: the implementation's law, mass `1/N` on each of the `N` grid points
  `WitCert.gridPoint N j` (the dither of `witcert.tier_b.dither` has `N = 2^24`).

Both have sub-Gaussian moment generating function with proxy `1/12` (`WitCert.cellProxy`):
Lemma 2 (`WitCert.uniform_mgf_le` with `a = 1/2`) for the first, its grid form
(`WitCert.grid_mgf_le`) for the second. Scaling by the query coefficients (`const_mul`) and
summing independent channels (`HasSubgaussianMGF.sum_of_iIndepFun`) gives proxy
`∑_c k_c² / 12` for the logit error's random part `∑_c k_c U_c`.

## Main definitions

* `WitCert.cellProxy`: the proxy `1/12` as a nonnegative real.
* `WitCert.unitCell`, `WitCert.gridCell`: the two laws of a residual component.

## Main statements

* `WitCert.integral_range_sum_dirac`: integrals against `∑_{j < n} δ_{g j}`.
* `WitCert.unitCell_hasSubgaussianMGF`, `WitCert.gridCell_hasSubgaussianMGF`: proxy `1/12`.
* `WitCert.hasSubgaussianMGF_sum_mul`: independent components of proxy `1/12` give
  `∑_c k_c U_c` the proxy `∑_c k_c² / 12` (`WitCert.coe_proxy_sum`).
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

namespace WitCert

/-- The sub-Gaussian proxy `1/12` of a residual component (the variance of `U[-1/2, 1/2]`). -/
noncomputable def cellProxy : ℝ≥0 := ⟨1 / 12, by norm_num⟩

/-- The proxy as a real number. -/
theorem coe_cellProxy : (cellProxy : ℝ) = 1 / 12 := rfl

/-- The continuous uniform law of a residual component: Lebesgue measure on the cell
`(-1/2, 1/2]` (a set of measure one; the endpoint is a null set). -/
noncomputable def unitCell : Measure ℝ := volume.restrict (Set.Ioc (-(1 / 2)) (1 / 2))

/-- The implementation's law of a residual component: mass `1/N` on each grid point
`WitCert.gridPoint N j`, `j < N`. -/
noncomputable def gridCell (N : ℕ) : Measure ℝ :=
  (N : ℝ≥0∞)⁻¹ • ∑ j ∈ Finset.range N, Measure.dirac (gridPoint N j)

/-- **Lemma 2 as a law.** `U[-1/2, 1/2]` has sub-Gaussian MGF with proxy `1/12`. -/
theorem unitCell_hasSubgaussianMGF : HasSubgaussianMGF id cellProxy unitCell := by
  refine ⟨fun t => ?_, fun t => ?_⟩
  · show Integrable (fun x : ℝ => Real.exp (t * x)) (volume.restrict (Set.Ioc (-(1 / 2)) (1 / 2)))
    have hcont : Continuous fun x : ℝ => Real.exp (t * x) := by fun_prop
    -- `IntegrableOn f s μ` is by definition `Integrable f (μ.restrict s)`, the goal above
    have hon : IntegrableOn (fun x : ℝ => Real.exp (t * x)) (Set.Ioc (-(1 / 2)) (1 / 2)) volume :=
      hcont.integrableOn_Ioc
    exact hon
  · show ∫ x in Set.Ioc (-(1 / 2) : ℝ) (1 / 2), Real.exp (t * x)
        ≤ Real.exp ((cellProxy : ℝ) * t ^ 2 / 2)
    rw [← intervalIntegral.integral_of_le (show (-(1 / 2) : ℝ) ≤ 1 / 2 by norm_num)]
    have h := uniform_mgf_le (a := 1 / 2) (by norm_num) t
    rw [show (1 : ℝ) / (2 * (1 / 2)) = 1 by norm_num, one_mul] at h
    calc ∫ x in (-(1 / 2) : ℝ)..(1 / 2), Real.exp (t * x)
        ≤ Real.exp (t ^ 2 * (1 / 2) ^ 2 / 6) := h
      _ = Real.exp ((cellProxy : ℝ) * t ^ 2 / 2) := by
        rw [coe_cellProxy]
        congr 1
        ring

/-- Integrals against a finite sum of Dirac masses, by induction on the number of masses (only
`Integrable.add_measure`, `integral_add_measure` and `integral_dirac` are used): every function
is integrable against `∑_{j < n} δ_{g j}`, and its integral is `∑_{j < n} f (g j)`. -/
theorem integral_range_sum_dirac (g : ℕ → ℝ) (f : ℝ → ℝ) : ∀ n : ℕ,
    Integrable f (∑ j ∈ Finset.range n, Measure.dirac (g j)) ∧
      ∫ x, f x ∂(∑ j ∈ Finset.range n, Measure.dirac (g j)) = ∑ j ∈ Finset.range n, f (g j)
  | 0 => by
    -- the empty sums, of measures and of reals, as stated equations (each `Finset.sum` and its
    -- `AddCommMonoid` instance elaborated here, so the rewrites match them syntactically)
    have hmeasure : (∑ j ∈ Finset.range 0, Measure.dirac (g j)) = 0 :=
      Finset.sum_range_zero fun j => Measure.dirac (g j)
    have hreal : ∑ j ∈ Finset.range 0, f (g j) = 0 := Finset.sum_range_zero fun j => f (g j)
    rw [hmeasure, hreal]
    exact ⟨integrable_zero_measure, integral_zero_measure f⟩
  | n + 1 => by
    obtain ⟨hint, heq⟩ := integral_range_sum_dirac g f n
    -- against one Dirac mass, `f` equals the constant `f (g n)` almost everywhere
    have hconst : Integrable (fun _ : ℝ => f (g n)) (Measure.dirac (g n)) :=
      integrable_const (f (g n))
    have hae : (fun _ : ℝ => f (g n)) =ᵐ[Measure.dirac (g n)] f := (ae_eq_dirac f).symm
    have hd : Integrable f (Measure.dirac (g n)) := hconst.congr hae
    -- one more mass: the two `Finset.sum_range_succ` steps as stated equations
    have hmeasure : (∑ j ∈ Finset.range (n + 1), Measure.dirac (g j))
        = (∑ j ∈ Finset.range n, Measure.dirac (g j)) + Measure.dirac (g n) :=
      Finset.sum_range_succ (fun j => Measure.dirac (g j)) n
    have hreal : ∑ j ∈ Finset.range (n + 1), f (g j) = ∑ j ∈ Finset.range n, f (g j) + f (g n) :=
      Finset.sum_range_succ (fun j => f (g j)) n
    have hsplit : ∫ x, f x ∂((∑ j ∈ Finset.range n, Measure.dirac (g j)) + Measure.dirac (g n))
        = ∫ x, f x ∂(∑ j ∈ Finset.range n, Measure.dirac (g j))
          + ∫ x, f x ∂(Measure.dirac (g n)) :=
      integral_add_measure hint hd
    have hpoint : ∫ x, f x ∂(Measure.dirac (g n)) = f (g n) := integral_dirac f (g n)
    rw [hmeasure, hreal]
    exact ⟨hint.add_measure hd, by rw [hsplit, heq, hpoint]⟩

/-- **Lemma 2 on the grid, as a law.** The uniform law on the `N` grid points has sub-Gaussian MGF
with proxy `1/12`. -/
theorem gridCell_hasSubgaussianMGF {N : ℕ} (hN : 0 < N) :
    HasSubgaussianMGF id cellProxy (gridCell N) := by
  have hc : (N : ℝ≥0∞)⁻¹ ≠ ∞ := ENNReal.inv_ne_top.mpr (Nat.cast_ne_zero.mpr hN.ne')
  refine ⟨fun t => ?_, fun t => ?_⟩
  · show Integrable (fun x : ℝ => Real.exp (t * x))
      ((N : ℝ≥0∞)⁻¹ • ∑ j ∈ Finset.range N, Measure.dirac (gridPoint N j))
    exact (integral_range_sum_dirac (gridPoint N) (fun x => Real.exp (t * x)) N).1.smul_measure hc
  · -- the moment generating function of the scaled sum of masses, through Mathlib's
    -- `mgf_smul_measure` (real-valued: no scalar action on `ℝ` appears in this proof) and the
    -- finite sum above (`mgf id μ t` is by definition `∫ x, exp (t * id x) ∂μ`)
    have hscale : mgf id (gridCell N) t
        = ((N : ℝ≥0∞)⁻¹).toReal
          * mgf id (∑ j ∈ Finset.range N, Measure.dirac (gridPoint N j)) t :=
      mgf_smul_measure ((N : ℝ≥0∞)⁻¹)
    have hsum : mgf id (∑ j ∈ Finset.range N, Measure.dirac (gridPoint N j)) t
        = ∑ j ∈ Finset.range N, Real.exp (t * gridPoint N j) :=
      (integral_range_sum_dirac (gridPoint N) (fun x => Real.exp (t * x)) N).2
    -- the cast `ℕ → ℝ≥0∞` of `gridCell` named by a stated equation elaborated here
    have hcast : ((N : ℝ≥0∞)).toReal = (N : ℝ) := ENNReal.toReal_natCast N
    have hinv : ((N : ℝ≥0∞)⁻¹).toReal = (N : ℝ)⁻¹ := by rw [ENNReal.toReal_inv, hcast]
    calc mgf id (gridCell N) t
        = (N : ℝ)⁻¹ * ∑ j ∈ Finset.range N, Real.exp (t * gridPoint N j) := by
          rw [hscale, hsum, hinv]
      _ ≤ Real.exp (t ^ 2 / 24) := grid_mgf_le hN t
      _ = Real.exp ((cellProxy : ℝ) * t ^ 2 / 2) := by
        rw [coe_cellProxy]
        congr 1
        ring

/-- The proxy of `∑_c k_c U_c`, as a real number: `∑_c k_c² * (1/12) = ∑_c k_c² / 12`. -/
theorem coe_proxy_sum {κ : Type*} [Fintype κ] (k : κ → ℝ) :
    ((∑ c, (⟨k c ^ 2, sq_nonneg (k c)⟩ : ℝ≥0) * cellProxy : ℝ≥0) : ℝ) = ∑ c, k c ^ 2 / 12 := by
  rw [NNReal.coe_sum]
  refine Finset.sum_congr rfl fun c _ => ?_
  rw [NNReal.coe_mul, NNReal.coe_mk, coe_cellProxy]
  ring

/-- **The channel sum.** If the components `U c` of one token are independent and each has
sub-Gaussian MGF with proxy `1/12`, then for fixed (non-random) coefficients `k c` the random
part of the logit error, `∑_c k c * U c`, has sub-Gaussian MGF with proxy `∑_c k_c² / 12`
(`WitCert.coe_proxy_sum`). -/
theorem hasSubgaussianMGF_sum_mul {Ω κ : Type*} [MeasurableSpace Ω] [Fintype κ]
    {μ : Measure Ω} {U : κ → Ω → ℝ} (hindep : iIndepFun U μ)
    (hU : ∀ c, HasSubgaussianMGF (U c) cellProxy μ) (k : κ → ℝ) :
    HasSubgaussianMGF (fun ω => ∑ c, k c * U c ω)
      (∑ c, (⟨k c ^ 2, sq_nonneg (k c)⟩ : ℝ≥0) * cellProxy) μ := by
  have hind : iIndepFun (fun c ω => k c * U c ω) μ :=
    hindep.comp (fun c x => k c * x) fun c => measurable_id.const_mul (k c)
  exact HasSubgaussianMGF.sum_of_iIndepFun hind fun c _ => (hU c).const_mul (k c)

end WitCert
