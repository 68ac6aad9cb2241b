"""Argument checks shared by the kernels' public functions (bad input -> ``ValueError``)."""
import torch


def require(condition: bool, name: str, problem: str) -> None:
    """Raise ``ValueError`` naming the argument ``name`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(f"{name} {problem}")


def require_tensor(name, x, *, dtypes=None, dim=None, last_dim=None, shape=None, device=None):
    """Check that ``x`` is a tensor of the given dtype(s), rank, last dim, shape and device."""
    require(isinstance(x, torch.Tensor), name, f"must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        require(x.dtype in dtypes, name, f"must have dtype in ({names}), got {x.dtype}")
    if dim is not None:
        require(x.dim() == dim, name, f"must have {dim} dims, got shape {tuple(x.shape)}")
    if last_dim is not None:
        require(x.dim() >= 1 and x.shape[-1] == last_dim, name,
                f"must have last dim {last_dim}, got shape {tuple(x.shape)}")
    if shape is not None:
        require(tuple(x.shape) == tuple(shape), name,
                f"must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if device is not None:
        require(x.device == device, name, f"must be on {device}, got {x.device}")


def require_finite(name: str, x: torch.Tensor) -> None:
    """Reject NaN and Inf (a bound fed NaN would silently vanish)."""
    if torch.is_floating_point(x):
        require(bool(torch.isfinite(x).all()), name, "must be finite (found NaN or Inf)")


def require_nonnegative(name: str, x: torch.Tensor) -> None:
    """Reject negative entries (norms, scales, witnesses)."""
    require(bool((x >= 0).all()), name, "must be non-negative")
