"""Witness maintenance: a Tier A witness that stays valid when a cached token is re-quantized (``WM``).

Tier A (Theorem 2, ``T2``) needs, for the keys attention *reads* at a step, a witness
``w_{t,b} >= ||(k^_t - k_t)_b||`` against the exact post-RoPE key ``k_t``. A cache that
re-quantizes moves a token's reconstruction after it was written (transformers' ``QuantizedCache``
quantizes its whole history again at every flush of its exact window; HQQ re-groups and moves keys
by whole quantization steps), so a witness computed once, at the first quantization, goes stale.
The triangle inequality repairs it without the exact key:

    ``||(x^_new - x)_b|| <= ||(x^_old - x)_b|| + ||(x^_new - x^_old)_b|| <= w_b + ||(x^_new - x^_old)_b||``

(Lean: ``WitCert.bandNorm_sub_le_add_of_le``; iterated over any number of re-quantizations:
``WitCert.bandNorm_sub_le_add_sum``). So ``w'_b = w_b + ||(x^_new - x^_old)_b||``, rounded up, is again a
witness. A token still held exactly has ``w = 0`` and ``x^_old = x``: its maintained witness is its
exact witness ``||(x^_new - x)_b||``, computed where the exact key still exists. Where an exact
shadow is kept, :class:`WitnessedTensor` recomputes the witness from it instead (never larger than
the maintained one, up to rounding).

Rounding: the step ``||(x^_new - x^_old)_b||`` is :func:`witness_of` of the two reconstructions (fp16,
rounded up), and the sum of two fp16 values is exact in fp64 (both are multiples of ``2^-24`` below
``2^16``), so the one rounding left is the final cast, done upward (:func:`round_up_to`).

Band norms are invariant under RoPE only in exact arithmetic (``L1``); everything here is done on
the keys attention reads (post-RoPE, as computed), so no rotation rounding enters (``L1fp`` is not
needed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from witcert.core.rounding import round_up_to
from witcert.tier_a.bands import BandLayout
from witcert.tier_a.witness import band_major, cat_tokens, witness_of


def maintained_witness(w: torch.Tensor, x_hat_old: torch.Tensor, x_hat_new: torch.Tensor, layout: BandLayout) -> torch.Tensor:
    """``w' >= w + ||(x_hat_new - x_hat_old)_b||`` in fp16, rounded up (``WM``, then ``T2`` applies).

    Parameters
    ----------
    w : Tensor (..., S, B)
        A witness of ``x_hat_old``: ``w[..., t, b] >= ||(x_hat_old - x)[..., t, band b]||`` for the
        exact ``x`` (fp16 from :func:`witness_of` or from this function; ``inf`` allowed).
    x_hat_old, x_hat_new : Tensor (..., S, d)
        The reconstruction the witness described and the one that replaces it.
    layout : BandLayout

    Returns
    -------
    Tensor (..., S, B), float16
        A witness of ``x_hat_new`` against the same exact ``x``; equal to ``w`` where the two
        reconstructions agree, and to ``witness_of(x, x_hat_new)`` where ``w = 0`` and
        ``x_hat_old = x`` (a token still held exactly).
    """
    step = witness_of(x_hat_old, x_hat_new, layout)  # (..., S, B) fp16, >= ||(new - old)_b||
    if not isinstance(w, torch.Tensor) or w.shape != step.shape:
        raise ValueError(f"w must have shape {tuple(step.shape)} (..., S, B), got {tuple(getattr(w, 'shape', ()))}")
    if not torch.is_floating_point(w) or not (w >= 0).all():
        raise ValueError("w must be a floating tensor of witnesses >= 0 (no NaN)")
    total = w.to(torch.float64) + step.to(torch.float64)  # exact: two fp16 values
    return round_up_to(total, torch.float16)


@dataclass
class WitnessedTensor:
    """One side (keys or values) of one cache layer: what attention reads, with a maintained witness.

    ``recon`` is the tensor attention reads (reconstructed tokens and exact ones alike) and
    ``witness`` its per-token, per-band witness against the exact tensor (Tier A, ``T2``): 0 for a
    token appended exactly, maintained by :func:`maintained_witness` (``WM``) whenever a token's
    reconstruction moves, or recomputed exactly from ``exact`` when the shadow is kept.

    Every operation builds new tensors (never writes in place), so a tensor handed out earlier
    (a read snapshot) keeps describing the step it was read at.

    Parameters
    ----------
    layout : BandLayout
        Bands of the keys (the model's RoPE pairs) or ``BandLayout(d, 1)`` for values (one band:
        the witness is then ``rho_t >= ||v^_t - v_t||``).
    keep_exact : bool
        Also hold the exact tensor (an exact shadow: twice the memory). Witnesses are then
        recomputed from it at every move, which is tighter than the maintained bound; without it
        the witness needs no exact token beyond the ones still held exactly.
    """

    layout: BandLayout
    keep_exact: bool = False
    recon: torch.Tensor | None = field(default=None, repr=False)  # (B, H, S, d)
    witness: torch.Tensor | None = field(default=None, repr=False)  # (B, H, S, bands) fp16
    exact: torch.Tensor | None = field(default=None, repr=False)  # (B, H, S, d), keep_exact only

    def __post_init__(self):
        if not isinstance(self.layout, BandLayout):
            raise ValueError(f"layout must be a BandLayout, got {type(self.layout).__name__}")

    @property
    def length(self) -> int:
        """Number of tokens held."""
        return 0 if self.recon is None else self.recon.shape[-2]

    def append_exact(self, x: torch.Tensor) -> None:
        """Append tokens held exactly (witness 0): ``x`` (B, H, n, d), the exact post-RoPE keys (or values)."""
        _check_plain(x, "x", self.layout.head_dim)
        if self.recon is not None and (x.shape[:2] != self.recon.shape[:2] or x.dtype != self.recon.dtype):
            raise ValueError(
                f"x {tuple(x.shape[:2])} {x.dtype} differs in batch/heads/dtype from the held "
                f"{tuple(self.recon.shape[:2])} {self.recon.dtype}"
            )
        zeros = torch.zeros(*x.shape[:-1], self.layout.bands, dtype=torch.float16, device=x.device)
        self.recon = _cat(self.recon, x)
        self.witness = cat_tokens(*([] if self.witness is None else [self.witness]), zeros)  # band-major
        if self.keep_exact:
            self.exact = _cat(self.exact, x)

    def move(self, x_hat_new: torch.Tensor, start: int = 0) -> None:
        """Tokens ``[start, start + n)`` now read as ``x_hat_new`` (B, H, n, d): maintain their witnesses.

        ``WM``: ``w' = w + ||(x_hat_new - x_hat_old)_b||`` rounded up, or ``witness_of(exact,
        x_hat_new)`` with the shadow. Tokens whose reconstruction did not change keep their witness.
        """
        n = self._check_move(x_hat_new, start)
        stop = start + n
        old = self.recon[..., start:stop, :]
        whole = start == 0 and n == self.length  # then hold the caller's tensor itself: no copy
        if torch.equal(old, x_hat_new):
            self.recon = x_hat_new if whole else self.recon
            return
        if self.keep_exact:
            w_new = witness_of(self.exact[..., start:stop, :], x_hat_new, self.layout)
        else:
            w_new = maintained_witness(self.witness[..., start:stop, :], old, x_hat_new, self.layout)
        self.recon = x_hat_new if whole else _splice(self.recon, x_hat_new, start)
        self.witness = band_major(w_new) if whole else _splice(self.witness, w_new, start, cat_tokens)

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder the batch (beam search): row ``i`` becomes row ``index[i]``."""
        for name in ("recon", "witness", "exact"):
            held = getattr(self, name)
            if held is not None:
                setattr(self, name, held.index_select(0, index.to(held.device)))
        if self.witness is not None:
            self.witness = band_major(self.witness)

    def reset(self) -> None:
        """Forget every token (a new request)."""
        self.recon = self.witness = self.exact = None

    def _check_move(self, x_hat_new: torch.Tensor, start: int) -> int:
        if self.recon is None:
            raise ValueError("move: no tokens are held")
        _check_plain(x_hat_new, "x_hat_new", self.layout.head_dim)
        n = x_hat_new.shape[-2]
        if x_hat_new.shape[:2] != self.recon.shape[:2] or x_hat_new.dtype != self.recon.dtype:
            # a cast here would make the held tensor differ from the one the witness describes
            raise ValueError(
                f"x_hat_new {tuple(x_hat_new.shape)} {x_hat_new.dtype} does not match the held "
                f"{tuple(self.recon.shape)} {self.recon.dtype}"
            )
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start + n > self.length:
            raise ValueError(f"tokens [start, start + n) = [{start}, {start + n}) must lie in [0, {self.length}]")
        return n


def _check_plain(x, name: str, head_dim: int) -> None:
    """A plain, finite, floating (B, H, n, d) tensor: a tensor subclass (a backend's packed QTensor)
    is not the values attention reads."""
    if type(x) is not torch.Tensor:
        raise ValueError(f"{name} must be a plain torch.Tensor (dequantized), got {type(x).__name__}")
    if x.dim() != 4 or x.shape[-1] != head_dim:
        raise ValueError(f"{name} must be (B, H, n, d={head_dim}), got {tuple(x.shape)}")
    if not torch.is_floating_point(x) or not torch.isfinite(x).all():
        raise ValueError(f"{name} must be a finite floating tensor")


def _cat(held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    # the first write is copied too: the caller (a model's in-flight keys) may write its tensor again
    return new.clone() if held is None else torch.cat([held, new], dim=-2)


def _splice(held: torch.Tensor, part: torch.Tensor, start: int, cat=lambda *xs: torch.cat(xs, dim=-2)) -> torch.Tensor:
    """``held`` with tokens ``[start, start + n)`` replaced by ``part`` (a new tensor, joined by ``cat``)."""
    stop = start + part.shape[-2]
    return cat(held[..., :start, :], part, held[..., stop:, :])
