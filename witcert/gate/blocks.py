"""Block decomposition of the e-form sum ``A`` (Lemma 4 ``L4``; docs/design.md "Gating and repair").

With ``A = sum_t p~_t e^{c_t}`` (Theorem 1, ``T1``) and ``sum_t p~_t = 1``,

    A - 1 = sum_j X_j,   X_j = sum_{t in block j} p~_t (e^{c_t} - 1)   (Tier A, per-token c)
                             = mass_j (e^{u_j} - 1)                    (Tier B, shared radius u_j)

(the second line is Lemma 4: a block radius is the per-token radius of every token in the
block). Making block ``j`` exact sets its ``c`` to 0 and so, *for fixed* ``p~``, lowers ``A``
by exactly ``X_j``. Repair changes the logits of the repaired tokens and hence ``p~``, so the
gate uses ``X_j`` only to *order* page-ins and always recomputes the real meter afterwards.

Everything is evaluated in the log domain in fp64 (``log X_j`` via log-sum-exp of
``log p~_t + log(e^{c_t} - 1)``), so huge ``c`` (massive activations) orders correctly instead
of overflowing; a block with nothing to repair (all ``c = 0`` or all tokens masked) has
``log X_j = -inf``.
"""
import math

import torch

from witcert.core.checks import check_scores_and_bounds


def log_block_excess(scores: torch.Tensor, c: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """``log X_j``, the log of block ``j``'s share of ``A - 1`` (Lemma 4 ``L4``, Theorem 1 ``T1``).

    Parameters
    ----------
    scores : Tensor (..., S)
        Compressed logits (``-inf`` = masked).
    c : Tensor broadcastable to (..., S)
        Per-token logit-error bounds ``>= 0`` (``inf`` allowed). For a Tier B shared block
        radius, pass :func:`expand_block_radius` of it.
    block_size : int
        Tokens per block; the last block may be partial.

    Returns
    -------
    Tensor (..., n_blocks), float64
        ``log X_j``; ``-inf`` where the block contributes nothing; ``+inf`` where some ``c`` is
        ``inf`` on an unmasked token.
    """
    block_size = _check_block_size(block_size)
    scores, c = check_scores_and_bounds(scores, c)
    s64, c64 = scores.to(torch.float64), c.to(torch.float64)
    log_p = s64 - torch.logsumexp(s64, dim=-1, keepdim=True)  # (..., S), log p~
    log_term = log_p + log_expm1(c64)  # (..., S), log p~_t (e^{c_t} - 1)
    log_term = torch.where(torch.isneginf(log_p), torch.full_like(log_term, -math.inf), log_term)
    return torch.logsumexp(_pad_to_blocks(log_term, block_size, -math.inf), dim=-1)  # (..., nb)


def block_excess(scores: torch.Tensor, c: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """``X_j = sum_{t in j} p~_t (e^{c_t} - 1)`` in fp64 (``inf`` on overflow); see :func:`log_block_excess`."""
    return torch.exp(log_block_excess(scores, c, block_size))


def block_mass(scores: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """``mass_j = sum_{t in j} p~_t`` (..., n_blocks) in fp64."""
    block_size = _check_block_size(block_size)
    scores, _ = check_scores_and_bounds(scores, torch.zeros(1))
    p = torch.softmax(scores.to(torch.float64), dim=-1)
    return _pad_to_blocks(p, block_size, 0.0).sum(dim=-1)


def expand_block_radius(radius: torch.Tensor, block_size: int, n_tokens: int) -> torch.Tensor:
    """Per-token ``c`` from a Tier B shared block radius (Lemma 4 ``L4``).

    Parameters
    ----------
    radius : Tensor (..., n_blocks)
        ``u_j >= 0``, one radius per block; ``n_blocks = ceil(n_tokens / block_size)``.
    block_size, n_tokens : int

    Returns
    -------
    Tensor (..., n_tokens): ``c_t = u_{t // block_size}``.
    """
    block_size = _check_block_size(block_size)
    if not isinstance(radius, torch.Tensor) or not torch.is_floating_point(radius) or radius.dim() == 0:
        raise ValueError("radius must be a floating tensor (..., n_blocks)")
    n_blocks = -(-n_tokens // block_size)
    if radius.shape[-1] != n_blocks:
        raise ValueError(
            f"radius has {radius.shape[-1]} blocks; {n_tokens} tokens in blocks of {block_size} need {n_blocks}"
        )
    if torch.isnan(radius).any() or (radius < 0).any():
        raise ValueError("radius must be >= 0 and not NaN")
    return radius.repeat_interleave(block_size, dim=-1)[..., :n_tokens]


def block_tokens(block: int, block_size: int, n_tokens: int) -> slice:
    """Token range of block ``block`` (the last block may be partial)."""
    start = block * block_size
    if not 0 <= start < n_tokens:
        raise ValueError(f"block {block} out of range for {n_tokens} tokens in blocks of {block_size}")
    return slice(start, min(start + block_size, n_tokens))


def log_expm1(c: torch.Tensor) -> torch.Tensor:
    """``log(e^c - 1)`` for ``c >= 0``: ``-inf`` at 0, ``inf`` at ``inf``, no overflow in between.

    Formed as ``c + log(1 - e^{-c})`` with ``1 - e^{-c} = -expm1(-c)`` in ``(0, 1]``: relative accuracy for tiny
    ``c`` (``-expm1(-c) ~ c``), no overflow for large ``c``, two transcendental passes.
    """
    return c + torch.log(-torch.expm1(-c))


def _pad_to_blocks(x: torch.Tensor, block_size: int, fill: float) -> torch.Tensor:
    """(..., S) -> (..., n_blocks, block_size), padding the last block with ``fill``."""
    n_tokens = x.shape[-1]
    n_blocks = -(-n_tokens // block_size)
    pad = n_blocks * block_size - n_tokens
    if pad:
        x = torch.cat([x, x.new_full(x.shape[:-1] + (pad,), fill)], dim=-1)
    return x.reshape(x.shape[:-1] + (n_blocks, block_size))


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size
