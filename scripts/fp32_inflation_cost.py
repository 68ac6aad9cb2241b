"""What the fp32 meter's a-priori rounding inflation (registry key FP) costs: the relative excess
of the fp32 meter over the fp64 one (itself within ~1e-13 of exact) on realistic rows.

Usage: python scripts/fp32_inflation_cost.py
"""
import torch

import witcert


def relative_cost(s: int, c_scale: float, rows: int = 2000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(rows, s, generator=g) * 3).float()
    c = (torch.rand(rows, s, generator=g) * c_scale).float()
    m32 = witcert.meter(scores, c).double()
    m64 = witcert.meter(scores.double(), c.double())
    keep = (m64 > 0) & (m64 < 1)
    return (m32[keep] - m64[keep]) / m64[keep]


def main() -> None:
    print(f"{'S':>6} {'c scale':>8} {'median rel. cost':>17} {'max':>10}")
    everything = []
    for s in (64, 512, 4096):
        for c_scale in (1e-4, 1e-2, 0.3):
            cost = relative_cost(s, c_scale, rows=2000 if s < 4096 else 300)
            everything.append(cost)
            print(f"{s:>6} {c_scale:>8g} {cost.median().item():>17.3e} {cost.max().item():>10.3e}")
    print(f"overall median relative cost: {torch.cat(everything).median().item():.3e}")


if __name__ == "__main__":
    main()
