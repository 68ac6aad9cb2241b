"""TurboQuant's Lloyd-Max centroids for a rotated unit vector's coordinates, computed as vLLM computes them.

vLLM at 06d0369d75e060e83dffac3e0190ceff8fc37e12,
``vllm/model_executor/layers/quantization/turboquant/centroids.py`` (``solve_lloyd_max``): after a rotation each
coordinate of a unit vector in ``d`` dimensions is close to ``N(0, 1/d)``; the ``2^bits`` centroids solve the
Lloyd-Max conditions for that density by fixed-point iteration with a 200-point trapezoid rule. The same Python
float operations in the same order give the same fp64 centroids, rounded to fp32 as vLLM stores them.
"""
import functools
import math

import torch


def _gaussian_pdf(x: float, sigma2: float) -> float:
    return (1.0 / math.sqrt(2 * math.pi * sigma2)) * math.exp(-x * x / (2 * sigma2))


def _trapz(f, a: float, b: float, n: int = 200) -> float:
    h = (b - a) / n
    result = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        result += f(a + i * h)
    return result * h


@functools.lru_cache(maxsize=32)
def centroids(d: int, bits: int, max_iter: int = 200, tol: float = 1e-10) -> tuple[float, ...]:
    """The ``2^bits`` sorted centroids for ``N(0, 1/d)``, each rounded to fp32 (vLLM's ``get_centroids``)."""
    n_levels = 2**bits
    sigma2 = 1.0 / d
    sigma = math.sqrt(sigma2)

    def pdf(x):
        return _gaussian_pdf(x, sigma2)

    lo, hi = -3.5 * sigma, 3.5 * sigma
    points = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(max_iter):
        boundaries = [(points[i] + points[i + 1]) / 2.0 for i in range(n_levels - 1)]
        edges = [lo * 3] + boundaries + [hi * 3]
        new = []
        for i in range(n_levels):
            a, b = edges[i], edges[i + 1]
            num = _trapz(lambda x: x * pdf(x), a, b)
            den = _trapz(pdf, a, b)
            new.append(num / den if den > 1e-15 else points[i])
        if max(abs(new[i] - points[i]) for i in range(n_levels)) < tol:
            break
        points = new
    return tuple(torch.tensor(points, dtype=torch.float32).tolist())


def midpoints(d: int, bits: int) -> torch.Tensor:
    """fp32 decision boundaries ``(c_i + c_{i+1}) / 2`` of the sorted fp32 centroids (vLLM's ``_tq_midpoints``)."""
    c = torch.tensor(centroids(d, bits), dtype=torch.float32).sort().values
    return (c[:-1] + c[1:]) / 2
