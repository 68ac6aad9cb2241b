"""Public entry points of the fused pass: :func:`lean_cells` (meter, risk, value term), :func:`tier_a_cells` and
:func:`tier_b_cells` (the whole cell: the per-token bound and the pass) and :func:`fast_meter`.

The pass itself and its rounding budget: :mod:`witcert.fastpath.budgeted_pass`; compiled or eager:
:mod:`witcert.fastpath.compiled`. Inputs are flattened to (rows, tokens), padded to at least
(2, 2), so one compiled graph serves every shape.
"""
from dataclasses import dataclass

import torch

from witcert.core.checks import check_scores_and_bounds
from witcert.core.rounding import round_up_to
from witcert.fastpath import budgeted_pass, radius, tier_b_radius
from witcert.fastpath.budgeted_pass import MAX_TOKENS
from witcert.fastpath.compiled import pick
from witcert.tier_a.bands import BandLayout
from witcert.tier_b.packed_store import PackedStore


@dataclass(frozen=True)
class LeanCells:
    """Per-row fp64 results of :func:`lean_cells` (shape ``(...)``): each an upper bound except ``v_norm_max``
    (the exact maximum of the given norms over the live tokens)."""

    meter: torch.Tensor  # min(1, T1, P1, MN, CS, MS), MS on the pass's low sets (budgeted_pass.split_low_sets)
    risk: torch.Tensor  # T1 unclamped: inf on overflow, never NaN
    value_term: torch.Tensor  # >= sum_t p~_t rho_t (0 when no rho was given)
    v_norm_max: torch.Tensor  # max_t ||v_t|| over live tokens (0 when not given)


def lean_cells(scores, c, rho=None, v_norm=None, *, checked: bool = False) -> LeanCells:
    """Meter, risk, value term and max value norm of every row in one fused pass (``T1``, ``P1``, ``MN``, ``CS``, ``MS``, ``FP``).

    Parameters
    ----------
    scores : Tensor (..., S)
        Compressed logits; ``-inf`` masks a token.
    c : Tensor broadcastable to ``scores``
        Per-token logit-error bounds ``>= 0`` (``inf`` allowed).
    rho, v_norm : Tensor broadcastable to ``scores``, optional
        Value residual norms and value norms (``>= 0``): for the value term and its maximum.
    checked : bool
        ``scores`` and ``c`` are already valid (the per-layer path forms them from validated inputs:
        finite or ``-inf`` logits with a live token per row, ``c >= 0``): skip the checks and their
        host synchronisations (the token cap is still checked: it is a shape).

    Returns
    -------
    LeanCells
        fp64 upper bounds (``meter`` in ``[0, 1]``), computed by the compiled pass where available
        (:func:`witcert.fastpath.compiled.pick`), else eagerly.
    """
    if not checked:
        scores, c = check_scores_and_bounds(scores, c)
    _check_token_cap(scores)
    rows, n = scores.shape[:-1], scores.shape[-1]
    flat = [_flat(scores, scores), _flat(c, scores), *_value_statistics(rho, v_norm, scores)]
    if flat[0].shape != (rows.numel(), n):
        flat[0] = torch.where(_padding_mask(flat[0], scores.shape), flat[0], float("-inf"))
    results = pick(budgeted_pass.lean_pass, budgeted_pass.probe)(*flat)
    return LeanCells(*(r[:rows.numel()].reshape(rows) for r in results))


def tier_a_cells(scores, q, w, layout: BandLayout, sm_scale: float | None = None, rho=None, v_norm=None, *,
                 checked: bool = False) -> LeanCells:
    """:func:`lean_cells` of the Tier A radius ``c`` of :func:`~witcert.fastpath.radius.fast_logit_bound`, in one
    pass that forms ``c`` inside it and never stores it (``T2``, ``T1``, ``P1``, ``MN``, ``CS``, ``MS``, ``FP``).

    ``scores`` (..., Hq, Tq, S): the compressed logits of the queries ``q`` (..., Hq, Tq, d), whose keys
    have the witnesses ``w`` (..., Hkv, S, B) (arguments and head pairing as :func:`witcert.logit_bound`);
    ``rho``, ``v_norm`` and ``checked`` as :func:`lean_cells`. The same bounds as the two calls, within
    the same budgets: a non-fp16 witness, one row or one token take those two calls.
    """
    if not checked:
        scores, _ = check_scores_and_bounds(scores, 0.0)
    if w.dtype != torch.float16 or scores.shape[-1] < 2 or scores[..., 0].numel() < 2:
        c = radius.fast_logit_bound(q, w, layout, sm_scale, checked=checked)
        return lean_cells(scores, c, rho, v_norm, checked=checked)
    lifted = radius.checked_query_norms(q, w, layout, sm_scale, checked=checked)
    if scores.shape != (*q.shape[:-1], w.shape[-2]):
        raise ValueError(f"scores must be (..., Hq, Tq, S) = {(*q.shape[:-1], w.shape[-2])} for q {tuple(q.shape)} "
                         f"and w {tuple(w.shape)}, got {tuple(scores.shape)}")
    _check_token_cap(scores)
    flat = _working(scores).reshape(-1, scores.shape[-1])
    results = pick(radius.tier_a_pass, radius.tier_a_probe)(flat, *lifted, w, *_value_statistics(rho, v_norm, scores))
    return LeanCells(*(r.reshape(scores.shape[:-1]) for r in results))


def tier_b_cells(scores, q, store: PackedStore, delta_loc: float, sm_scale: float | None = None, mode: str = "min",
                 rho=None, v_norm=None, *, key_dtype: torch.dtype = torch.float32, checked: bool = False) -> LeanCells:
    """:func:`lean_cells` of the Tier B bound of :func:`~witcert.fastpath.tier_b_radius.fast_tier_b_logit_bound`: the
    whole Tier B cell (``TB``, ``L3``, ``DB``, ``T1``, ``P1``, ``MN``, ``CS``, ``MS``, ``FP``).

    ``scores`` (..., Hq, Tq, S): the compressed logits of the queries ``q`` (..., Hq, Tq, d) against the keys of
    ``store``; ``delta_loc``, ``sm_scale``, ``mode`` and ``key_dtype`` as :func:`witcert.tier_b_logit_bound`
    (``mode="min"`` holds only for queries chosen without the dither; ``"delta"`` for every query); ``rho``,
    ``v_norm`` and ``checked`` as :func:`lean_cells`. Two compiled graphs, the bound's and the pass's, not one
    (unlike :func:`tier_a_cells`): fused, Inductor recomputed the group dot inside the pass's token loop and
    stored the bound anyway (SmolLM2, 9 x 32k tokens: 4.6 against 3.7 ms for the two graphs; 7B-class, 28 x 32k:
    8.8 against 9.1 ms).
    """
    if not checked:
        scores, _ = check_scores_and_bounds(scores, 0.0)
    c = tier_b_radius.fast_tier_b_logit_bound(q, store, delta_loc, sm_scale, mode, key_dtype=key_dtype)
    if scores.shape != c.shape:
        raise ValueError(f"scores must be (..., Hq, Tq, S) = {tuple(c.shape)} for q {tuple(q.shape)} and a store of "
                         f"{c.shape[-1]} tokens, got {tuple(scores.shape)}")
    return lean_cells(scores, c, rho, v_norm, checked=True)


def _check_token_cap(scores: torch.Tensor) -> None:
    """A shape check even for checked inputs: the pass's sum budget holds for rows of at most ``MAX_TOKENS``."""
    if scores.shape[-1] > MAX_TOKENS:
        raise ValueError(f"scores has {scores.shape[-1]} tokens; the fast path's sum budget covers at most {MAX_TOKENS}")


def _value_statistics(rho, v_norm, scores: torch.Tensor) -> list:
    """``rho``, ``v_norm`` flattened like ``scores``; both absent: ``None`` (no value work in the pass),
    one absent: a zero that broadcasts (no (rows, S) copy)."""
    if rho is None and v_norm is None:
        return [None, None]
    return [scores.new_zeros(1, 1) if x is None else _flat(torch.as_tensor(x), scores) for x in (rho, v_norm)]


def _flat(x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``x`` broadcast to ``scores`` as (rows, S) in its working dtype, :func:`_padded`."""
    return _padded(_working(x).expand(scores.shape).reshape(-1, scores.shape[-1]))


def _working(x: torch.Tensor) -> torch.Tensor:
    """fp32 and fp64 as given (the pass rounds fp64 radii up to fp32 itself); half types widened exactly."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _padded(x: torch.Tensor) -> torch.Tensor:
    """(R, S) padded to at least (2, 2): the compiled pass is specialised to sizes >= 2, so it never
    recompiles for one row or one token. Padding rows are copies of row 0; padding tokens are masked
    (their scores set to ``-inf`` by the caller: they carry no mass)."""
    r, s = x.shape
    if s < 2:
        x = torch.cat([x, x[:, :1]], dim=-1)
    if r < 2:
        x = torch.cat([x, x[:1]], dim=0)
    return x


def _padding_mask(padded: torch.Tensor, shape) -> torch.Tensor:
    """True on the real tokens of a :func:`_padded` (R, S) tensor."""
    keep = torch.ones_like(padded, dtype=torch.bool)
    keep[:, shape[-1]:] = False
    return keep


def fast_meter(scores, c) -> torch.Tensor:
    """The fast meter ``min(1, T1, P1, MN, CS, MS)``: validated once, one fused fp32 pass; never below the exact value.

    Same contract as :func:`witcert.meter` (``T1``, ``P1``, ``MN``, ``CS``, ``MS``; rounding ``FP``), returned in
    the working dtype (rounded up). It differs from :func:`witcert.meter` slightly either way: an fp32
    rounding budget above, and MS on four low sets of its own (:func:`~witcert.fastpath.budgeted_pass.split_low_sets`)
    instead of the eager grid's twelve; never below the exact value of its own bounds.
    """
    scores, c = check_scores_and_bounds(scores, c)
    return round_up_to(lean_cells(scores, c, checked=True).meter, scores.dtype)
