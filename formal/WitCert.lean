import WitCert.Core
import WitCert.Defs
import WitCert.Reweight
import WitCert.EForm
import WitCert.TwoSided
import WitCert.MaxNorm
import WitCert.Dither
import WitCert.DitherGrid
import WitCert.DitherLaw
import WitCert.Budget
import WitCert.Refinement
import WitCert.Bands
import WitCert.RotationRounding
import WitCert.TierB
import WitCert.DeterministicBranch
import WitCert.ChiSquare
import WitCert.MassSplit
import WitCert.WitnessMaintenance
import WitCert.SpotCheck
import WitCert.UnionBound
import WitCert.SpotRounds
import WitCert.RequestAudit
import WitCert.WitnessCodes
import WitCert.QueryRadius
import WitCert.DerivedWitness

/-!
# WitCert: the statements the runtime meter relies on

Every declaration named in `spec/registry.py` (and in `docs/theorem_map.md`) is proved in one of
the files imported here. `formal/Export.lean` prints their statements and the axioms they use.

## Main statements

* `WitCert.tv_le_eform` (T1), `WitCert.tv_le_two_sided` (P1), `WitCert.tv_le_retention` (P1r),
  `WitCert.tv_le_tanh_half` (max-norm), `WitCert.tanh_half_le_tanh` (competitor shape).
* `WitCert.band_norm_rotate` (Lemma 1), `WitCert.abs_inner_le_sum_band_norms` (Theorem 2).
* `WitCert.band_norm_sub_le_of_rounded_rotation` (Lemma 1 in floating point: a rounded rotation).
* `WitCert.bandNorm_sub_le_add_of_le` (witness maintenance: a witness after a re-quantization).
* `WitCert.band_norm_le_of_abs_le` (a witness derived from elementwise error bounds).
* `WitCert.sinh_le_mul_exp_sq_div_six`, `WitCert.uniform_mgf_le`, `WitCert.uniform_variance`
  (Lemma 2).
* `WitCert.grid_mgf_le` (Lemma 2 on the implementation's dither grid),
  `WitCert.unitCell_hasSubgaussianMGF`, `WitCert.gridCell_hasSubgaussianMGF` (the dither laws),
  `WitCert.hasSubgaussianMGF_sum_mul` (independent channels).
* `WitCert.measure_iUnion_le_budget` (Lemma 3).
* `WitCert.tier_b_radius` (Theorem 3, from the grid dither model: independent components,
  uniform on the grid, fixed query), `WitCert.tier_b_radius_continuous` (continuous uniform
  model), `WitCert.tier_b_request` (over the cells of a request).
* `WitCert.block_sum_eq_token_sum`, `WitCert.massExp_merge` (Lemma 4).
* `WitCert.abs_logit_error_le_deterministic`, `WitCert.abs_logit_error_le_probabilistic` (Tier B
  with the rounding of the keys attention reads).
* `WitCert.tv_le_spot_identity` (the spot check's deterministic inequality, any `z > 0`),
  `WitCert.sum_step_allocation_le` (its per-step budget for open-ended generation).
* `WitCert.measure_iUnion_le_of_tsum_le`, `WitCert.measure_iUnion_le_of_sum_le` (union bounds
  against a budget), `WitCert.measure_iUnion_steps_le` (the spot check's request budget over an
  open-ended generation).
* `WitCert.measure_selected_lt_le` (adaptive spot-check rounds), with the splits
  `WitCert.measure_selected_lt_le_uniform` and `WitCert.measure_selected_lt_le_zeta`.
* `WitCert.measure_audit_le` (the request audit), `WitCert.auditUpper_mono`,
  `WitCert.measure_cdf_lt_le` (super-uniformity of a discrete cdf).
* `WitCert.tv_le_eform_of_rounded_witness`, `WitCert.bandBound_mono`, `WitCert.eform_meter_mono`
  (witness codes rounded up).
* `WitCert.abs_logit_error_le_query_radius` (a quantized query).
-/
