"""Section 4 -- where the meter's looseness comes from (docs/design.md "How loose, and where").

For sampled real-model cells with their per-token bounds ``c``:

* shape looseness: ``meter / sup-box TV``, the sup-box TV being the adversary's (near-)sup of the
  true TV over every error with ``|eps_t| <= c_t`` (``witcert.verification.adversary.sup_box_tv``: local search at these
  ``S``, an achieved value, so the ratio is an upper estimate of the shape loss);
* per-token-bound looseness: ``sup-box TV / true TV`` (how far the actual errors are from the
  worst case the per-token bounds allow).

Saturated cells (meter = 1) are reported separately: there the shape ratio only says 1 / sup.
"""
import torch

from witcert.verification.adversary import sup_box_tv
from witcert.core import bounds


def _stats(x: torch.Tensor) -> dict:
    if x.numel() == 0:
        return dict(n=0, median=float("nan"), p90=float("nan"), p99=float("nan"), max=float("nan"))
    q = torch.quantile(x, torch.tensor([0.5, 0.9, 0.99], dtype=x.dtype))
    return dict(n=int(x.numel()), median=float(q[0]), p90=float(q[1]), p99=float(q[2]), max=float(x.max()))


def _tail_cause(scores: torch.Tensor, shape: torch.Tensor, threshold: float = 10.0) -> dict:
    """How concentrated attention is in the cells whose shape ratio exceeds ``threshold``.

    With ``p~`` nearly a point mass the sup-box TV is ~``2 p_max (1 - p_max) c`` while every bound
    in the meter is first order in ``c``: the ratio grows like ``1 / (1 - p_max)``.
    """
    p_max = torch.softmax(scores.double(), -1).amax(-1)
    tail = shape > threshold
    return dict(tail_cells=int(tail.sum()),
                tail_median_one_minus_pmax=float((1 - p_max[tail]).median()) if tail.any() else None,
                body_median_one_minus_pmax=float((1 - p_max[~tail]).median()) if (~tail).any() else None)


def split(sampled: dict) -> list[dict]:
    rows = []
    for config, t in sampled.items():
        sup = sup_box_tv(t["scores"], t["c"]).tv
        live = (t["meter"] < 1) & (sup > 0)
        shape = t["meter"][live] / sup[live]
        per_token = sup[live & (t["true_tv"] > 0)] / t["true_tv"][live & (t["true_tv"] > 0)]
        eform = bounds.eform_bound(t["scores"], t["c"])[live]
        maxnorm = bounds.maxnorm_bound(t["scores"], t["c"])[live]
        rows.append(dict(config=config, cells=int(t["meter"].numel()), saturated=int((t["meter"] >= 1).sum()),
                         sup_above_meter=int((sup > t["meter"] * (1 + 1e-9)).sum()),
                         shape_meter_over_sup=_stats(shape), per_token_sup_over_tv=_stats(per_token),
                         median_eform_over_sup=float((eform / sup[live]).median()) if live.any() else None,
                         median_maxnorm_over_sup=float((maxnorm / sup[live]).median()) if live.any() else None,
                         share_maxnorm_binding=float((maxnorm <= eform).double().mean()) if live.any() else None,
                         **_tail_cause(t["scores"][live], shape)))
    return rows
