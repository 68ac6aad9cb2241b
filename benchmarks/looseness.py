"""Section 4 -- where the meter's looseness comes from (DESIGN.md §2 "How loose, and where").

For sampled real-model cells with their per-token bounds ``c``:

* shape looseness: ``meter / sup-box TV``, the sup-box TV being the adversary's (near-)sup of the
  true TV over every error with ``|eps_t| <= c_t`` (``witcert.sup_box_tv``: local search at these
  ``S``, an achieved value, so the ratio is an upper estimate of the shape loss);
* per-token-bound looseness: ``sup-box TV / true TV`` (how far the actual errors are from the
  worst case the per-token bounds allow).

Saturated cells (meter = 1) are reported separately: there the shape ratio only says 1 / sup.
"""
import torch

import witcert


def _stats(x: torch.Tensor) -> dict:
    if x.numel() == 0:
        return dict(n=0, median=float("nan"), p90=float("nan"), p99=float("nan"), max=float("nan"))
    q = torch.quantile(x, torch.tensor([0.5, 0.9, 0.99], dtype=x.dtype))
    return dict(n=int(x.numel()), median=float(q[0]), p90=float(q[1]), p99=float(q[2]), max=float(x.max()))


def split(sampled: dict) -> list[dict]:
    rows = []
    for config, t in sampled.items():
        sup = witcert.sup_box_tv(t["scores"], t["c"]).tv
        live = (t["meter"] < 1) & (sup > 0)
        shape = t["meter"][live] / sup[live]
        per_token = sup[live & (t["true_tv"] > 0)] / t["true_tv"][live & (t["true_tv"] > 0)]
        rows.append(dict(config=config, cells=int(t["meter"].numel()), saturated=int((t["meter"] >= 1).sum()),
                         sup_above_meter=int((sup > t["meter"] * (1 + 1e-9)).sum()),
                         shape_meter_over_sup=_stats(shape), per_token_sup_over_tv=_stats(per_token)))
    return rows
