"""The WitCert meter: the reported per-(layer, head, step) bound on attention TV.

``meter = min(1, e-form (T1), two-sided (P1), tanh(D/2) (MN), chi-square (CS), mass-split (MS))``
-- a minimum of sound bounds is sound -- computed in one pass over the tokens with a-priori rounding
inflation (``FP``), so it is never below the exact-arithmetic value for the given inputs. ``risk_score`` is the raw e-form:
above 1 it carries no guarantee but still ranks danger.
"""
import torch

from witcert.core import bounds, rounding
from witcert.core.checks import check_scores_and_bounds


def meter(scores, c) -> torch.Tensor:
    """Sound upper bound on ``TV(softmax(scores - eps), softmax(scores))`` for every ``|eps| <= c``.

    Mirrors ``witcert.spec.bounds`` T1, P1, MN, CS and MS (Lean: ``WitCert.tv_le_eform``,
    ``WitCert.tv_le_two_sided``, ``WitCert.tv_le_tanh_half``, ``WitCert.tv_le_chi_square``,
    ``WitCert.tv_le_mass_split_min``); golden ``witcert.spec.golden.meter_from_scores``.

    Parameters
    ----------
    scores : Tensor (..., S)
        Compressed logits (what a runtime has), already scaled; ``-inf`` masks a token.
    c : Tensor broadcastable to ``scores``
        Per-token logit-error bounds, ``>= 0``; ``inf`` allowed (gives the trivial bound 1).

    Returns
    -------
    Tensor (...)
        Values in ``[0, 1]`` in the working dtype (fp32 or fp64).
    """
    scores, c = check_scores_and_bounds(scores, c)
    return rounding.round_up_to(bounds.moments(scores, c).meter(), scores.dtype)


def risk_score(scores, c) -> torch.Tensor:
    """The raw (unclamped) e-form ``1/2 (A^2 - 1)``: a risk ranking, ``inf`` on overflow, never NaN."""
    return bounds.eform_bound(scores, c)
