"""Input checks shared by every public bound: clear errors that name the argument."""
import torch

from witcert.core.rounding import round_up_to


def as_float_tensor(name: str, x, *, token_axis: bool = True) -> torch.Tensor:
    """``x`` as a floating tensor; fp16/bf16 are widened exactly to fp32 (the meter never computes in them).

    A Python number or (nested) list becomes fp64, which holds it exactly (the default fp32 would
    round it, possibly below a bound it was meant to be). ``token_axis``: reject a 0-dim value.
    """
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be a floating tensor or numbers, got {type(x).__name__}")
    if not torch.is_floating_point(x):
        raise ValueError(f"{name} must be a floating tensor (fp16, bf16, fp32 or fp64), got dtype {x.dtype}")
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    if token_axis and x.dim() == 0:
        raise ValueError(f"{name} must have a token axis (last dim), got a scalar")
    return x


def check_scores_and_bounds(scores, c, c_name: str = "c") -> tuple[torch.Tensor, torch.Tensor]:
    """Validate compressed logits and per-token bounds; return them with a common shape and dtype.

    ``scores`` (..., S): finite, or ``-inf`` for masked tokens; NaN and ``+inf`` are errors, and
    so is a row with every token masked. ``c`` broadcastable to ``scores`` (a scalar or 0-dim
    tensor too): no NaN, no negative value; ``+inf`` is allowed (it yields the trivial bound).
    The common dtype is the promotion of both; a Python number ``c`` (held exactly in fp64)
    is rounded *up* to the scores' dtype instead, so the working dtype stays the scores'.
    ``c_name`` names the bound in error messages (``rho``, ``v_norms`` for the value side).
    """
    python_c = not isinstance(c, torch.Tensor)
    scores = as_float_tensor("scores", scores)
    c = as_float_tensor(c_name, c, token_axis=False)
    if python_c and c.dtype != scores.dtype:
        c = round_up_to(c, scores.dtype)
    if scores.shape[-1] == 0:
        raise ValueError("scores has no tokens (last dim is 0)")
    # one reduction per tensor: max/min propagate NaN, so a single pass finds every bad value
    row_max = scores.amax(dim=-1)  # (...,): NaN if any NaN, +inf if any +inf, -inf if fully masked
    top = row_max.max() if row_max.numel() else torch.zeros(())
    if torch.isnan(top):
        raise ValueError("scores contains NaN")
    if top == float("inf"):
        raise ValueError("scores contains +inf (use -inf to mask a token; finite values otherwise)")
    if (row_max == float("-inf")).any():
        raise ValueError("scores has a row with every token masked (-inf): attention is undefined there")
    low = c.min() if c.numel() else torch.zeros(())
    if torch.isnan(low):
        raise ValueError(f"{c_name} contains NaN")
    if low < 0:
        raise ValueError(f"{c_name} must be >= 0 (a per-token bound), found minimum {low.item()!r}")
    if c.dim() > scores.dim():
        raise ValueError(f"{c_name} of shape {tuple(c.shape)} would enlarge scores of shape {tuple(scores.shape)}")
    try:
        c = c.expand(scores.shape)
    except RuntimeError:
        raise ValueError(f"{c_name} of shape {tuple(c.shape)} does not broadcast to scores of shape {tuple(scores.shape)}")
    dtype = torch.promote_types(scores.dtype, c.dtype)
    return scores.to(dtype), c.to(dtype)
