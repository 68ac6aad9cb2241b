import Mathlib.Analysis.SpecialFunctions.Exp

/-!
# Definitions: total variation and the reweighted attention distribution

Fix one (layer, head, decode step) with finitely many cached tokens `ι`. `pt` is the attention
distribution computed from compressed keys (`p̃`), `eps t` the logit error of token `t` and `c t`
any bound with `|eps t| ≤ c t`. The exact distribution is `p t = p̃ t * exp (-eps t) / Z` with
`Z = ∑ t, p̃ t * exp (-eps t)` (docs/design.md "Notation").

## Main definitions

* `WitCert.tv`: total variation `1/2 * ∑ t, |p t - q t|`.
* `WitCert.massExp`: the e-form mass `A = ∑ t, p̃ t * exp (c t)`.
* `WitCert.partition`: the partition function `Z = ∑ t, p̃ t * exp (-eps t)`.
* `WitCert.massExpNeg`: `A⁻ = ∑ t, p̃ t * exp (-c t)`, the partition function at `eps = c`.
* `WitCert.reweight`: the exact distribution `p`.

Statements about these objects live in `WitCert.Reweight`, `WitCert.EForm`, `WitCert.TwoSided`
and `WitCert.MaxNorm`.
-/

noncomputable section

namespace WitCert

variable {ι : Type*} [Fintype ι]

/-- Total variation distance between two weight vectors: `1/2 * ∑ t, |p t - q t|`. -/
def tv (p q : ι → ℝ) : ℝ := 1 / 2 * ∑ t, |p t - q t|

/-- The e-form mass `A = ∑ t, p̃ t * exp (c t)`. -/
def massExp (pt c : ι → ℝ) : ℝ := ∑ t, pt t * Real.exp (c t)

/-- The partition function `Z = ∑ t, p̃ t * exp (-eps t)`. -/
def partition (pt eps : ι → ℝ) : ℝ := ∑ t, pt t * Real.exp (-eps t)

/-- The lower mass `A⁻ = ∑ t, p̃ t * exp (-c t)`: the partition function at `eps = c`. -/
def massExpNeg (pt c : ι → ℝ) : ℝ := partition pt c

/-- The exact attention distribution `p t = p̃ t * exp (-eps t) / Z`. -/
def reweight (pt eps : ι → ℝ) (t : ι) : ℝ := pt t * Real.exp (-eps t) / partition pt eps

end WitCert

end
