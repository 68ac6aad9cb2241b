"""Executable statements of Tier B (registry keys L2s, L2, L2v, L3, TB); pure Python + mpmath.

Mirrors ``witcert.tier_b.certificate`` at the caller's working precision (``mpmath.mp``); no torch.

* ``sinh_bound(x)``: the right side ``x exp(x^2/6)`` of ``sinh x <= x exp(x^2/6)`` (L2s);
* ``uniform_mgf(lam, a)``: ``E exp(lam X)`` for ``X ~ U[-a, a]`` = ``sinh(lam a)/(lam a)``;
  ``uniform_mgf_bound(lam, a) = exp(lam^2 a^2 / 6)`` (L2);
* ``grid_mgf(lam, n_points, step)``: the same for the centred ``n``-point grid of the
  dither residual, ``sinh(lam n step/2) / (n sinh(lam step/2))`` (never above the continuous;
  Lean ``WitCert.grid_mgf_le``, a step of TB);
* ``uniform_variance(a)`` by quadrature and ``proxy_variance(s) = s^2/12`` (L2v);
* ``delta_local`` (L3) and ``radius(v, S, delta_loc) = sqrt(2 v log(2S/delta_loc))`` (TB);
  TB (Lean ``WitCert.tier_b_radius``) is proved from the dither model alone: for each token the
  residual components are independent and uniform on the grid, the query is fixed; then
  ``P(exists t, |eps_t| > radius(v_t, S, delta_loc) + beta_t) <= delta_loc`` with
  ``v_t = logit_variance`` and ``beta_t = grid_offset_slack``;
* the deterministic slacks ``grid_offset_slack``, ``dequant_slack``, ``outlier_slack`` and
  ``deterministic_delta``, and ``logit_bound`` composing them as the torch code does;
* the final cast of a dequantized key to the dtype attention reads (``key_cast_bound``,
  ``key_cast_slack``: fp16 and bf16 models) and the deterministic branch with a per-element
  rounding term, ``deterministic_branch`` (DB).
"""
import mpmath
from mpmath import mpf

Q_LEVELS = 127
DITHER_BITS = 24
FP32_UNIT = mpf(2) ** -24
# dtype name -> (unit u_D, half the smallest subnormal eta_D/2, overflow threshold) of the final
# cast after the fp32 chain; None: fp32 (the chain ends there) and fp64 (fp32 values are exact)
KEY_CASTS = {
    "float32": None,
    "float64": None,
    "float16": (mpf(2) ** -11, mpf(2) ** -25, mpf(2) ** 16 * (1 - mpf(2) ** -12)),
    "bfloat16": (mpf(2) ** -8, mpf(2) ** -134, mpf(2) ** 128 * (1 - mpf(2) ** -9)),
}


def sinh_bound(x):
    """``x exp(x^2/6)``, an upper bound on ``sinh x`` for ``x >= 0`` (L2s)."""
    x = mpf(x)
    if x < 0:
        raise ValueError("x: the statement needs x >= 0")
    return x * mpmath.exp(x * x / 6)


def uniform_mgf(lam, a):
    """``(1/(2a)) int_{-a}^{a} exp(lam x) dx = sinh(lam a)/(lam a)`` (1 at ``lam a = 0``) (L2)."""
    y = mpf(lam) * mpf(a)
    return mpf(1) if y == 0 else mpmath.sinh(y) / y


def uniform_mgf_bound(lam, a):
    """``exp(lam^2 a^2 / 6)``: the sub-Gaussian bound of Lemma 2 (proxy ``a^2/3``; ``a = s/2`` gives ``s^2/12``)."""
    return mpmath.exp(mpf(lam) ** 2 * mpf(a) ** 2 / 6)


def grid_mgf(lam, n_points, step):
    """MGF of the centred arithmetic progression of ``n_points`` points spaced ``step``.

    With ``step = 1/n_points`` this is the left side of Lean ``WitCert.grid_mgf_le``
    (``<= exp(lam^2/24)``, proxy ``1/12`` per cell); in general ``<= exp(lam^2 (n step)^2/24)``.
    """
    y = mpf(lam) * mpf(step) / 2
    return mpf(1) if y == 0 else mpmath.sinh(n_points * y) / (n_points * mpmath.sinh(y))


def uniform_variance(a):
    """Variance of ``U[-a, a]`` by quadrature (independent of the closed form)."""
    a = mpf(a)
    return mpmath.quad(lambda x: x * x, [-a, a]) / (2 * a)


def proxy_variance(s):
    """``s^2 / 12``: variance of the residual ``U[-s/2, s/2]`` and its sub-Gaussian proxy (L2v)."""
    return mpf(s) ** 2 / 12


def delta_local(delta_req, n_layers, n_heads, n_steps):
    """``delta_req / (L H T)`` (L3): the union over ``L H T`` events stays within ``delta_req``."""
    return mpf(delta_req) / (n_layers * n_heads * n_steps)


def radius(v, n_tokens, delta_loc):
    """``sqrt(2 v log(2 S / delta_loc))`` (TB; Lean ``WitCert.tierBRadius``, ``WitCert.tier_b_radius``).

    At this radius each of the two sub-Gaussian tails is ``delta_loc / (2 S)``
    (``WitCert.exp_neg_sq_tierBRadius``), so the union over the ``2 S`` tails is ``delta_loc``.
    """
    return mpmath.sqrt(2 * mpf(v) * mpmath.log(2 * mpf(n_tokens) / mpf(delta_loc)))


def logit_variance(q, s, sm):
    """``v = sm^2 sum_c q_c^2 s_c^2 / 12`` (``s_c = 0`` on outlier channels).

    The proxy ``sum_c k_c^2 / 12`` of ``sum_c k_c U_c`` with ``k_c = sm q_c s_c``
    (Lean ``WitCert.hasSubgaussianMGF_sum_mul``).
    """
    return mpf(sm) ** 2 * mpmath.fsum(mpf(qc) ** 2 * proxy_variance(sc) for qc, sc in zip(q, s))


def _weighted_l1(q, s, sm):
    return mpf(sm) * mpmath.fsum(abs(mpf(qc)) * mpf(sc) for qc, sc in zip(q, s))


def deterministic_delta(q, s, sm):
    """``Delta = sm sum_c |q_c| s_c / 2`` (from ``|err_c| <= s_c/2``)."""
    return _weighted_l1(q, s, sm) / 2


def grid_offset_slack(q, s, sm, dither_bits=DITHER_BITS):
    """``sm sum_c |q_c| s_c g/2`` with grid step ``g = 2^-bits``: the residual's mean offset.

    The bound ``beta_t >= |d_t|`` on the deterministic offset of Lean ``WitCert.tier_b_radius``.
    """
    return _weighted_l1(q, s, sm) * mpf(2) ** (-dither_bits - 1)


def dequant_slack(q, s, sm):
    """``sm sum_c |q_c| s_c (Q + 1/2)(2u + u^2)``, ``u = 2^-24``: two fp32 roundings of ``s (n - xi)``."""
    u = mpf(2) ** -24
    return _weighted_l1(q, s, sm) * (Q_LEVELS + mpf(1) / 2) * (2 * u + u * u)


def key_cast_bound(magnitude, key_dtype="float32"):
    """Bound on ``|fl_D(z) - z|`` for ``|z| <= (1 + u)^2 magnitude`` (``u = 2^-24``), ``D = key_dtype``.

    ``u_D (1 + u)^2 m + eta_D/2`` (``eta_D/2`` only when ``m > 0``: zero rounds exactly), ``inf``
    when ``(1 + u)^2 m`` reaches the overflow threshold, 0 for fp32 and fp64 (DB).
    """
    cast = KEY_CASTS[key_dtype]
    m = mpf(magnitude)
    if cast is None or m == 0:
        return mpf(0)
    unit, half_subnormal, overflow = cast
    grown = (1 + FP32_UNIT) ** 2 * m
    return mpmath.inf if grown >= overflow else unit * grown + half_subnormal


def key_cast_slack(q, magnitudes, sm, key_dtype="float32"):
    """``sm sum_c |q_c| key_cast_bound(m_c)``; ``m_c = s_c (|n_c| + 1/2)``, or ``|x16_c|`` on outliers."""
    terms = [abs(mpf(qc)) * key_cast_bound(m, key_dtype) for qc, m in zip(q, magnitudes) if qc != 0]
    return mpf(sm) * mpmath.fsum(terms)


def deterministic_branch(q, s, e, sm):
    """``sm sum_c |q_c| (s_c/2 + e_c)`` (DB; Lean ``WitCert.abs_logit_error_le_deterministic``).

    Holds for every query when ``|x^_c - x_c| <= s_c/2 + e_c`` on every channel; a channel with
    ``q_c = 0`` contributes nothing, even where ``e_c`` is infinite.
    """
    return mpf(sm) * mpmath.fsum(abs(mpf(qc)) * (mpf(sc) / 2 + mpf(ec)) for qc, sc, ec in zip(q, s, e) if qc != 0)


def outlier_slack(q_outlier, x16_outlier, sm, source_is_fp16=False):
    """``sm sum |q_c| (2^-11/(1-2^-11) |x16_c| + 2^-25)`` over outlier channels (0 for fp16 input)."""
    if source_is_fp16:
        return mpf(0)
    u = mpf(2) ** -11
    return mpf(sm) * mpmath.fsum(abs(mpf(qc)) * (u / (1 - u) * abs(mpf(xc)) + mpf(2) ** -25)
                                 for qc, xc in zip(q_outlier, x16_outlier))


def logit_bound(q, s, sm, n_tokens, delta_loc, q_outlier=(), x16_outlier=(), source_is_fp16=False, mode="min",
                magnitudes=(), key_dtype="float32"):
    """``min(u + beta, Delta) + rho + o`` for one token (the torch composition, exactly).

    ``rho`` is ``dequant_slack`` plus, for keys read in fp16 or bf16, ``key_cast_slack`` over
    ``magnitudes`` (per channel, aligned with ``q``).
    """
    u = radius(logit_variance(q, s, sm), n_tokens, delta_loc)
    beta = grid_offset_slack(q, s, sm)
    delta = deterministic_delta(q, s, sm)
    core = {"min": min(u + beta, delta), "u": u + beta, "delta": delta}[mode]
    rho = dequant_slack(q, s, sm) + key_cast_slack(q, magnitudes, sm, key_dtype)
    return core + rho + outlier_slack(q_outlier, x16_outlier, sm, source_is_fp16)


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("mpmath", "mp", "mpf")]
