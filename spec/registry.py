"""The theorem registry: one row per statement the meter relies on (docs/design.md "Verification chain").

Each row ties the paper item to its Lean declaration (``formal/``), the executable spec
mirror (``spec/``), the torch implementation (``witcert/``), the Triton kernel
(``kernels/``) and the tests that check it. ``tests/test_registry.py`` keeps this file in
sync with ``formal/`` and with the Python objects it names; ``docs/theorem_map.md`` is
generated from it.

Fields hold dotted names (``module:attribute`` is not used; the last dot splits module and
attribute). ``lean`` is ``None`` only for statements that are not theorems (the known-false
form) and then ``note`` says why. ``lean_checks`` says which checks the Lean declaration has
passed: ``STATIC_CHECK`` (``scripts/lean_check.sh`` without a toolchain: the audit and the check
against the pinned Mathlib, run by CI on every commit) and, once a forge run of
``.github/workflows/lean.yml`` has built it, ``FORGE_BUILD``; a row without ``FORGE_BUILD`` has
never been compiled.
"""
from dataclasses import dataclass, field

STATIC_CHECK = "static check (here)"
FORGE_BUILD = "lake build on a forge (workflow)"


@dataclass(frozen=True)
class Theorem:
    """One registered statement and every place that serves it."""

    key: str  # short id used in docstrings and test names
    paper: str  # where the paper states it
    statement: str  # one line, clean notation (docs/design.md "Mathematics")
    lean: str | None  # fully qualified Lean declaration in formal/
    spec: str | None  # dotted name of the spec mirror (witcert.spec...)
    torch: str | None  # dotted name of the torch implementation
    kernel: str | None  # dotted name of the Triton kernel entry point, or None ("none yet")
    tests: tuple[str, ...] = field(default_factory=tuple)  # test files that check it
    note: str = ""
    lean_checks: tuple[str, ...] = (STATIC_CHECK,)  # checks the Lean declaration has passed


THEOREMS: tuple[Theorem, ...] = (
    Theorem(
        key="T1",
        paper="Theorem 1 (e-form)",
        statement="|eps_t| <= c_t  =>  TV(p, p~) <= 1/2 (A^2 - 1),  A = sum_t p~_t e^{c_t}",
        lean="WitCert.tv_le_eform",
        note='Lemmas: `WitCert.one_le_massExp`, `WitCert.partition_le_massExp`, `WitCert.one_le_massExp_mul_partition`, `WitCert.partition_pos`, `WitCert.ratio_mem_eform`.',
        spec="witcert.spec.bounds.bound_eform",
        torch="witcert.core.bounds.eform_bound",
        kernel="witcert.kernels.decode_attention.decode_attention",
        tests=("tests/test_spec_bounds.py", "tests/test_meter.py", "tests/test_fuzz.py"),
    ),
    Theorem(
        key="P1",
        paper="Proposition 1 (two-sided)",
        statement="TV(p, p~) <= 1/2 (A/A- - A-/A),  A- = sum_t p~_t e^{-c_t}",
        lean="WitCert.tv_le_two_sided",
        note='Pointwise form `WitCert.abs_exp_neg_sub_partition_le_two_sided`; `WitCert.massExpNeg_le_partition`.',
        spec="witcert.spec.bounds.bound_two_sided",
        torch="witcert.core.bounds.two_sided_bound",
        kernel="witcert.kernels.decode_attention.decode_attention",
        tests=("tests/test_spec_bounds.py", "tests/test_meter.py", "tests/test_fuzz.py"),
    ),
    Theorem(
        key="P1r",
        paper="Proposition 1 (per-token retention form)",
        statement="TV <= 1/2 sum_t p~_t min(A e^{c_t} - 1, max(e^{c_t}/A- - 1, 1 - e^{-c_t}/A))",
        lean="WitCert.tv_le_retention",
        spec="witcert.spec.bounds.bound_retention",
        torch="witcert.core.bounds.retention_bound",
        kernel=None,
        tests=("tests/test_spec_bounds.py", "tests/test_meter.py"),
    ),
    Theorem(
        key="MN",
        paper='max-norm bound (docs/design.md "Mathematics")',
        statement="|eps_t| <= D for all t  =>  TV(p, p~) <= tanh(D/2)",
        lean="WitCert.tv_le_tanh_half",
        note='Chord of w -> |w - Z| on [e^-D, e^D] (`WitCert.mul_abs_sub_le_chord`), optimised over Z.',
        spec="witcert.spec.bounds.bound_maxnorm",
        torch="witcert.core.bounds.maxnorm_bound",
        kernel="witcert.kernels.decode_attention.decode_attention",
        tests=("tests/test_spec_bounds.py", "tests/test_meter.py", "tests/test_fuzz.py"),
    ),
    Theorem(
        key="RC",
        paper="competitor [5] Runtime-Certified shape",
        statement="tanh(D/2) <= tanh(D)  (the competitor's tanh(max c) is sound and looser)",
        lean="WitCert.tanh_half_le_tanh",
        spec="witcert.spec.bounds.bound_competitor",
        torch="witcert.core.bounds.competitor_bound",
        kernel=None,
        tests=("tests/test_spec_bounds.py",),
    ),
    Theorem(
        key="CS",
        paper='chi-square (variance) bound (beyond the paper; docs/design.md "Mathematics")',
        statement="|eps_t| <= c_t  =>  TV(p, p~) <= 1/2 sqrt(sum_t p~_t expm1(c_t)^2) / A-",
        lean="WitCert.tv_le_chi_square",
        note='kernel: one more fp32 accumulator s = sum e^y min(expm1(c\'), 2^46)^2, merged across splits like k and j; CS = inf where c\'_max > 31 (a term may have been capped); E[expm1(c)^2] <= min(e^{delta_max} s/l, expm1(D) (A - 1)) (kernels/certificate.py). torch: one more directed sum, sum p~ expm1(c)^2, in the one pass. Weighted Cauchy-Schwarz `WitCert.sq_sum_mul_le_sum_mul_sq`; centering `WitCert.sum_mul_sub_mean_sq_le`; pointwise `WitCert.abs_exp_neg_sub_one_le`.',
        spec="witcert.spec.bounds.bound_chi_square",
        torch="witcert.core.bounds.chi_square_bound",
        kernel="witcert.kernels.decode_attention.decode_attention",
        tests=("tests/test_spec_bounds.py", "tests/test_spec_chi_square_mass_split.py", "tests/test_meter.py",
               "tests/test_mass_split_buckets.py", "tests/test_fuzz.py", "tests/test_underflow.py",
               "tests/test_split_mass_attack.py", "contracts/test_four_implementations.py",
               "contracts/test_kernel_vs_reference.py", "contracts/test_soundness.py"),
    ),
    Theorem(
        key="MS",
        paper='mass-split bound (beyond the paper; docs/design.md "Mathematics")',
        statement="L = {c_t <= g}: TV <= B_L + 1/2 ((1 + delta)^2 - 1),  B_L any bound on c 1_L,  delta = sum_H p~ expm1(c) / A-(c 1_L)",
        lean="WitCert.tv_le_mass_split",
        note='kernel: none: per-bucket sums on a grid anchored at D = max c need a bucket shift in the online max and the split-KV merge; the Triton meter is min(1, T1, P1, MN, CS) (sound, never below the golden). torch: one pass, per-bucket sums (witcert.core.bounds.split_buckets) and running sums over the buckets. Any set L; first term instantiated in `WitCert.tv_le_mass_split_eform`, `WitCert.tv_le_mass_split_chi_square`, `WitCert.tv_le_mass_split_tanh_half` and `WitCert.tv_le_mass_split_min` (the spec\'s min(T1, P1, CS, MN)); two-step core `WitCert.tv_le_split`, composition `WitCert.reweight_reweight`. Default thresholds: D and the 11 largest floats (1 + r/4) 2^q below it (one pass, exact comparisons). Fast path (witcert.fastpath.budgeted_pass): four low sets of its own, {c\' <= fl32(D f)}, f = 7/8, 3/4, 1/2, 1/4, fp32 sums per set in the token loop; oracle spec.bounds.bound_mass_split_sets on the same sets (golden meter_on_sets_from_scores).',
        spec="witcert.spec.bounds.bound_mass_split",
        torch="witcert.core.bounds.mass_split_bound",
        kernel=None,
        tests=("tests/test_spec_bounds.py", "tests/test_spec_chi_square_mass_split.py", "tests/test_meter.py",
               "tests/test_mass_split_buckets.py", "tests/test_fuzz.py", "tests/test_underflow.py",
               "tests/test_split_mass_attack.py", "contracts/test_four_implementations.py", "tests/test_fastpath.py"),
    ),
    Theorem(
        key="UNSOUND",
        paper="dispersion form (known false)",
        statement="1/2 e^{2 c_max} (E|c - c_bar| + c_bar (e^{c_max} - 1)) is NOT a TV bound",
        lean=None,
        spec="witcert.spec.bounds.bound_unsound_dispersion",
        torch=None,
        kernel=None,
        tests=("tests/test_spec_bounds.py",),
        note="Kept as a known-false statement; the counterexample test shows it is violated.",
    ),
    Theorem(
        key="L1",
        paper="Lemma 1 (RoPE band invariance)",
        statement="a rotation acting within each band preserves every band norm ||r_b||",
        lean="WitCert.band_norm_rotate",
        note='Pairs are indexed abstractly, so the statement covers both pair conventions (rotate_half and interleaved).',
        spec="witcert.spec.bands.band_norms",
        torch="witcert.tier_a.witness.witness_of",
        kernel="witcert.kernels.witness_write.witness_write",
        tests=("tests/test_tier_a.py", "tests/test_schemes.py", "tests/test_pair_statistics.py"),
    ),
    Theorem(
        key="L1fp",
        paper="Lemma 1 in floating point (beyond the paper)",
        statement="x' = M x + dx, y' = M y + dy, ||M v|| <= (1+eta) ||v||  =>  ||x' - y'||_b <= (1+eta) ||x - y||_b + ||dx||_b + ||dy||_b",
        lean="WitCert.band_norm_sub_le_of_rounded_rotation",
        note='Stored form `WitCert.rounded_rotation_witness`; a computed rotation `[[c, -s], [s, c]]` with c^2 + s^2 <= (1+eta)^2 meets the hypothesis on M: `WitCert.pairBandNorm_scaledRot_le`. The constants (eta = 8u, kappa = 3u, alpha0 = 4 sigma of the RoPE dtype; witcert/tier_a/rotary.py) are a floating-point error analysis, checked against HF Llama\'s rotary code and an exact rounding emulation, not a Lean theorem. Used by `witness_of(..., rope_dtype=...)` for a witness stored before RoPE.',
        spec="witcert.spec.bands.bound_rounded_rotation",
        torch="witcert.tier_a.rotary.rounded_rotation_witness",
        kernel=None,
        tests=("tests/test_rope_rounding.py", "tests/test_tier_a.py"),
    ),
    Theorem(
        key="WM",
        paper="witness maintenance under re-quantization (beyond the paper)",
        statement="||x^_old - x||_b <= w_b  =>  ||x^_new - x||_b <= w_b + ||x^_new - x^_old||_b",
        lean="WitCert.bandNorm_sub_le_add_of_le",
        note='Triangle inequality on band norms (`WitCert.bandNorm_add_le`). Over a chain of re-quantizations: `WitCert.bandNorm_sub_le_add_sum`; with Theorem 2: `WitCert.abs_inner_div_sqrt_le_maintained`. A token held exactly until its quantization (w = 0, x^_old = x) gets its exact witness. Keeps Tier A sound for caches that re-quantize (transformers QuantizedCache: witcert.integrations.hf.quantized_cache) and for streaming caches with an exact window (witcert.schemes.streaming). The fp16 upward rounding of the sum is the implementation\'s (witcert/tier_a/maintenance.py), checked against the fp64 and mpmath oracles, not a Lean statement.',
        spec="witcert.spec.maintenance.bound_maintained_witness",
        torch="witcert.tier_a.maintenance.maintained_witness",
        kernel=None,
        tests=("tests/test_witness_maintenance.py", "tests/test_quantized_cache.py", "tests/test_streaming.py"),
    ),
    Theorem(
        key="T2",
        paper="Theorem 2 (band Cauchy-Schwarz witness)",
        statement="|q.r| <= sum_b ||q_b|| ||r_b||,  so c_t = (1/sqrt d) sum_b ||q_b|| w_{t,b} >= |eps_t|",
        lean="WitCert.abs_inner_le_sum_band_norms",
        note='Witness corollary `WitCert.abs_inner_div_sqrt_le_witness` (|q.r|/sqrt d <= sum_b ||q_b|| w_b / sqrt d).',
        spec="witcert.spec.bands.bound_band_witness",
        torch="witcert.tier_a.witness.logit_bound",
        kernel="witcert.kernels.decode_attention.decode_attention",
        tests=("tests/test_tier_a.py", "tests/test_schemes.py", "tests/test_observe.py"),
    ),
    Theorem(
        key="MW",
        paper='witness storage rounded up (beyond the paper; docs/design.md "Tier A: the band witness")',
        statement="||r_{t,b}|| <= w_{t,b} <= w'_{t,b}  =>  TV(p, p~) <= 1/2 (A'^2 - 1),  A' = sum_t p~_t e^{c'_t},  c'_t = (1/sqrt d) sum_b ||q_b|| w'_{t,b}",
        lean="WitCert.tv_le_eform_of_rounded_witness",
        note="The band bound and T1's meter are monotone in the witness (`WitCert.bandBound_mono`, `WitCert.massExp_mono`, `WitCert.eform_meter_mono`): a stored band norm rounded up, to fp16 or to the one-byte e5m3 code (the fp16 bit pattern without its sign, rounded up to a multiple of 2^7), keeps every bound sound. The codes' upward rounding is the implementation's (witcert/tier_a/witness_code.py), checked exhaustively over fp16 and against 60-digit band norms, not a Lean statement.",
        spec=None,
        torch="witcert.tier_a.witness_code.encode_e5m3",
        kernel="witcert.kernels.witness_write.witness_write",
        tests=("tests/test_witness_code.py", "contracts/test_witness_write.py", "tests/test_memory_account.py"),
    ),
    Theorem(
        key="DW",
        paper='a witness derived from the codec\'s elementwise error bound (beyond the paper; docs/design.md "Tier A: the band witness")',
        statement="|x^_i - x_i| <= e_i for every i  =>  ||(x^ - x)_b|| <= ||e_b|| = sqrt(sum_{i in b} e_i^2)",
        lean="WitCert.band_norm_le_of_abs_le",
        note="With Theorem 2 (`WitCert.abs_inner_div_sqrt_le_derived`) the band norms of a codec's elementwise bounds are a witness (witness_bits=0): recomputed at every read from the stored scales, never stored. The hypothesis is checked in fp64 against the exact tokens when each is written (witcert.tier_a.derived_witness.check_error_bound: a codec whose bound fails is refused, never trusted); the norms are rounded up as a stored witness is.",
        spec="witcert.spec.derived.bound_derived_witness",
        torch="witcert.tier_a.derived_witness.derived_witness",
        kernel=None,
        tests=("tests/test_derived_witness.py", "tests/test_group_check.py"),
    ),
    Theorem(
        key="L2s",
        paper="Lemma 2 (sinh bound)",
        statement="x >= 0  =>  sinh x <= x exp(x^2/6)",
        lean="WitCert.sinh_le_mul_exp_sq_div_six",
        note='Termwise from `WitCert.six_pow_mul_factorial_le`, transported from the core-Lean `WitCert.Core.six_pow_mul_fact_le`.',
        spec="witcert.spec.dither.sinh_bound",
        torch=None,
        kernel=None,
        tests=("tests/test_tier_b.py",),
    ),
    Theorem(
        key="L2",
        paper="Lemma 2 (uniform MGF)",
        statement="(1/(2a)) int_{-a}^{a} exp(lambda x) dx <= exp(lambda^2 a^2 / 6)",
        lean="WitCert.uniform_mgf_le",
        spec="witcert.spec.dither.uniform_mgf",
        torch=None,
        kernel="witcert.kernels.dither_write.dither_write",
        tests=("tests/test_tier_b.py",),
    ),
    Theorem(
        key="L2v",
        paper="Lemma 2 (proxy = variance)",
        statement="the variance of U[-s/2, s/2] is s^2/12",
        lean="WitCert.uniform_variance",
        note='Mean zero: `WitCert.uniform_mean_zero`; second moment: `WitCert.uniform_second_moment`.',
        spec="witcert.spec.dither.proxy_variance",
        torch=None,
        kernel=None,
        tests=("tests/test_tier_b.py",),
    ),
    Theorem(
        key="L3",
        paper="Lemma 3 (request budget)",
        statement="n events each of probability <= delta_loc, n delta_loc <= delta_req  =>  P(any) <= delta_req",
        lean="WitCert.measure_iUnion_le_budget",
        note='Allocation identity `WitCert.delta_loc_allocation`; the order-theoretic composition is also proved in core Lean: `WitCert.Core.BudgetMonoid.budget_composition`.',
        spec="witcert.spec.dither.delta_local",
        torch="witcert.tier_b.certificate.delta_local",
        kernel="witcert.kernels.decode_attention.decode_attention_packed",
        tests=("tests/test_tier_b.py",),
    ),
    Theorem(
        key="TB",
        paper="Theorem 3 (Tier B radius)",
        statement="eps_t = d_t + sum_c k_tc U_tc, |d_t| <= beta_t, U_tc independent (per token) and uniform on the 2^24-point dither grid  =>  P(exists t, |eps_t| > sqrt(2 v_t log(2S/delta_loc)) + beta_t) <= delta_loc,  v_t = sum_c k_tc^2/12",
        lean="WitCert.tier_b_radius",
        note="Proved from the dither model alone (no tail bound is assumed): each grid component is sub-Gaussian with proxy 1/12 (`WitCert.grid_mgf_le`, `WitCert.gridCell_hasSubgaussianMGF`; the grid MGF sinh(l/2)/(N sinh(l/(2N))) is at most Lemma 2's exp(l^2/24)), the independent channel sum has proxy v_t (`WitCert.hasSubgaussianMGF_sum_mul`, Mathlib `HasSubgaussianMGF.sum_of_iIndepFun` and `const_mul`), the two-sided Chernoff bound (`WitCert.measure_lt_abs_le_of_subgaussian`) at the radius (`WitCert.exp_neg_sq_tierBRadius`) gives delta_loc/S per token, and Lemma 3 takes the union over the S tokens; `WitCert.tier_b_request` extends it over the layers x heads x steps of a request (cells x delta_loc <= delta_req), `WitCert.tier_b_radius_continuous` states it for the continuous uniform model. What remains assumed: (1) the Philox words are modelled as independent uniform 24-bit integers, so that for each token the centred residual components U_tc are independent and uniform on the grid (that the residual of one element is mu + U with a deterministic |mu| <= g/2, because as the dither runs over the grid the residual runs over one full period of a shifted grid, is the algebra of witcert/tier_b/quantizer.py, checked by tests, not in Lean; d_t = sm sum_c q_c s_tc mu_tc); (2) non-adaptive queries: the coefficients k_tc = sm q_c s_tc and the offsets d_t do not depend on the dither. The rounding slacks rho_t, o_t and the deterministic min with Delta_t are outside this statement.",
        spec="witcert.spec.dither.radius",
        torch="witcert.tier_b.certificate.tier_b_logit_bound",
        kernel="witcert.kernels.decode_attention.decode_attention_packed",
        tests=("tests/test_tier_b.py", "tests/test_dithered_int8.py", "tests/test_counters.py", "tests/test_philox.py"),
    ),
    Theorem(
        key="DB",
        paper="Tier B deterministic branch with the keys' rounding (beyond the paper)",
        statement="|r_c| <= s_c/2 + e_c for every channel  =>  |sm sum_c q_c r_c| <= sm sum_c |q_c| (s_c/2 + e_c)",
        lean="WitCert.abs_logit_error_le_deterministic",
        note="`e_c` bounds the rounding between the exact dequantized value and the key attention reads (fp32 kernel chain, then the cast to the model's fp16/bf16 dtype: unit roundoff and subnormal floor per dtype, inf at overflow; `witcert.tier_b.certificate` docstring). Holds for every query (the adaptive branch). Same shape for the probabilistic branch's slacks (u + beta + rho): `WitCert.abs_logit_error_le_probabilistic`; helper `WitCert.abs_smul_sum_le`. The packed kernel reads fp32 keys: its rho is the fp32 case.",
        spec="witcert.spec.dither.deterministic_branch",
        torch="witcert.tier_b.certificate.deterministic_branch",
        kernel="witcert.kernels.decode_attention.decode_attention_packed",
        tests=("tests/test_tier_b.py", "tests/test_tier_b_attacks.py"),
    ),
    Theorem(
        key="L4",
        paper="Lemma 4 (refinement and split-KV merge)",
        statement="blockwise A with the block radius equals per-token A; A merges across splits with LSE weights",
        lean="WitCert.block_sum_eq_token_sum",
        note='Split-KV merge with log-sum-exp weights: `WitCert.massExp_merge`. Core-Lean version of the refinement identity over abstract sums: `WitCert.Core.SumRing.block_sum_eq_token_sum`.',
        spec="witcert.spec.bounds.a_merge",
        torch="witcert.kernels.merge.merge_splits_reference",
        kernel="witcert.kernels.merge.merge_splits",
        tests=("tests/test_spec_bounds.py", "contracts/test_split_kv_merge.py"),
    ),
    Theorem(
        key="FP",
        paper='rounding inflation (beyond the paper; docs/design.md "Rounding enclosures")',
        statement="the fp32/fp64 meter, inflated a priori, is never below the exact-arithmetic bound",
        lean=None,
        spec="witcert.spec.golden.meter_from_scores",
        torch="witcert.core.rounding.sum_upper",
        kernel="witcert.kernels.certificate.certificate_from_moments",
        tests=("tests/test_meter.py", "tests/test_fuzz.py", "tests/test_fastpath.py", "tests/test_fast_radius.py",
               "tests/test_fast_tier_b.py"),
        note="A floating-point error analysis (witcert/core/rounding.py, kernels/certificate.py, and the fp32 fast path's a-priori budgets in witcert/fastpath/budgeted_pass.py, radius.py and tier_b_radius.py): the exact-arithmetic meter (its golden is the spec side) is never above the reported one; checked per query against the 50-digit golden, not a Lean theorem.",
    ),
    Theorem(
        key="SR",
        paper="rounding of the certified logits (beyond the paper)",
        statement="|fl(sm q . k^_t) - sm q . k^_t| <= score_rounding_bound_t for scores in bf16/fp16/fp32/fp64 with fp32/fp64 accumulation",
        lean=None,
        spec=None,
        torch="witcert.tier_a.score_rounding.score_rounding_bound",
        kernel=None,
        tests=("tests/test_score_rounding.py", "tests/test_observe.py", "tests/test_attention_inputs.py",
               "tests/test_fastpath.py", "tests/vllm/test_decode_pass.py"),
        note="A floating-point error analysis (Higham's gamma_d for the dot in any order, the pre-scaling of SDPA's math path, the final cast, subnormal floors; witcert/tier_a/observation.py), not a Lean theorem: checked per (query, token) against emulated runtimes and correctly rounded exact sums. The monitor's per-layer pass (witcert/fastpath/stored_pass.py) takes one bound per query row, sum_c |q_c k^_tc| from above by Hoelder's ||q||_inf max_t ||k^_t||_1 (every coefficient non-negative, its fp64 logits' coefficients near d 2^-53; the absolute terms lifted to the smallest normal fp64), checked per token in exact rationals from 1e-30 to 1e30. Added to c wherever logits computed in floating point are metered (observe_stored, the Tier B tightening), and by users who bring their own logits (Theorem 1 needs c_t >= |given logit - exact logit|). An additive mask or position_bias added to the fp64 logits rounds once more: bias_rounding_bound (2^-52 |fl(s + b)|, checked in exact rationals) is added to c with it. The vLLM plugin's decode pass (witcert/integrations/vllm/decode_pass.py) forms its logits with one fp32 GEMM scaled by fl32(sm) in fp32 and adds score_rounding_linear: rate ||k^_t|| + floor per token, from one rate and one floor per query row (Cauchy-Schwarz M_t <= ||q|| ||k^_t||, max(a, b) split into its multiple of sm M_t and its constant), checked per token in exact rationals; the real compressed logits then lie in a box of that radius around the GEMM's, so the reported meter adds tanh(max slack / 2) (MN) and, by the triangle inequality, bounds TV(exact, compressed) in exact arithmetic. Its zero-witness short cut reports tanh(c/2) <= c/2 at the fp64 reference's term for the row's largest key norm (a constant radius: every bound of the meter is then independent of p~).",
    ),
    Theorem(
        key="SC",
        paper='spot-check certificate, deterministic inequality (beyond the paper; docs/design.md "Spot-check certificate")',
        statement="W_t = e^{-eps_t}, Z = E_p~ W, any Z' > 0  =>  TV(p, p~) <= (1/2 E_p~|W - Z'| + 1/2 |Z' - Z|) / Z'",
        lean="WitCert.tv_le_spot_identity",
        note="Pointwise `WitCert.mul_abs_sub_le_spot` (z |w - Z| <= Z |w - z| + w |z - Z|). The two means are estimated from an exact set (the heaviest witness contributions, read exactly) and draws with replacement from q ~ p~ (e^c - 1 + |1 - Z'|) on the rest, ratios in [0, 1] and [-1, 1] because |e^{-eps} - 1| <= e^c - 1 (`WitCert.abs_exp_neg_sub_one_le`); three one-sided confidence statements (SCB) at delta/3 each, combined by the finite union bound against a budget (`WitCert.measure_iUnion_le_of_sum_le`). The draw uses the meter's own randomness after the query is fixed and never feeds the model, so the bound holds with probability 1 - delta per cell for adaptive queries and any scheme. The fp64 evaluation is inflated a priori and every weighted term is formed in log space, exp(log p~ + x), so a visible token whose p~ underflows keeps its p~ W; a Z' below S 2^-1000 gives the trivial bound (witcert/spot/cell.py), not a Lean statement.",
        spec="witcert.spec.spot_check.bound_spot_check",
        torch="witcert.spot.certificate.spot_check_two_sided",
        kernel=None,
        tests=("tests/test_spot_check.py", "tests/test_spot_underflow.py"),
    ),
    Theorem(
        key="SCO",
        paper='spot-check certificate, one-sided form (beyond the paper; docs/design.md "Spot-check certificate")',
        statement="p~ a probability vector, W_t = e^{-eps_t}, Z = E_p~ W, any Z_U >= Z  =>  TV(p, p~) <= E_p~ (1 - W / Z_U)^+",
        lean="WitCert.tv_le_spot_one_sided",
        note="TV = sum_t (p~_t - p_t)^+ because both sum to one (`WitCert.abs_le_add_two_mul` summed), and p~_t - p_t = p~_t (1 - W_t / Z) <= p~_t (1 - W_t / Z_U). Two confidence statements: an upper bound Z_U on Z from draws ~ p~ (e^c - 1) on the rest of an exact set (ratios (W - 1)/(e^c - 1) in [-1, 1], `WitCert.exp_neg_sub_one_mem`), then draws ~ p~ (1 - e^{-c}/Z_U)^+ bound the one-sided mean (ratios in [0, 1], `WitCert.spot_one_sided_term_le`); betting bounds (SCB) at delta 8/10 and 2/10 (their union, `WitCert.measure_iUnion_le_of_sum_le`), drawn until a planned number of distinct keys is read (a stopping time: Ville's inequality keeps the betting bound valid with the planned count in the bets). The library's default spot estimator. Visibility comes from the finite logits, every weighted term is formed in log space (a token whose fp64 p~ underflows keeps its p~ W and p~ (e^c - 1)), a Z_U below S 2^-1000 gives the trivial bound, and the fp64 evaluation is inflated a priori (witcert/spot/cell.py): not a Lean statement. A cell read whole (at most its budget of visible tokens, or a key group (layer, row, kv head) whose history is at most the summed budget of its checked cells: witcert/spot/groups.py) reports its true TV rounded up with no failure probability: an exact computation, no statement.",
        spec="witcert.spec.spot_check.bound_spot_one_sided",
        torch="witcert.spot.one_sided.spot_check",
        kernel=None,
        tests=("tests/test_spot_one_sided.py", "tests/test_spot_underflow.py", "tests/test_spot_groups.py"),
    ),
    Theorem(
        key="SCB",
        paper="confidence bounds for bounded means (published results, not proved in Lean)",
        statement="X_1..X_n i.i.d. in [0, 1]: P(E X > U(X_1..X_n, delta)) <= delta for U = the betting bound and U = the empirical Bernstein bound",
        lean=None,
        spec="witcert.spec.spot_check.mean_upper",
        torch="witcert.spot.confidence.mean_upper",
        kernel=None,
        tests=("tests/test_spot_check.py", "tests/test_spot_grid_search.py"),
        note="NOT proved in Lean. The grid capital is non-decreasing along the grid, so the batched bound (witcert.spot.confidence.row_betting_upper) finds the spec's first rejected grid point: small inputs in two tensor evaluations (every 16th point, then the 15 below the first rejected one), larger ones by bisection (tests/test_spot_grid_search.py). Betting: Waudby-Smith and Ramdas, Estimating means of bounded random variables by betting, JRSS-B 86(1), 2023 (predictable plug-in bets, capital a nonnegative supermartingale under E X >= m, Ville/Markov). Empirical Bernstein: Maurer and Pontil, Empirical Bernstein bounds and sample variance penalization, COLT 2009, Theorem 4 (E X <= mean + sqrt(2 V ln(2/delta)/n) + 7 ln(2/delta)/(3(n-1))). Assumptions: sampling with replacement from a known distribution fixed before the draw, values in [0, 1]. The minimum of the two costs a union: delta/2 each. Checked by an empirical failure-rate test at large delta over many seeds and adversarial cells (tests/test_spot_check.py).",
    ),
    Theorem(
        key="SCR",
        paper="spot-check adaptive key budgets (beyond the paper; docs/design.md \"Spot-check certificate\")",
        statement="rounds r = 1..R with statements failing w.p. <= delta_r conditionally on the rounds before, sum_r delta_r <= delta  =>  P(some round run fails) <= delta, for any stopping rule; delta_r = delta/R or delta 6/(pi^2 r^2)",
        lean="WitCert.measure_selected_lt_le_uniform",
        note="`WitCert.measure_selected_lt_le`: the bound of any selected round (here the least bound over the rounds run; a round not run holds the trivial bound 1) fails with probability at most delta when round r's fails with probability at most delta_r and sum_r delta_r <= delta (a round's conditional guarantee given the rounds before implies the unconditional one). Splits: uniform `WitCert.sum_uniform_round_budget_le` (the default; `WitCert.measure_selected_lt_le_uniform`) and 6/(pi^2 r^2) `WitCert.sum_zeta_round_budget_le` (`WitCert.measure_selected_lt_le_zeta`). Round r may read up to B_r = 32 4^(r-1) distinct exact keys in all (the last B_R = keys), every key read before known exactly; a cell stops at its first bound <= tau and reports the least bound over its rounds. The monitor uses the uniform split and fourfold budgets (measured: witcert/spot/rounds.py, docs/guides/spot-check.md). witcert.spot.batched.check_cells runs the same rounds for every cell of a layer-step at once (tests/test_spot_batched.py replays one form's draws in the other). A check may start from exact logits an earlier check read (check_cells(carried=...): the spot-certified gate's re-checks of a repaired cell, which start from the reads of the cell's check before repair, SpotSettings.apply(keep_reads=True), and of its earlier re-checks): they are fixed before its draws, so they are known tokens as a round's earlier reads are, and each round's statement holds conditionally on them at its delta_r; the split is unchanged (tests/test_spot_carried.py, at large delta and with a carried set chosen against the check).",
        spec="witcert.spec.spot_check.round_shares",
        torch="witcert.spot.rounds.round_shares",
        kernel=None,
        tests=("tests/test_spot_rounds.py", "tests/test_spot_batched.py", "tests/test_spot_carried.py"),
    ),
    Theorem(
        key="SCD",
        paper="spot-check request budget (beyond the paper)",
        statement="cell c of step k >= 1 fails with probability <= delta_req 6/(pi^2 k^2) / cells_k  =>  P(some cell of some step fails) <= delta_req, over any number of steps",
        lean="WitCert.measure_iUnion_steps_le",
        note="The union bound over a countable family of events against a budget (`WitCert.measure_iUnion_le_of_tsum_le`, Mathlib `measure_iUnion_le`), per step over its cells (`WitCert.measure_iUnion_le_of_sum_le`, even split `WitCert.sum_ofReal_div_card_le`), and the budgets summing to at most delta_req (`WitCert.tsum_ofReal_step_budget_le`, from `WitCert.sum_step_allocation_le`: sum_{k >= 1} 6/(pi^2 k^2) <= 1, Mathlib `hasSum_zeta_two` via `WitCert.sum_range_one_div_sq_le`). With cells known in advance the allocation is delta_req / n_cells (Lemma 3, `WitCert.measure_iUnion_le_budget`). The delta used is reported with every cell. The monitor spends a request budget this way (spot_delta=witcert.spot.RequestBudget(delta_req): step k of a request, its layers x heads x queries cells); the spot-certified gate gives half of a cell's delta to the check before repair and spends the other half over its re-checks i = 1, 2, ... at 6/(pi^2 i^2) each; the vLLM plugin's spot-certified gate (witcert/integrations/vllm/spot_gate.py) splits a cell's delta the same way.",
        spec="witcert.spec.spot_check.delta_at_step",
        torch="witcert.spot.budget.delta_at_step",
        kernel=None,
        tests=("tests/test_spot_check.py", "tests/test_spot_rounds.py", "tests/test_spot_gate.py",
               "tests/vllm/test_vllm_spot_check.py"),
    ),
    Theorem(
        key="QR",
        paper='query-side radius (beyond the paper; docs/design.md "The query-side radius")',
        statement="|sm q'.k^_t - sm q.k_t| <= sm sum_b ||q_b|| w_{t,b} + |sm (q' - q).k^_t|  for w_{t,b} >= ||(k^_t - k_t)_b||",
        lean="WitCert.abs_logit_error_le_query_radius",
        spec="witcert.spec.query_radius.bound_query_key",
        torch="witcert.tier_a.query_radius.query_radius",
        kernel=None,
        tests=("tests/test_query_radius.py", "tests/test_fuzz.py"),
        note="Helper WitCert.inner_add_sub_inner_eq (the split, band by band). The identity sm q'.k^ - sm q.k = sm q.(k^ - k) + sm (q' - q).k^, T2 on the first term and the second evaluated exactly (two fp64 logits and their SR rounding bounds, witcert.tier_a.query_radius.read_scores); its band Cauchy-Schwarz form sm sum_b ||e_b|| ||k^_b|| (spec bound_query_cauchy_schwarz) is valid and never smaller.",
    ),
    Theorem(
        key="AU",
        paper='request audit (beyond the paper; docs/design.md "The request audit")',
        statement="cells picked independently w.p. r, X = flagged picks, X' = picked cells with TV > tau ~ Bin(M, r), X' <= X off F, M_upper = max{m <= N : P(Bin(m, r) <= X) >= delta_s}  =>  P(M > M_upper) <= delta_s + P(F), P(F) <= sum_cells delta_c(cell) P(cell picked)",
        lean="WitCert.measure_auditUpper_lt_le",
        note="The combination: off the event F that some picked cell's spot check fails, every picked cell with TV above tau is flagged (X' <= X); M_upper is nondecreasing (`WitCert.auditUpper_mono`), and a miss of M_upper(X') puts the binomial cdf at X' below delta_s, which a discrete cdf at its own variable does with probability at most delta_s (`WitCert.measure_cdf_lt_le`). The union: P(F) <= sum_cells delta_c(cell) P(cell picked) (Mathlib's union bound; `WitCert.measure_audit_le` is the form with one delta_c for every cell, `WitCert.measure_picked_fail_le` its union). The implementation's delta_c(k) = delta_spot 6/(pi^2 k^2) / (L Hq) / r per step k keeps the union within delta_spot for a request of any length (`WitCert.sum_step_allocation_le`, registry SCD). Assumed, not proved: the binomial law of X' (picks are Philox4x32-10 words under a secret key, distinct counters modelled as independent uniform words as for Tier B; a cell is picked when its word is below ceil(r 2^32), so r is taken as that exact probability, ceil(r 2^32) / 2^32) and a population that the audit's draws do not change. The binomial tails are scipy.stats' in double precision, each compared with its level lowered by a relative 1e-9 (a rounded tail only widens the limit).",
        spec="witcert.spec.audit.upper_limit",
        torch="witcert.audit.limit.upper_limit",
        kernel=None,
        tests=("tests/test_audit_limit.py", "tests/test_audit_validity.py", "tests/test_audit_monitor.py",
               "tests/vllm/test_audit.py", "tests/test_audit_counts.py"),
    ),
    Theorem(
        key="AE",
        paper='exact request audit (beyond the paper; docs/design.md "The request audit")',
        statement="each picked cell's bound is its true TV rounded up, so X' <= X on every outcome (F empty)  =>  P(M > M_upper) <= delta_s = delta",
        lean="WitCert.measure_auditUpper_exact_le",
        note="AU with the failure event F empty: `witcert.Audit(keys=None)` (the default) reads every exact key a picked cell sees (the exact cache, or the content-checked host backing store) and bounds it by TV(softmax(l), softmax(l~)) evaluated in fp64 and rounded up by 8u per visible token (TOKEN_SLACK: the evaluation's error in any summation order), then a relative 1e-9 plus 1e-12 (as a spot check read whole is, registry SCO), so no check exists to fail and the binomial limit takes the whole delta. The TV is between attention over the exact keys with the exact query and over the keys attention read with the query the kernel read (QR); the spec mirror is the mpmath TV of the two softmaxes. Assumed, as in AU: the binomial law of X' and a population the audit does not change.",
        spec="witcert.spec.audit.true_tv",
        torch="witcert.audit.exact.true_tv_bounds",
        kernel=None,
        tests=("tests/test_audit_exact.py", "tests/test_audit_validity.py", "tests/test_audit_exact_spec.py"),
    ),
)


def by_key(key: str) -> Theorem:
    """The registered theorem with this key."""
    for theorem in THEOREMS:
        if theorem.key == key:
            return theorem
    raise KeyError(f"no theorem registered under key {key!r}")
