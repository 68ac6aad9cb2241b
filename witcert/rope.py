"""A real rotary position embedding (RoPE) in both pair conventions, for Lemma 1 tests.

``inv_freq_j = rope_theta^(-2j/d)``; position ``n`` rotates pair ``j`` by ``n inv_freq_j``.
``"rotate_half"`` follows HF Llama (``x cos + rotate_half(x) sin``, pair ``(j, j + d/2)``);
``"interleaved"`` follows GPT-J (pair ``(2j, 2j + 1)``). Lemma 1 (``L1``): every band norm of
a :class:`witcert.BandLayout` with the same convention is invariant under this map.
"""
import torch

from witcert.bands import ROPE_CONVENTIONS


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, rope: str = "rotate_half", rope_theta: float = 10000.0
) -> torch.Tensor:
    """Rotate ``x`` (..., T, d) at ``positions`` (T,) or (..., T) (Lemma 1, ``L1``).

    Computed in ``x``'s dtype (fp16/bf16 in fp32, then cast back). Returns the same shape.
    """
    if rope not in ROPE_CONVENTIONS:
        raise ValueError(f"rope must be one of {ROPE_CONVENTIONS}, got {rope!r}")
    if not torch.is_floating_point(x) or x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x must be a float tensor (..., T, d) with even d, got {tuple(x.shape)} {x.dtype}")
    if not (rope_theta > 0):
        raise ValueError(f"rope_theta must be > 0, got {rope_theta!r}")
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    angles = _angles(torch.as_tensor(positions, device=x.device), x.shape[-1], rope_theta, work)  # (..., T, d/2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    xw = x.to(work)
    if rope == "rotate_half":
        half = x.shape[-1] // 2
        a, b = xw[..., :half], xw[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = xw[..., 0::2], xw[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


def _angles(positions: torch.Tensor, head_dim: int, rope_theta: float, dtype: torch.dtype) -> torch.Tensor:
    """Rotation angle of every pair at every position: (..., T, d/2)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    inv_freq = (float(rope_theta) ** -exponents).to(dtype)  # (d/2,)
    return positions.to(dtype).unsqueeze(-1) * inv_freq
