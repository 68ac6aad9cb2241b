"""How a compressed cache stores one written chunk of keys or values: codecs.

A codec turns the exact new tokens of one layer ``x`` (B, Hkv, T, d) into what the cache holds
(``encode``) and back into the tensor attention reads (``decode``). The witness is always formed
against ``decode(encode(x))``, the very values attention will read (decoding is deterministic),
so the certificate never depends on how the codec packs.

What saves memory, honestly:

- :class:`IntCodes`: the built-in ``rtn-int8``/``rtn-int4``/``rtn-int2`` schemes as integer codes
  (int8, two int4 or four int2 codes per byte) plus each group's absolute maximum in the input's
  dtype (2 bytes per 32 channels for a bf16 model: it is one of the group's values, so exact), from
  which decoding forms the registered scheme's scale; bit-identical to the registered scheme;
- :class:`KiviCodes`: the built-in ``kivi-2bit`` as 2-bit codes, four per byte, with each group's
  minimum and maximum in the input's dtype (keys: per channel over each complete 32-token group, the
  rest of a chunk exact; values: per token over 32 channels); bit-identical to the registered scheme;
- :class:`ScaledFloat8`: the built-in ``fp8-e4m3-scaled`` as fp8 codes plus one fp32 scale per
  chunk; bit-identical to the registered scheme; :class:`Float8Cast`: the raw ``fp8-e4m3`` cast as its fp8
  values (one byte each), bit-identical too;
- the engine formats (:mod:`witcert.schemes.engine_formats`: per-token-head INT8/FP8/INT4, NVFP4, MXFP4,
  TurboQuant): each format object is its own codec, storing the engine's packed codes and scales;
- :class:`Dither`: the Tier B dithered INT8 store (int8 payload, fp16 scales; the dither is
  regenerated from its counter, never stored);
- :class:`Reconstruction`: any other scheme, including a plain user callable. A callable
  returns a reconstruction in the model's dtype, and nothing about it says how it was coded, so
  the cache can only hold that reconstruction: in the narrowest float dtype that represents every
  value *exactly* (checked per chunk: a raw ``fp8-e4m3`` cast fits fp8, one byte per value),
  otherwise in the model's dtype. Then the compressed cache plus its witness is *larger* than the
  exact cache: the first such chunk of a production cache warns once (:class:`HeldReconstructionWarning`),
  naming the bytes, and the monitor's memory report says so. A user who wants the saving writes a
  codec object with ``encode(x, role)``/``decode(packed, dtype)``/``nbytes(packed)`` methods (and,
  optionally, ``join(first, second)``: one packed chunk of both, which the cache then holds instead of
  one chunk per step, as :class:`IntCodes` does) and passes it as the scheme.

A codec may also declare an elementwise bound on its reconstruction error, ``error_bound(packed, decoded)``
(a float64 tensor ``e`` broadcastable to ``decoded``, ``|x - decode(packed)| <= e``): the monitor can then derive
the witness from it instead of storing one (``witness_bits=0`` or ``4``, :mod:`witcert.tier_a.derived_witness`,
``DW``), the bound checked against the exact tokens on write. The built-in :class:`KiviCodes`,
:class:`ScaledFloat8` and :class:`Float8Cast` declare elementwise bounds; :class:`IntCodes` declares its bound per
channel group from the stored maxima (``group_error_bound(packed, dtype)``), which a read reduces without a decode.
:func:`default_witness_bits` picks the monitor's default witness per codec.

A user codec is held through :class:`OwnedCodec` (:func:`owned_codec`): the store owns what it holds.
``encode`` gets a private copy of the exact tokens, and every tensor ``encode``, ``decode`` and
``join`` return is copied (a codec may write into a workspace it reuses for the next layer);
``decode`` must be deterministic (checked at its first call) and ``join`` must not re-quantize:
``decode(join(a, b))`` must equal ``decode(a)`` then ``decode(b)`` bit for bit, checked at every
join (the witnesses describe each chunk as written, and a production cache reads the joined
chunk). The built-in codecs allocate every output afresh and join by concatenation, so they are
held as they are.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import torch

from witcert.schemes import builtin
from witcert.schemes.engine_formats import format_of
from witcert.schemes.kv_format import KVFormat
from witcert.schemes.registry import apply_scheme, get_scheme
from witcert.tier_a.derived_witness import rounding_terms
from witcert.tier_a.witness_code import DEFAULT_WITNESS_BITS

NARROW_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16)  # narrowest first


def nbytes(*tensors) -> int:
    """Bytes of the storage the given tensors (``None`` skipped) occupy."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class HeldReconstructionWarning(UserWarning):
    """A production cache holds a scheme's reconstruction in the model's dtype: no memory saved (use a codec)."""


def _warn_held(scheme, x: torch.Tensor) -> None:
    name = scheme if isinstance(scheme, str) else getattr(scheme, "__name__", type(scheme).__name__)
    per_token = 2 * x.shape[-1] * x.element_size()
    warnings.warn(
        f"scheme {name!r}: a production cache (keep_exact=False) holds this function's reconstruction as {x.dtype} "
        f"values, {per_token} bytes per token and kv head for keys and values: as much as the exact cache, plus "
        "the witness, so nothing is saved. Give the scheme as a codec (encode to packed codes and scales, decode, "
        "nbytes) to hold the codes: docs/guides/own-scheme.md, 'A codec: what saves memory'",
        HeldReconstructionWarning, stacklevel=3)


@dataclass(frozen=True)
class Reconstruction:
    """Any scheme ``fn(x) -> x_hat``: hold the reconstruction, narrowed losslessly when ``narrow``."""

    scheme: object  # registered name or callable
    narrow: bool = False
    _warned: list = field(default_factory=list, compare=False, repr=False)  # the one-time memory warning, once given

    def encode(self, x: torch.Tensor, role: str, start: int = 0) -> torch.Tensor:
        x_hat = apply_scheme(self.scheme, x, role=role)  # private copy, checked shape/dtype/finite
        if self.narrow:
            for dtype in NARROW_DTYPES:
                if torch.empty((), dtype=dtype).element_size() >= x_hat.element_size():
                    continue
                narrow = x_hat.to(dtype)
                if torch.equal(narrow.to(x_hat.dtype), x_hat):
                    return narrow
            if not self._warned:  # once per codec, i.e. per monitor
                self._warned.append(True)
                _warn_held(self.scheme, x)
        return x_hat

    token_axes = -2  # the reconstruction (..., T, d): a store grows it in place (packed_history)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return packed.to(dtype)

    def nbytes(self, packed: torch.Tensor) -> int:
        return nbytes(packed)


@dataclass(frozen=True)
class IntCodes:
    """Built-in round-to-nearest INT8/4/2 (per token, groups of 32 channels) as packed codes + fp32 scales."""

    bits: int
    group: int = builtin.GROUP

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, got {self.bits!r}")

    def encode(self, x: torch.Tensor, role: str, start: int = 0) -> tuple:
        work = builtin._work(x)  # fp32 (fp64 for fp64), as the registered scheme computes
        grouped = builtin._channel_groups(work, self.group)  # (..., d/g, g)
        amax = grouped.abs().amax(dim=-1, keepdim=True)  # one of x's values: exact in x.dtype
        codes = (grouped / self._scale(amax)).round_().clamp_(-self.qmax, self.qmax).to(torch.int8).flatten(-2)
        return _pack(codes, self.bits, self.group), amax.to(x.dtype), x.shape[-1]

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The registered scheme's scale from a group's absolute maximum, in the work dtype."""
        amax = builtin._work(amax) / self.qmax
        return torch.where(amax > 0, amax, 1.0)  # builtin._safe

    def decode(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        payload, amax, d = packed
        scale = self._scale(amax)  # the same fp32 (fp64) scale encode used, from the same maximum
        # the codes converted to the scales' dtype (exactly: |code| <= 127), then scaled in place: one rounding per
        # product, the values of the registered scheme; a plain conversion and an in-place multiply stream the
        # cache faster than one mixed-dtype multiply (measured 123 against 167 us for SmolLM2's keys and values
        # at 540 tokens, caches cold)
        decoded = _unpack(payload, self.bits, d, self.group).to(scale.dtype)
        decoded.unflatten(-1, (scale.shape[-2], -1)).mul_(scale)
        return decoded.to(dtype)

    def nbytes(self, packed: tuple) -> int:
        return nbytes(packed[0], packed[1])

    def group_error_bound(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        """fp64 bound (..., T, G) on ``|x_i - decode(packed)_i|`` for every channel ``i`` of group ``g`` (``DW``), from
        the stored maxima alone (no decode): half a step, the work dtype's roundings, the cast to ``dtype``.

        ``|x/s - code| <= 1/2 + 2 u_w qmax`` (the division rounds, the clamp cuts at most ``u_w qmax``); the product
        ``code s`` rounds by ``u_w qmax s`` and is at most ``qmax s (1 + u_w)``; the cast to the model dtype moves a
        value ``y`` by ``u_m |fl(y)| + a_m <= u_m (1 + u_m) |y| + a_m``
        (:func:`~witcert.tier_a.derived_witness.rounding_terms`). A group whose maximum is 0 decodes to 0 exactly.
        """
        _, amax, _ = packed
        scale = self._scale(amax)[..., 0].double()  # (..., T, G): the work-dtype scale decode uses, exactly
        u_w, _ = rounding_terms(builtin._work(amax).dtype)
        u_m, a_m = rounding_terms(dtype)
        peak = scale * self.qmax * (1 + 4 * u_w)  # >= |code s| and its rounding
        bound = scale * (0.5 + 4 * u_w * self.qmax) + u_m * (1 + 2 * u_m + 2.0**-20) * peak + a_m
        return torch.where(amax[..., 0].double() > 0, bound, torch.zeros_like(bound))

    token_axes = (-2, -3, None)  # codes (..., T, d'), scales (..., T, d/g, 1), d: a store grows them in place
    roles_alike = True  # keys and values are coded the same way (role and start ignored): a store codes both at once

    def join(self, first: tuple, second: tuple) -> tuple:
        """One packed chunk: ``first``'s tokens then ``second``'s (codes and scales concatenated on the
        token axis), so the cache decodes its whole history in one call instead of one per step."""
        return torch.cat([first[0], second[0]], dim=-2), torch.cat([first[1], second[1]], dim=-3), first[2]


@dataclass(frozen=True)
class KiviCodes:
    """Built-in ``kivi-2bit`` (one written chunk at a time) as 2-bit codes with each group's minimum and maximum.

    A packed chunk is a tuple of segments in token order, each ``(kind, tensors...)``:
    ``("groups", codes, lo, hi)`` keys of complete 32-token groups, per channel ((..., G, 32, d/4) codes,
    (..., G, 1, d) bounds); ``("rows", codes, lo, hi)`` values per token over 32-channel groups
    ((..., T, d/4), (..., T, d/g, 1)); ``("exact", x)`` the keys of a chunk's last ``T mod 32`` tokens.
    ``lo``/``hi`` are values of the chunk, so the input's dtype holds them exactly and decoding forms the
    registered scheme's scale ``(hi - lo) / 3`` bit for bit. :meth:`join` concatenates, merging segments
    of one kind: a decode step's exact key joins the exact tail, its value row the rows.
    """

    group: int = builtin.GROUP
    LEVELS = 3  # 2 bits: codes 0..3

    def encode(self, x: torch.Tensor, role: str, start: int = 0) -> tuple:
        work = builtin._work(x)
        if role == "value":
            grouped = builtin._channel_groups(work, self.group)  # (..., T, d/g, g)
            return (self._segment("rows", grouped, -1, x.dtype),)
        full = (x.shape[-2] // self.group) * self.group
        segments = []
        if full:
            head = work[..., :full, :].unflatten(-2, (-1, self.group))  # (..., G, 32, d)
            segments.append(self._segment("groups", head, -2, x.dtype))
        if full < x.shape[-2]:
            segments.append(("exact", x[..., full:, :].clone()))
        return tuple(segments)

    def _segment(self, kind: str, grouped: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple:
        lo, hi = grouped.amin(dim=dim, keepdim=True), grouped.amax(dim=dim, keepdim=True)
        codes = torch.round((grouped - lo) / self._scale(lo, hi)).clamp(0, self.LEVELS).to(torch.int8)
        flat = codes.flatten(-2) if kind == "rows" else codes  # values: (..., T, d); keys: (..., G, 32, d)
        return kind, _pack(flat - 2, 2), lo.to(dtype), hi.to(dtype)  # 0..3 stored as -2..1, four per byte

    def _scale(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """The registered scheme's scale (builtin._asymmetric) from the group's bounds, in the work dtype."""
        return builtin._safe((builtin._work(hi) - builtin._work(lo)) / self.LEVELS)

    def decode(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        parts = [self._decoded(segment, dtype) for segment in packed]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def _decoded(self, segment: tuple, dtype: torch.dtype) -> torch.Tensor:
        if segment[0] == "exact":
            return segment[1].to(dtype)
        kind, payload, lo, hi = segment
        lo_w = builtin._work(lo)
        d = payload.shape[-1] * 4 if payload.dtype == torch.uint8 else payload.shape[-1]  # packed four per byte
        codes = (_unpack(payload, 2, d) + 2).to(lo_w.dtype)
        if kind == "rows":
            codes = codes.unflatten(-1, (lo.shape[-2], -1))  # (..., T, d/g, g)
        decoded = codes * self._scale(lo, hi) + lo_w  # the registered scheme's two roundings
        return (decoded.flatten(-2) if kind == "rows" else decoded.flatten(-3, -2)).to(dtype)

    def nbytes(self, packed: tuple) -> int:
        return sum(nbytes(*segment[1:]) for segment in packed)

    def error_bound(self, packed: tuple, decoded: torch.Tensor) -> torch.Tensor:
        """Elementwise fp64 bound on ``|x - decode(packed)|`` (``DW``): half the group's step ``(hi - lo)/3`` and
        the work dtype's roundings (of ``x - lo``, the division, the product and the sum: ``16 u_w`` steps and
        ``4 u_w (|lo| + |hi|)``), then the cast to ``decoded``'s dtype; the exact key tail is exact (0)."""
        parts = [self._segment_bound(segment) for segment in packed]
        step = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
        return _plus_cast(step, decoded)

    def _segment_bound(self, segment: tuple) -> torch.Tensor:
        if segment[0] == "exact":
            return torch.zeros(segment[1].shape, dtype=torch.float64, device=segment[1].device)
        kind, payload, lo, hi = segment
        scale = self._scale(lo, hi)
        u_w, _ = rounding_terms(scale.dtype)
        step = scale.double() * (0.5 + 16 * u_w) + 4 * u_w * (lo.double().abs() + hi.double().abs())
        if kind == "rows":  # (..., T, d/g, 1) per token over channel groups
            g = payload.shape[-1] * 4 // lo.shape[-2] if payload.dtype == torch.uint8 else payload.shape[-1] // lo.shape[-2]
            return step.expand(*step.shape[:-1], g).flatten(-2)
        # keys: (..., G, 1, d) per channel over 32-token groups
        return step.expand(*step.shape[:-2], self.group, step.shape[-1]).flatten(-3, -2)

    def join(self, first: tuple, second: tuple) -> tuple:
        """``first``'s tokens then ``second``'s: segments concatenated, neighbours of one kind merged."""
        segments = list(first)
        for segment in second:
            if segments and segments[-1][0] == segment[0]:
                held = segments.pop()
                joined = (torch.cat([a, b], dim=axis) for a, b, axis in zip(held[1:], segment[1:], _KIVI_AXES[held[0]]))
                segment = (segment[0], *joined)
            segments.append(segment)
        return tuple(segments)


_KIVI_AXES = {"groups": (-3, -3, -3), "rows": (-2, -3, -3), "exact": (-2,)}  # each tensor's group or token axis


@dataclass(frozen=True)
class ScaledFloat8:
    """Built-in ``fp8-e4m3-scaled``: fp8 E4M3 codes and one fp32 (fp64) amax scale per written chunk."""

    def encode(self, x: torch.Tensor, role: str, start: int = 0) -> tuple:
        work = builtin._work(x)
        scale = builtin._safe(work.abs().amax() / builtin.E4M3_MAX)
        return (work / scale).clamp(-builtin.E4M3_MAX, builtin.E4M3_MAX).to(torch.float8_e4m3fn), scale

    def decode(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        coded, scale = packed
        return (coded.to(scale.dtype) * scale).to(dtype)

    def nbytes(self, packed: tuple) -> int:
        return nbytes(*packed)

    def error_bound(self, packed: tuple, decoded: torch.Tensor) -> torch.Tensor:
        """Elementwise fp64 bound on ``|x - decode(packed)|`` (``DW``): E4M3's half-spacing around the code
        (:func:`e4m3_half_spacing`) times the scale, the work dtype's roundings of ``x / s`` and of the product
        (``4 u_w |code| s``), then the cast to ``decoded``'s dtype."""
        coded, scale = packed
        u_w, _ = rounding_terms(scale.dtype)
        code = coded.double()
        s = scale.double()
        return _plus_cast(s * (e4m3_half_spacing(code) * (1 + 4 * u_w) + 4 * u_w * code.abs()), decoded)


@dataclass(frozen=True)
class Float8Cast:
    """Built-in ``fp8-e4m3`` (the raw cast, clamped to +-448) held as its fp8 E4M3 values: one byte per value,
    bit-identical to the registered scheme, with its elementwise error bound (``DW``)."""

    def encode(self, x: torch.Tensor, role: str, start: int = 0) -> torch.Tensor:
        return builtin._work(x).clamp(-builtin.E4M3_MAX, builtin.E4M3_MAX).to(torch.float8_e4m3fn)

    token_axes = -2  # the fp8 values (..., T, d): a store grows them in place

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return packed.to(dtype)

    def nbytes(self, packed: torch.Tensor) -> int:
        return nbytes(packed)

    def error_bound(self, packed: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """E4M3's half-spacing around each value (:func:`e4m3_half_spacing`), ``inf`` where the cast may have
        clamped (``|x^| = 448``), then the cast to ``decoded``'s dtype."""
        code = packed.double()
        # 2^-22 |c|: an fp64 input may reach E4M3 through fp32 (a second rounding)
        spacing = e4m3_half_spacing(code) + 2.0**-22 * code.abs()
        return _plus_cast(torch.where(code.abs() >= builtin.E4M3_MAX, torch.inf, spacing), decoded)


E4M3_SUBNORMAL_HALF = 2.0**-10  # half the spacing 2^-9 of the subnormals (and of the normal binade [2^-6, 2^-5))


def e4m3_half_spacing(code: torch.Tensor) -> torch.Tensor:
    """fp64 half-spacing of the E4M3 grid above each value ``c``: ``2^(E - 4)`` for ``2^E <= |c| < 2^(E+1)``,
    ``E >= -6``, and ``2^-10`` below ``2^-6`` (the subnormals' spacing is ``2^-9``). A real ``y`` that rounds
    to nearest to ``c`` (no clamp) is within it: inside a binade by its half ulp, and a ``y`` just below a
    power of two ``c`` by the smaller half ulp of the binade beneath."""
    _, exponent = torch.frexp(code.abs())  # |c| = m 2^e, m in [1/2, 1): E = e - 1
    return torch.clamp(torch.ldexp(torch.ones_like(code), exponent - 5), min=E4M3_SUBNORMAL_HALF)


def _plus_cast(bound: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """``bound`` (fp64) plus the rounding of the cast to ``decoded``'s dtype: ``|y - fl(y)| <= u_m |fl(y)| + a_m``
    (half an ulp of ``fl(y)``'s binade, or of the subnormals), with ``2^-20`` relative to spare."""
    u_m, a_m = rounding_terms(decoded.dtype)
    return bound + (u_m * (1 + 2.0**-20) * decoded.double().abs() + a_m)


@dataclass
class Dither:
    """The Tier B dithered INT8 cache of one layer: each row its own stream ``(request, layer, ...)``.

    ``requests`` holds one distinct id per batch row (``witcert.tier_b.counters.batch_requests``);
    ``seed`` is the secret Philox seed of the request (``None``: drawn from the OS).
    """

    quantizer: object  # witcert.DitheredInt8
    layer: int
    seed: int | None = None
    requests: tuple[int, ...] | None = None
    row_requests: tuple[int, ...] = field(default=(), init=False)

    def __post_init__(self):
        from witcert.tier_b.counters import check_seed, fresh_seed

        self.seed = check_seed(fresh_seed() if self.seed is None else self.seed)

    def counter(self, role: str, start: int, rows: torch.Tensor):
        from witcert.tier_b.counters import StandaloneCounter

        return StandaloneCounter(request=rows, layer=self.layer, seed=self.seed, side="k" if role == "key" else "v",
                                 token_offset=start)

    def encode(self, x: torch.Tensor, role: str, start: int = 0) -> tuple:
        from witcert.tier_b.counters import batch_requests

        rows = batch_requests(self.requests, x.shape[0])
        self.row_requests = tuple(rows.tolist())
        return self.quantizer.quantize(x, self.counter(role, start, rows)), role, start, rows

    def decode(self, packed: tuple, dtype: torch.dtype) -> torch.Tensor:
        store, role, start, rows = packed
        return self.quantizer.dequantize(store, self.counter(role, start, rows), dtype=dtype)

    def nbytes(self, packed: tuple) -> int:
        return packed[0].nbytes()

    @staticmethod
    def packed_store(packed: tuple):
        """The :class:`witcert.tier_b.packed_store.PackedStore` of a chunk (the Tier B bound reads it)."""
        return packed[0]


class OwnedCodec:
    """A user codec as a store holds it: private inputs, copied outputs, checked ``decode`` and ``join``.

    Parameters
    ----------
    inner : object
        The user's codec (``encode(x, role, start)``, ``decode(packed, dtype)``, ``nbytes(packed)``,
        optionally ``join(first, second)``).

    ``encode`` gets ``x.clone()`` (it may quantize in place) and its packed output is copied
    (tensors cloned, containers rebuilt, anything else deep-copied); ``decode`` returns a copy.
    The first ``decode`` runs twice and must give the same bits: the witness is formed on one
    decode and a production cache reads another. ``join`` exists when the inner codec has one;
    it raises ``ValueError`` unless the joined chunk decodes bit-identically to the two chunks
    decoded one after the other (a join that re-quantizes, e.g. per-channel scales over every held
    token, would make the cache read keys no witness describes).
    """

    def __init__(self, inner):
        self.inner = inner
        self.name = type(inner).__name__
        self._dtype: torch.dtype | None = None  # of the tokens encoded (what join decodes to)
        self._decode_checked = False
        self._bound_checked = False
        if callable(getattr(inner, "join", None)):
            self.join = self._join
        if callable(getattr(inner, "error_bound", None)):
            self.error_bound = self._error_bound

    def encode(self, x: torch.Tensor, role: str, start: int = 0):
        self._dtype = x.dtype
        return _copied(self.inner.encode(x.clone(), role, start))

    def decode(self, packed, dtype: torch.dtype) -> torch.Tensor:
        decoded = self._decoded(packed, dtype)
        if not self._decode_checked:
            if not torch.equal(decoded, self._decoded(packed, dtype)):
                raise ValueError(f"codec {self.name}: decode(packed) gave different values on two calls; decode "
                                 "must be a deterministic function of the packed chunk (the witness is formed on "
                                 "one decode, attention reads another)")
            self._decode_checked = True
        return decoded

    def nbytes(self, packed) -> int:
        return self.inner.nbytes(packed)

    def _decoded(self, packed, dtype: torch.dtype) -> torch.Tensor:
        decoded = self.inner.decode(packed, dtype)
        if type(decoded) is not torch.Tensor or decoded.dtype != dtype:
            raise ValueError(f"codec {self.name}: decode must return a plain torch.Tensor of dtype {dtype}, got "
                             f"{type(decoded).__name__} {getattr(decoded, 'dtype', '')}")
        return decoded.clone()

    def _join(self, first, second):
        joined = _copied(self.inner.join(first, second))
        halves = self.decode(first, self._dtype), self.decode(second, self._dtype)
        parts = torch.cat(halves, dim=-2)
        decoded = self.decode(joined, self._dtype)
        if not torch.equal(decoded, parts):
            raise ValueError(
                f"codec {self.name}: decode(join(first, second)) differs from decode(first) then decode(second); "
                "join must only concatenate (a join that re-quantizes the held tokens moves keys after their "
                "witness was formed). Drop join (one chunk per write) or make it lossless")
        if hasattr(self, "error_bound"):
            bounds = [self.error_bound(p, d) for p, d in zip((first, second), halves)]
            if not torch.equal(self.error_bound(joined, decoded), torch.cat(bounds, dim=-2)):
                raise ValueError(f"codec {self.name}: error_bound(join(first, second)) differs from error_bound of each "
                                 "chunk: a derived witness is checked against each chunk's bound when it is written")
        return joined

    def _error_bound(self, packed, decoded: torch.Tensor) -> torch.Tensor:
        """The inner codec's elementwise bound as a float64 tensor of ``decoded``'s shape (a copy); its first
        call runs twice and must give the same bits (the bound checked at write time is the one read)."""
        bound = self._bound(packed, decoded)
        if not self._bound_checked:
            if not torch.equal(bound, self._bound(packed, decoded)):
                raise ValueError(f"codec {self.name}: error_bound(packed, decoded) gave different values on two calls; "
                                 "it must be a deterministic function of the packed chunk")
            self._bound_checked = True
        return bound

    def _bound(self, packed, decoded: torch.Tensor) -> torch.Tensor:
        bound = self.inner.error_bound(packed, decoded)
        if type(bound) is not torch.Tensor or bound.dtype != torch.float64:
            raise ValueError(f"codec {self.name}: error_bound must return a plain torch.Tensor of dtype float64, got "
                             f"{type(bound).__name__} {getattr(bound, 'dtype', '')}")
        try:
            return bound.expand_as(decoded).clone()
        except RuntimeError:
            raise ValueError(f"codec {self.name}: error_bound of shape {tuple(bound.shape)} does not broadcast to the "
                             f"decoded chunk {tuple(decoded.shape)}") from None


def owned_codec(codec):
    """``codec`` as a store holds it: a built-in codec as it is (fresh outputs, concatenating join), any
    other wrapped in :class:`OwnedCodec`."""
    held = type(codec) in _BUILTIN_CODECS or isinstance(codec, (OwnedCodec, KVFormat))  # fresh outputs, no join
    return codec if held else OwnedCodec(codec)


def _copied(packed):
    """A copy of a packed chunk that shares no tensor memory with it (the store owns what it holds)."""
    if isinstance(packed, torch.Tensor):
        return packed.clone()
    if isinstance(packed, (tuple, list)):
        return type(packed)(_copied(p) for p in packed)
    if isinstance(packed, dict):
        return {name: _copied(p) for name, p in packed.items()}
    return copy.deepcopy(packed)


def codec_for(scheme, packed: bool):
    """The codec of ``scheme`` (a registered name, a callable, or a codec object).

    ``packed=False`` (the exact cache is kept, memory is not the point): the reconstruction as the
    scheme returns it. ``packed=True``: the packed codec of a built-in scheme when ``scheme`` names
    one and the registry still maps that name to the built-in function, a lossless narrowing of
    the reconstruction otherwise (see the module docstring).
    """
    if all(callable(getattr(scheme, name, None)) for name in ("encode", "decode", "nbytes")):
        return scheme
    if isinstance(scheme, str):
        registered = getattr(get_scheme(scheme), "__wrapped__", None)  # raises on an unknown name
        if packed and format_of(registered) is not None:  # an engine format is its own codec: the engine's bytes
            return registered
        for fn, codec in _PACKED_BUILTINS.items():
            if packed and registered is fn:
                return codec
    elif not callable(scheme):
        raise ValueError(f"scheme must be a registered name, a callable x -> x_hat or a codec, got "
                         f"{type(scheme).__name__}")
    return Reconstruction(scheme, narrow=packed)


_BUILTIN_CODECS = (Reconstruction, IntCodes, KiviCodes, ScaledFloat8, Float8Cast, Dither)  # every output fresh; joins concatenate

_PACKED_BUILTINS = {
    builtin.rtn_int8: IntCodes(8),
    builtin.rtn_int4: IntCodes(4),
    builtin.rtn_int2: IntCodes(2),
    builtin.kivi_2bit: KiviCodes(),
    builtin.fp8_e4m3_scaled: ScaledFloat8(),
    builtin.fp8_e4m3: Float8Cast(),
}


def default_witness_bits(codec, spot: bool = False) -> int:
    """The monitor's default witness for a codec (``witness_bits=None``), chosen from the held-out-style coverage at
    tau 0.2 on SmolLM2 (16 bands; ``benchmarks/results/witness_derived.json``) and from what a read costs:

    - ``0`` (derived, nothing stored per band) for the built-in rtn-int4 and rtn-int2: their meters saturate with
      any witness (rtn-int4 0.000 stored and derived), so stored bytes buy nothing, unless a spot check samples by
      the meter's per-key radii (``spot``: ``certificate="spot"`` or an audit): there the stored byte's tighter radii
      certify about 4x the cells (rtn-int4, 512 tokens, the production spot gate: 0.543 against 0.137;
      ``benchmarks/results/spot_generation_witness.json``), so the byte is the default;
    - ``4`` (a 4-bit fraction of the derived witness) for the built-in rtn-int8: 0.965 against 0.970 with the stored
      byte and 0.980 in fp16 (derived alone: 0.524);
    - the stored byte (:data:`~witcert.tier_a.witness_code.DEFAULT_WITNESS_BITS`) for every other codec: the rtn
      codecs' bounds are constant over channel groups and recomputed from the scales alone
      (``group_error_bound``), the others' (KIVI, fp8, a user's) elementwise from a decode at every read, which
      measured 12x the per-step read of the stored byte (rtn-int8's elementwise bound, 4096 tokens); and a user's
      declared bound may be loose. Deriving is then the user's choice (``witness_bits=0`` or ``4``).
    """
    if isinstance(codec, IntCodes) and not (spot and codec.bits <= 4):
        return 0 if codec.bits <= 4 else 4
    return DEFAULT_WITNESS_BITS


def _pack(codes: torch.Tensor, bits: int, block: int = builtin.GROUP) -> torch.Tensor:
    """Signed codes (..., d) in [-(2^(b-1) - 1), 2^(b-1) - 1] -> uint8 (..., d * b / 8) (int8 as is).

    Planar within each block of ``block`` channels (a channel group): code ``i`` of byte ``j`` of a block is its
    channel ``i * block / per_byte + j``, so a decode writes each block's channels as ``per_byte`` contiguous runs
    (:mod:`witcert.fastpath.packed_decode`: measured 2-2.5x faster than interleaved pairs). A row whose width is
    not a multiple of ``block`` is one block.
    """
    if bits == 8 or codes.shape[-1] % (8 // bits):
        return codes
    per_byte = 8 // bits
    block = _block(codes.shape[-1], block, per_byte)
    # offset codes lie in [0, 2^b - 1]: in int8 and as their own uint8 bits (a view, no pass); the fewest ops, as a
    # production store packs every decode step's token
    offset = (codes.to(torch.int8) + 2 ** (bits - 1)).view(torch.uint8).unflatten(-1, (-1, per_byte, block // per_byte))
    packed = offset[..., 0, :]
    for i in range(1, per_byte):
        packed = packed | (offset[..., i, :] << (bits * i))
    return packed.flatten(-2)


def _unpack(packed: torch.Tensor, bits: int, d: int, block: int = builtin.GROUP) -> torch.Tensor:
    """Inverse of :func:`_pack`: int8 codes (..., d)."""
    if packed.dtype == torch.int8:
        return packed
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    blocks = packed.unflatten(-1, (-1, _block(d, block, per_byte) // per_byte))
    parts = [((blocks >> (bits * i)) & mask) for i in range(per_byte)]
    return (torch.cat(parts, dim=-1).flatten(-2).to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)


def _block(d: int, block: int, per_byte: int) -> int:
    """The planar block of a row of ``d`` channels: ``block`` where it tiles the row in whole bytes, else the row."""
    return block if d % block == 0 and block % per_byte == 0 else d
