"""The spot check inside the monitor: every cell whose deterministic meter exceeds ``tau``.

``witcert.monitor(..., certificate="spot", spot_keys=m, spot_delta=delta)`` builds a
:class:`SpotSettings`; the ``"witcert"`` attention calls :meth:`SpotSettings.apply` on each
call's fp64 cells. The reported meter becomes ``min(deterministic meter, spot bound)`` (valid
with probability ``1 - spot_delta`` per checked cell: a union of two events, the deterministic one
certain), and the output bound and the joint pass are recomputed from it. Extra columns:
``meter_deterministic``, ``spot_bound`` (NaN where no check ran), ``spot_keys`` and ``spot_bytes``
(exact keys read and their bytes), ``spot_delta`` (the failure probability of each checked cell; 0
where the meter is deterministic).

Exact keys come from the exact cache the store keeps (validation, ``keep_exact=True``) or, in
production (``keep_exact=False``), from the content-checked host backing store the monitor keeps
for the request (:class:`BackedKeys`): the blocks holding the sampled tokens are paged in and
verified against the CRC of the bytes written, and ``spot_bytes`` counts the bytes paged (whole
blocks, keys and values) instead of the key rows used.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from witcert.core import values
from witcert.spot.one_sided import spot_check
from witcert.spot.randomness import SpotRandomness, spot_randomness

CERTIFICATES = ("deterministic", "spot")
SPOT_BLOCK_SIZE = 16
"""Tokens per backing-store block when the spot check alone keeps the store (a gate's block size otherwise)."""


@dataclass
class SpotSettings:
    """Key budget, per-cell failure probability and threshold of the monitor's spot checks."""

    keys: int = 256
    delta: float = 1e-6  # per checked cell (witcert.spot.budget turns a request budget into this)
    tau: float = 0.2  # cells with a deterministic meter above tau are checked
    seed: int | None = None  # replay opt-in; None: the OS's cryptographic source
    randomness: SpotRandomness = field(init=False)

    def __post_init__(self):
        if not isinstance(self.keys, int) or isinstance(self.keys, bool) or self.keys < 1:
            raise ValueError(f"spot_keys must be a positive int, got {self.keys!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"spot_delta must lie in (0, 1), got {self.delta!r}")
        self.randomness = spot_randomness(self.seed)

    def apply(self, math, query, exact_keys, scale: float, tau_k: float, tau_v: float, radii=None):
        """``(math with the spot meter, extra columns)`` for one call (see the module docstring).

        ``math`` a :class:`~witcert.integrations.hf.cells.CallMath`; ``query`` (B, Hq, Tq, d)
        post-RoPE; ``exact_keys`` (B, Hkv, S, d) the exact cache or a :class:`BackedKeys`;
        ``radii`` (B, Hq, Tq, S) the per-token radii the check relies on (default ``math.c``). The
        monitor passes radii that hold for every query (Tier A's where a dithered cache's Tier B
        branch is probabilistic), so ``spot_delta`` is each cell's whole failure probability.
        """
        deterministic = math.cells["meter"]
        checked = (deterministic > self.tau) & ~math.blank  # (B, Hq, Tq)
        bound = torch.full(deterministic.shape, torch.nan, dtype=torch.float64)
        keys_read = torch.zeros(deterministic.shape, dtype=torch.float64)
        bytes_read = torch.zeros(deterministic.shape, dtype=torch.float64)
        readers = ExactReaders(query, exact_keys, scale, math.bias)
        scores = math.scores_hat.detach().cpu()
        radii = (math.c if radii is None else radii).detach().cpu()
        for b, h, t in checked.nonzero().tolist():
            before = readers.bytes_paged
            result = spot_check(scores[b, h, t], radii[b, h, t], readers.cell(b, h, t), keys=self.keys,
                                delta=self.delta, generator=self.randomness.generator)
            bound[b, h, t], keys_read[b, h, t] = result.bound, result.keys_read
            bytes_read[b, h, t] = readers.bytes_paged - before if readers.paged else result.keys_read * readers.row_bytes
        bound = bound.to(deterministic.device)
        meter = torch.where(torch.isnan(bound), deterministic, torch.minimum(deterministic, bound))
        passes = values.joint_pass(meter, math.value_term, math.v_norm_max, tau_k, tau_v)
        cells = dict(math.cells, meter=meter, joint=passes.joint,
                     output_bound=values.output_bound(meter, math.value_term, math.v_norm_max))
        extra = {
            "meter_deterministic": torch.where(math.blank.cpu(), torch.nan, deterministic.cpu().to(torch.float64)),
            "spot_bound": bound.cpu(), "spot_keys": keys_read, "spot_bytes": bytes_read,
            "spot_delta": torch.where(checked.cpu(), self.delta, 0.0).to(torch.float64),
        }
        return replace(math, cells=cells), extra


class BackedKeys:
    """One layer's exact keys in the content-checked backing store, paged in by verified blocks.

    ``length`` is the number of keys the call attends; the store must hold exactly those (a scheme
    that drops or reorders tokens would make the store's positions mean other keys).
    """

    def __init__(self, backing, layer: int, length: int):
        if backing is None:
            raise RuntimeError("spot check in production: the monitor keeps no backing store for this request")
        held = backing.length(layer)
        if held != length:
            raise ValueError(f"backing store: layer {layer} holds {held} exact keys, the call attends {length}: "
                             "its positions would not be the call's tokens")
        self.backing, self.layer, self.kv_heads = backing, layer, backing.lead_shape(layer)[1]
        self._blocks: dict[tuple[int, int, int], torch.Tensor] = {}

    def rows(self, b: int, kv: int, index: torch.Tensor) -> torch.Tensor:
        """``(k, d)`` fp64 exact keys of tokens ``index`` of row ``b``, kv head ``kv`` (each block paged once)."""
        size = self.backing.block_size
        for block in sorted(set((index // size).tolist())):
            if (b, kv, block) not in self._blocks:
                self._blocks[b, kv, block] = self.backing.page_in(self.layer, (b, kv), block).k.to(torch.float64)
        return torch.stack([self._blocks[b, kv, t // size][t % size] for t in index.tolist()])


class ExactReaders:
    """Exact-key readers of one call's cells: fp64 logits ``(q . k_t) * scale + bias_t`` as ``cells.exact_logits``
    forms them.

    ``exact_keys``: the exact cache ``(B, Hkv, S, d)`` or a :class:`BackedKeys`. ``bias``: the additive
    mask term ``(B|1, Hq|1, Tq, S)`` the compressed logits hold (``CallMath.bias``), or ``None``; the
    exact logits must carry it too, or ``W`` would compare logits under two different masks.
    """

    def __init__(self, query, exact_keys, scale: float, bias: torch.Tensor | None = None):
        self.q64 = query.detach().to(torch.float64).cpu()  # (B, Hq, Tq, d)
        self.bias = None if bias is None else bias.detach().to(torch.float64).cpu()
        self.paged = isinstance(exact_keys, BackedKeys)
        if self.paged:
            self._backed, self._paged_at_start = exact_keys, exact_keys.backing.bytes_paged
            kv_heads, self.row_bytes = exact_keys.kv_heads, 0
        else:
            self.k64 = exact_keys.detach().to(torch.float64).cpu()  # (B, Hkv, S, d)
            kv_heads, self.row_bytes = self.k64.shape[1], exact_keys.shape[-1] * exact_keys.element_size()
        self.groups, self.scale = self.q64.shape[1] // kv_heads, scale

    @property
    def bytes_paged(self) -> int:
        """Bytes the backing store paged in for this call's checks so far (0 from the exact cache)."""
        return self._backed.backing.bytes_paged - self._paged_at_start if self.paged else 0

    def cell(self, b: int, h: int, t: int):
        """``read(index (k,)) -> (k,)`` exact logits of cell (row ``b``, query head ``h``, query ``t``)."""
        q, kv = self.q64[b, h, t], h // self.groups
        row = None if self.bias is None else self.bias[min(b, self.bias.shape[0] - 1), min(h, self.bias.shape[1] - 1), t]
        if self.paged:
            def keys(index):
                return self._backed.rows(b, kv, index)
        else:
            def keys(index, cached=self.k64[b, kv]):
                return cached[index]

        def read(index):
            logits = (keys(index) @ q) * self.scale
            return logits if row is None else logits + row[index]
        return read


def spot_settings(certificate: str, keys: int, delta: float, tau: float,
                  seed: int | None = None) -> SpotSettings | None:
    """The monitor's spot settings (``None`` for the deterministic certificate), checked."""
    if certificate not in CERTIFICATES:
        raise ValueError(f"certificate must be one of {CERTIFICATES}, got {certificate!r}")
    if certificate == "deterministic":
        return None
    return SpotSettings(keys=keys, delta=delta, tau=tau, seed=seed)
