import Mathlib.Algebra.Module.LinearMap.Defs
import Mathlib.Analysis.Real.Sqrt
import Mathlib.Tactic.Linarith
import Mathlib.Tactic.Ring
import WitCert.Bands

/-!
# Lemma 1 in floating point: band norms after a rounded rotation

Lemma 1 (`WitCert.band_norm_rotate`, registry key `L1`) holds for the exact rotation. A RoPE
computed in floating point rotates a key `x` of one band into `M x + dx`: `M` is the pairwise
matrix `[[c, -s], [s, c]]` built from the cosine and sine values the arithmetic actually uses
(a rotation scaled by `√(c² + s²)`, which rounding puts near but not at 1) and `dx` is the
rounding of the products and sums. The exact key `y` and the compressed key `x` of one token
are rotated at the same position, hence by the same `M`, so the residual after the rounded
rotation is bounded by the scaled residual before it plus the two roundings (registry key
`L1fp`). Every term on the right is a band norm of an unrotated vector or a bound on a
rounding, so a witness built from it does not depend on the position.

Which floating-point arithmetic gives which `η` and which bound on `‖dx‖` is a rounding-error
analysis (`witcert/tier_a/rotary.py`), checked against an exact oracle, not a Lean statement.

## Main definitions

* `WitCert.scaledRotX`, `WitCert.scaledRotY`: the pairwise map with entries `c j`, `s j`.

## Main statements

* `WitCert.bandNorm_add_le`, `WitCert.bandNorm_sub_le`: the triangle inequality for `bandNorm`.
* `WitCert.band_norm_sub_le_of_rounded_rotation` (`L1fp`):
  `‖x' - y'‖ ≤ (1 + η) ‖x - y‖ + ‖dx‖ + ‖dy‖` for `x' = M x + dx`, `y' = M y + dy`, `M` linear
  with `‖M v‖ ≤ (1 + η) ‖v‖`.
* `WitCert.rounded_rotation_witness`: the same with a stored witness `‖x - y‖ ≤ w` and bounds
  on the two roundings.
* `WitCert.pairBandNorm_scaledRot_le`: the pairwise map with `c j ^ 2 + s j ^ 2 ≤ ρ ^ 2`
  scales every band norm by at most `ρ` (the hypothesis on `M` above, with `ρ = 1 + η`).
-/

noncomputable section

namespace WitCert

section Triangle

variable {κ : Type*} [Fintype κ]

/-- A band norm is nonnegative. -/
theorem bandNorm_nonneg (v : κ → ℝ) : 0 ≤ bandNorm v := Real.sqrt_nonneg _

/-- The square of a band norm is the sum of squares. -/
theorem bandNorm_sq (v : κ → ℝ) : bandNorm v ^ 2 = ∑ k, v k ^ 2 :=
  Real.sq_sqrt (Finset.sum_nonneg fun k _ => sq_nonneg (v k))

/-- Negating a band leaves its norm unchanged. -/
theorem bandNorm_neg (v : κ → ℝ) : bandNorm (-v) = bandNorm v := by
  simp only [bandNorm, Pi.neg_apply, neg_sq]

/-- The triangle inequality for band norms (Minkowski, from Cauchy–Schwarz). -/
theorem bandNorm_add_le (u v : κ → ℝ) : bandNorm (u + v) ≤ bandNorm u + bandNorm v := by
  have hcs : ∑ k, u k * v k ≤ bandNorm u * bandNorm v :=
    Real.sum_mul_le_sqrt_mul_sqrt Finset.univ u v
  have hexp : ∑ k, (u + v) k ^ 2 = ∑ k, u k ^ 2 + 2 * ∑ k, u k * v k + ∑ k, v k ^ 2 := by
    have hterm : ∑ k, (u + v) k ^ 2 = ∑ k, (u k ^ 2 + 2 * (u k * v k) + v k ^ 2) :=
      Finset.sum_congr rfl fun k _ => by
        simp only [Pi.add_apply]
        ring
    rw [hterm, Finset.sum_add_distrib, Finset.sum_add_distrib, ← Finset.mul_sum]
  have hsq : ∑ k, (u + v) k ^ 2 ≤ (bandNorm u + bandNorm v) ^ 2 :=
    calc ∑ k, (u + v) k ^ 2
        = bandNorm u ^ 2 + 2 * ∑ k, u k * v k + bandNorm v ^ 2 := by
          rw [hexp, bandNorm_sq u, bandNorm_sq v]
      _ ≤ bandNorm u ^ 2 + 2 * (bandNorm u * bandNorm v) + bandNorm v ^ 2 := by linarith [hcs]
      _ = (bandNorm u + bandNorm v) ^ 2 := by ring
  calc bandNorm (u + v) = Real.sqrt (∑ k, (u + v) k ^ 2) := rfl
    _ ≤ Real.sqrt ((bandNorm u + bandNorm v) ^ 2) := Real.sqrt_le_sqrt hsq
    _ = bandNorm u + bandNorm v :=
        Real.sqrt_sq (add_nonneg (bandNorm_nonneg u) (bandNorm_nonneg v))

/-- The norm of a difference is at most the sum of the norms. -/
theorem bandNorm_sub_le (u v : κ → ℝ) : bandNorm (u - v) ≤ bandNorm u + bandNorm v :=
  calc bandNorm (u - v) = bandNorm (u + -v) := by rw [sub_eq_add_neg]
    _ ≤ bandNorm u + bandNorm (-v) := bandNorm_add_le u (-v)
    _ = bandNorm u + bandNorm v := by rw [bandNorm_neg]

end Triangle

section RoundedRotation

variable {κ : Type*} [Fintype κ]

/-- **Lemma 1 in floating point (`L1fp`).** If both keys of a band are mapped by the same
linear `M` with `‖M v‖ ≤ (1 + η) ‖v‖` and then perturbed by their roundings `dx`, `dy`, the
residual after the map is at most `(1 + η)` times the residual before it plus both roundings. -/
theorem band_norm_sub_le_of_rounded_rotation (M : (κ → ℝ) →ₗ[ℝ] (κ → ℝ)) (η : ℝ)
    (hM : ∀ v, bandNorm (M v) ≤ (1 + η) * bandNorm v) (x y dx dy x' y' : κ → ℝ)
    (hx : x' = M x + dx) (hy : y' = M y + dy) :
    bandNorm (x' - y') ≤ (1 + η) * bandNorm (x - y) + bandNorm dx + bandNorm dy := by
  have hsplit : x' - y' = M (x - y) + (dx - dy) := by
    rw [hx, hy, map_sub]
    abel
  calc bandNorm (x' - y') = bandNorm (M (x - y) + (dx - dy)) := by rw [hsplit]
    _ ≤ bandNorm (M (x - y)) + bandNorm (dx - dy) := bandNorm_add_le _ _
    _ ≤ (1 + η) * bandNorm (x - y) + (bandNorm dx + bandNorm dy) :=
        add_le_add (hM (x - y)) (bandNorm_sub_le dx dy)
    _ = (1 + η) * bandNorm (x - y) + bandNorm dx + bandNorm dy := by ring

/-- The stored form of `L1fp`: a witness `w ≥ ‖x - y‖` of the unrotated residual and bounds
`ex ≥ ‖dx‖`, `ey ≥ ‖dy‖` on the roundings give `‖x' - y'‖ ≤ (1 + η) w + ex + ey`. -/
theorem rounded_rotation_witness (M : (κ → ℝ) →ₗ[ℝ] (κ → ℝ)) (η : ℝ) (hη : 0 ≤ 1 + η)
    (hM : ∀ v, bandNorm (M v) ≤ (1 + η) * bandNorm v) (x y dx dy x' y' : κ → ℝ)
    (hx : x' = M x + dx) (hy : y' = M y + dy) (w ex ey : ℝ)
    (hw : bandNorm (x - y) ≤ w) (hdx : bandNorm dx ≤ ex) (hdy : bandNorm dy ≤ ey) :
    bandNorm (x' - y') ≤ (1 + η) * w + ex + ey := by
  have h1 := band_norm_sub_le_of_rounded_rotation M η hM x y dx dy x' y' hx hy
  have h2 : (1 + η) * bandNorm (x - y) ≤ (1 + η) * w := mul_le_mul_of_nonneg_left hw hη
  linarith

end RoundedRotation

section ScaledRotation

variable {P : Type*}

/-- First coordinate of pair `j` under the pairwise map `[[c j, -s j], [s j, c j]]`. -/
def scaledRotX (c s x y : P → ℝ) (j : P) : ℝ := c j * x j - s j * y j

/-- Second coordinate of pair `j` under the pairwise map `[[c j, -s j], [s j, c j]]`. -/
def scaledRotY (c s x y : P → ℝ) (j : P) : ℝ := s j * x j + c j * y j

variable [Fintype P]

/-- The computed rotation scales band norms by at most `ρ` when every pair's cosine and sine
values satisfy `c j ^ 2 + s j ^ 2 ≤ ρ ^ 2` (for `ρ = 1 + η`: the hypothesis on `M` in `L1fp`). -/
theorem pairBandNorm_scaledRot_le (c s x y : P → ℝ) (ρ : ℝ) (hρ : 0 ≤ ρ)
    (hcs : ∀ j, c j ^ 2 + s j ^ 2 ≤ ρ ^ 2) :
    pairBandNorm (scaledRotX c s x y) (scaledRotY c s x y) ≤ ρ * pairBandNorm x y := by
  have hsum : ∑ j, (scaledRotX c s x y j ^ 2 + scaledRotY c s x y j ^ 2)
      ≤ ρ ^ 2 * ∑ j, (x j ^ 2 + y j ^ 2) := by
    rw [Finset.mul_sum]
    refine Finset.sum_le_sum fun j _ => ?_
    have hid : scaledRotX c s x y j ^ 2 + scaledRotY c s x y j ^ 2
        = (c j ^ 2 + s j ^ 2) * (x j ^ 2 + y j ^ 2) := by
      unfold scaledRotX scaledRotY
      ring
    rw [hid]
    exact mul_le_mul_of_nonneg_right (hcs j) (add_nonneg (sq_nonneg _) (sq_nonneg _))
  calc pairBandNorm (scaledRotX c s x y) (scaledRotY c s x y)
      = Real.sqrt (∑ j, (scaledRotX c s x y j ^ 2 + scaledRotY c s x y j ^ 2)) := rfl
    _ ≤ Real.sqrt (ρ ^ 2 * ∑ j, (x j ^ 2 + y j ^ 2)) := Real.sqrt_le_sqrt hsum
    _ = ρ * Real.sqrt (∑ j, (x j ^ 2 + y j ^ 2)) := by
        rw [Real.sqrt_mul (sq_nonneg ρ), Real.sqrt_sq hρ]
    _ = ρ * pairBandNorm x y := rfl

end ScaledRotation

end WitCert

end
