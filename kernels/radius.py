"""Per-token radii inside the decode kernel: fp64, one term after the other (T2, TB, L4).

Two requirements shape how the kernel forms a token's logit-error bound ``c_t``:

* **Whole fp32 range of the query.** The kernel reads queries as fp16/bf16/fp32. In fp64 the
  square of any fp32 value is exact (24 significant bits squared fit in 53) and lies far from
  fp64's under- and overflow (``2^-298 <= q^2 <= 2^256``), as does every product of such a
  value with an fp16/bf16/fp32 witness or an fp16 scale. So the radius is computed in fp64
  with no scaling, and its relative rounding error is a count of roundings for every query
  from the smallest fp32 subnormal to the largest finite fp32 (an fp32 ``q * q`` underflows
  below ``|q| ~ 1e-19`` and overflows above ``1e19``).
* **A fixed number per token, whatever the tiling** (Lemma 4 ``L4``: the split-KV merge takes
  ``D = max_t c_t`` and the moments of each token's own radius). A ``tl.dot`` may sum in an
  order that depends on the token's column in its tile (BLAS blocking under the interpreter,
  MMA layouts on a GPU), so a token could get a different ``c_t`` for a different
  ``num_splits`` or ``block_n``. Here every per-token sum runs over bands (or scale groups) in
  index order with elementwise fp64 operations, and the per-query factors are read with an
  exact gather: ``c_t`` depends on the query and the token's own data only.

The fp64 value is then rounded up to fp32 by :func:`radius_to_fp32`: multiplied by
``1 + RADIUS_UP`` (which covers any fp64 arithmetic error below ``2^-23`` relative, see
``KernelRounding.kappa_c`` / ``kappa_b`` in ``kernels/certificate.py``) and cast, with the
fp32 normal floor ``2^-126`` for values the cast would push into fp32 subnormals (which a GPU
may flush to zero).
"""
import triton
import triton.language as tl

RADIUS_UP = tl.constexpr(2.0**-21)  # the fp32 round-up margin of a radius (kernels/certificate.py)
FP32_TINY = tl.constexpr(2.0**-126)  # smallest normal fp32


@triton.jit
def column(x, j):
    """``x[:, j]`` of a 2-D tensor, exactly (a gather: no arithmetic on the values)."""
    index = tl.full([x.shape[0], 1], j, tl.int32)
    return tl.reshape(tl.gather(x, index, axis=1), [x.shape[0]])


@triton.jit
def radius_to_fp32(x64):
    """fp32 value ``>= x64 / (1 - 2^-23)`` for ``x64 >= 0`` (``0`` stays ``0``, ``inf`` stays ``inf``).

    ``x64 (1 + 2^-21)`` rounds once in fp64 and once to fp32 (``2^-24`` each way for normal
    results); below the fp32 normal range the floor ``2^-126`` exceeds ``x64`` already.
    """
    up = (x64 * (1.0 + RADIUS_UP)).to(tl.float32)
    return tl.where(x64 > 0, tl.maximum(up, FP32_TINY), 0.0)


@triton.jit
def query_band_norms(q_rows, band_ptr, mask_h, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
                     BANDS: tl.constexpr, BAND_WIDTH: tl.constexpr):
    """fp64 ``||q_b||`` for every head row and band (T2): (BLOCK_H, BLOCK_B).

    ``band_ptr`` holds ``BandLayout.index`` (B, 2P): the coordinates of each band, so the
    kernel uses the model's RoPE pair convention exactly as the torch reference does. Squares
    are exact in fp64; the ``2P``-term sum and the sqrt round: ``(2P + 1) 2^-53`` relative.
    Computed once per program from the query alone, so every split sees the same norms.
    """
    offs_b = tl.arange(0, BLOCK_B)
    offs_w = tl.arange(0, BLOCK_W)
    mask_bw = (offs_b[:, None] < BANDS) & (offs_w[None, :] < BAND_WIDTH)
    coords = tl.load(band_ptr + offs_b[:, None] * BAND_WIDTH + offs_w[None, :], mask=mask_bw, other=0)
    q_band = tl.load(q_rows[:, None, None] + coords[None, :, :],
                     mask=mask_h[:, None, None] & mask_bw[None, :, :], other=0.0).to(tl.float64)
    return tl.sqrt(tl.sum(q_band * q_band, axis=2))  # (BLOCK_H, BLOCK_B), sqrt.rn.f64


@triton.jit
def witness_radius(w_rows, mask_n, q_norms, BANDS: tl.constexpr):
    """Tier A ``sum_b ||q_b|| w_{t,b}`` (BLOCK_H, BLOCK_N) in fp64, bands in index order (T2).

    ``w_rows`` (BLOCK_N,) points at each token's witness row. A zero band norm against an
    infinite witness band contributes 0 (that band's logit error is 0), as in
    ``witcert.logit_bound``; a positive norm against ``inf`` gives ``inf``, never NaN.
    Rounding: ``B`` products and ``B - 1`` additions on top of the norms' error.
    """
    c = tl.zeros([q_norms.shape[0], w_rows.shape[0]], tl.float64)
    for b in range(BANDS):
        w_b = tl.load(w_rows + b, mask=mask_n, other=0.0).to(tl.float64)
        norm_b = column(q_norms, b)
        unbounded = (norm_b > 0)[:, None] & (w_b == float("inf"))[None, :]
        term = norm_b[:, None] * tl.where(w_b == float("inf"), 0.0, w_b)[None, :]  # no 0 * inf
        c += tl.where(unbounded, float("inf"), term)
    return c
