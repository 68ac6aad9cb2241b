"""A KV format a serving engine ships, as one object: the scheme ``fn(x) -> x_hat`` and the codec that packs it.

The formats of :mod:`witcert.schemes.engine_formats` (vLLM's per-token-head INT8/FP8/INT4, NVFP4,
TurboQuant; SGLang's FP4 E2M1) reproduce an engine's write path: the codes and scales it stores.
One object serves both uses, so they can never disagree:

- as a registered scheme, ``fmt(x, role)`` is ``decode(encode(x, role), x.dtype)``: the reconstruction
  the engine's attention reads, in the model's frame and dtype (Tier A, Theorem 2 ``T2``: the witness is
  formed on exactly these values, so soundness never depends on how faithfully the format is emulated);
- as a codec (:mod:`witcert.integrations.hf.codecs`), ``encode`` returns the packed codes and scales the
  engine stores and ``decode`` reads them back, so a production monitor (``keep_exact=False``) holds the
  engine's bytes, not a reconstruction.

Every packed part is per token (``token_axes``), so a monitored cache grows it in place. A reconstruction
is formed as the exact real number the engine's dequantization denotes (codes times scales, in fp64,
where every product here is exact) and rounded once to the model's dtype.
"""
from __future__ import annotations

import torch

from witcert.tier_a.witness_code import DEFAULT_WITNESS_BITS, WitnessCode



class KVFormat:
    """Base of the engine formats: the scheme and the codec from ``pack``/``decode``; subclasses are frozen dataclasses.

    Subclasses define ``pack(x, role) -> tuple`` (the engine's codes and scales), ``decode(packed, dtype) -> Tensor``,
    ``token_axes`` (one axis per packed part, ``None`` for a part that is not per token),
    ``code_bytes(head_dim, role) -> int`` (bytes the engine stores per token per kv head) and
    ``source`` (the engine file and revision followed).
    """

    token_axes: tuple = ()
    source: str = ""
    label: str = "KV format"  # the name errors give (the registered scheme's)

    def __call__(self, x: torch.Tensor, role: str = "key") -> torch.Tensor:
        """The reconstruction the engine's attention reads, same shape and dtype as ``x`` (..., S, d)."""
        return self._checked(x, self.pack(x, role))[1]

    def encode(self, x: torch.Tensor, role: str = "key", start: int = 0) -> tuple:
        """The codec's write: :meth:`pack`, refused (``ValueError``) where the engine would read back ``inf``."""
        return self._checked(x, self.pack(x, role))[0]

    def _checked(self, x: torch.Tensor, packed: tuple) -> tuple:
        """``(packed, its decode in x's dtype)``; ``ValueError`` naming the format when the decode is not finite (a
        reconstruction beyond the model dtype's range: the engine's dequantized key would be ``inf``)."""
        decoded = self.decode(packed, x.dtype)
        if not bool(torch.isfinite(decoded).all()):
            raise ValueError(f"{self.label}: a reconstructed value overflows {x.dtype} (the engine "
                             "would read inf): this format cannot hold this tensor")
        return packed, decoded

    @property
    def summary(self) -> str:
        """One line: what the engine stores (the class docstring's first line)."""
        return (type(self).__doc__ or "").strip().splitlines()[0]

    def nbytes(self, packed: tuple) -> int:
        """Bytes the packed chunk occupies (codes and scales as the engine stores them)."""
        return sum(p.numel() * p.element_size() for p in packed if isinstance(p, torch.Tensor))

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ``ValueError`` when the engine cannot store a head of ``head_dim`` channels (default: any)."""

    def bytes_per_token(self, head_dim: int, bands: int) -> dict:
        """Bytes per token per kv head, keys and values: ``codes`` (what the engine stores), ``witness`` (the
        production monitor's key witness and value statistics at its default witness code) and ``bf16`` (an uncompressed bf16 cache)."""
        self.check_head_dim(head_dim)
        codes = self.code_bytes(head_dim, "key") + self.code_bytes(head_dim, "value")
        return {"codes": codes, "witness": WitnessCode(DEFAULT_WITNESS_BITS).bytes_per_token(bands),
                "bf16": 2 * 2 * head_dim}

    def code_bytes(self, head_dim: int, role: str) -> int:
        raise NotImplementedError


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes (..., d) as the little-endian bit stream engines store: bit ``j`` of code ``i``
    is bit ``bits i + j`` of the stream -> uint8 (..., ceil(d bits / 8)). For 4 bits the even code is the low
    nibble; for 3 bits each 8 codes fill 3 bytes (vLLM's ``_tq_fused_store_mse``, ``_store_quantized_value``)."""
    if bits == 8:
        return codes.to(torch.uint8)
    weights = 1 << torch.arange(bits, device=codes.device)
    stream = ((codes.to(torch.int64)[..., None] & weights) != 0).flatten(-2)  # (..., d bits) bits, LSB first
    stream = torch.nn.functional.pad(stream.to(torch.uint8), (0, -stream.shape[-1] % 8))
    return (stream.unflatten(-1, (-1, 8)).to(torch.int64) << torch.arange(8, device=codes.device)).sum(-1).to(
        torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int64 codes (..., d)."""
    if bits == 8:
        return packed.to(torch.int64)
    stream = ((packed.to(torch.int64)[..., None] >> torch.arange(8, device=packed.device)) & 1).flatten(-2)
    return (stream[..., : d * bits].unflatten(-1, (d, bits)) << torch.arange(bits, device=packed.device)).sum(-1)


def exact_product(*factors: torch.Tensor) -> torch.Tensor:
    """The product of the factors in fp64 (each product here has at most 53 significant bits: exact)."""
    out = factors[0].to(torch.float64)
    for f in factors[1:]:
        out = out * f.to(torch.float64)
    return out


def blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """(..., d) -> (..., d / size, size)."""
    return x.unflatten(-1, (-1, size))


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fl32(a b + c)`` rounded once, as a fused multiply-add: Triton contracts ``a * b + c`` on fp32 into one
    ``fma`` by default (``enable_fp_fusion``). ``a b`` is exact in fp64; ``a b + c`` is formed in fp64 with its
    rounding error (TwoSum) and rounded to fp32 once, so no double rounding can move a tie."""
    product = a.to(torch.float64) * b.to(torch.float64)  # 24 x 24 bits: exact
    c64 = c.to(torch.float64)
    hi = product + c64
    back = hi - product
    lo = (product - (hi - back)) + (c64 - back)  # hi + lo == a b + c exactly
    r = hi.to(torch.float32)
    toward = hi - r.to(torch.float64)  # nonzero: r is one of the two fp32 neighbours of hi
    other = torch.nextafter(r, torch.where(toward > 0, torch.inf, -torch.inf).to(torch.float32))
    midpoint = (toward != 0) & (2 * toward == other.to(torch.float64) - r.to(torch.float64))
    return torch.where(midpoint & (torch.sign(lo) == torch.sign(toward)), other, r)
