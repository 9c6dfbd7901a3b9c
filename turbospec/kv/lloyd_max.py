"""Lloyd-Max scalar codebooks for the coordinates of a randomly rotated unit vector.

After a random rotation, each coordinate x of a unit vector in R^d follows the density

    f(x) = Gamma(d/2) / (sqrt(pi) * Gamma((d-1)/2)) * (1 - x^2)^((d-3)/2),   x in [-1, 1],

which tends to N(0, 1/d).  TurboQuant quantizes every coordinate with the same MSE-optimal
(Lloyd-Max) codebook for f.  The codebook is computed here numerically: the cumulative integrals
of f and x*f are tabulated once on a fine grid, and the Lloyd iteration (boundaries at midpoints,
centroids at conditional means) runs on interpolated values of those tables.

Everything here is float64 numpy and runs once per (bits, d) thanks to ``functools.lru_cache``
(about a tenth of a second for 4 bits).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

__all__ = [
    "GAUSSIAN_LLOYD_MAX",
    "beta_coordinate_pdf",
    "codebook_mse",
    "lloyd_max_codebook",
]

# Lloyd-Max levels for N(0, 1) (positive half), from the classic tables (Max 1960); used as a
# cross-check in the tests: for d = 128 the Beta law is close to N(0, 1/d).
GAUSSIAN_LLOYD_MAX: dict[int, tuple[float, ...]] = {
    1: (0.7979,),
    2: (0.4528, 1.5104),
    3: (0.2451, 0.7560, 1.3440, 2.1520),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
}

_GRID_POINTS = 400_001


def beta_coordinate_pdf(x: np.ndarray, d: int) -> np.ndarray:
    """Density of one coordinate of a uniformly random unit vector in R^d (zero outside [-1, 1])."""
    if d < 3:
        raise ValueError(f"d must be >= 3, got {d}")
    x = np.asarray(x, dtype=np.float64)
    log_c = math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)
    inside = np.abs(x) < 1.0
    one_minus = np.where(inside, 1.0 - x * x, 1.0)
    out = np.exp(log_c + 0.5 * (d - 3) * np.log(one_minus))
    return np.where(inside, out, 0.0)


@cache
def _tables(d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Grid x, cumulative integrals F(x) = int f, G(x) = int t f, H(x) = int t^2 f (trapezoid)."""
    # The density is negligible beyond |x| = 12 / sqrt(d) (e^-72); keep the grid where the mass is.
    lim = min(1.0, 12.0 / math.sqrt(d))
    x = np.linspace(-lim, lim, _GRID_POINTS)
    f = beta_coordinate_pdf(x, d)
    h = x[1] - x[0]

    def cum(y: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(0.5 * h * (y[1:] + y[:-1]))])

    F, G, H = cum(f), cum(x * f), cum(x * x * f)
    # Normalize away the (tiny) truncation and discretization error so that F(lim) == 1.
    total = F[-1]
    return x, F / total, G / total, H / total


def _cell_moments(bounds: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, F, G, H = _tables(d)
    b = np.clip(bounds, x[0], x[-1])
    Fi, Gi, Hi = np.interp(b, x, F), np.interp(b, x, G), np.interp(b, x, H)
    return np.diff(Fi), np.diff(Gi), np.diff(Hi)


@cache
def _lloyd_max(bits: int, d: int, tol: float, max_iter: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    n = 1 << bits
    sigma = 1.0 / math.sqrt(d)
    # Start from equal-probability cells of the Gaussian approximation (good and symmetric).
    x, F, _, _ = _tables(d)
    probs = (np.arange(n + 1) / n)[1:-1]
    inner = np.interp(probs, F, x)
    bounds = np.concatenate([[-1.0], inner, [1.0]])
    c = np.zeros(n)
    for _ in range(max_iter):
        mass, first, _ = _cell_moments(bounds, d)
        c_new = first / np.maximum(mass, 1e-300)
        bounds = np.concatenate([[-1.0], 0.5 * (c_new[1:] + c_new[:-1]), [1.0]])
        if np.max(np.abs(c_new - c)) < tol * sigma:
            c = c_new
            break
        c = c_new
    else:  # pragma: no cover - only if max_iter is far too small
        raise RuntimeError(f"Lloyd-Max did not converge (bits={bits}, d={d})")
    # Enforce exact symmetry (the iteration is symmetric up to rounding).
    c = 0.5 * (c - c[::-1])
    bounds = 0.5 * (c[1:] + c[:-1])
    return tuple(float(v) for v in c), tuple(float(v) for v in bounds)


def lloyd_max_codebook(bits: int, d: int = 128, *, tol: float = 1e-12, max_iter: int = 200_000
                       ) -> tuple[np.ndarray, np.ndarray]:
    """MSE-optimal codebook for one coordinate of a rotated unit vector in R^d.

    Returns ``(centroids, boundaries)``: ``2**bits`` ascending centroids and the ``2**bits - 1``
    decision boundaries (midpoints between neighbouring centroids), float64.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    c, b = _lloyd_max(int(bits), int(d), float(tol), int(max_iter))
    return np.array(c), np.array(b)


def codebook_mse(centroids: np.ndarray, d: int = 128) -> float:
    """Expected ||x - Q(x)||^2 for a rotated unit vector in R^d quantized coordinate-wise with
    the nearest-centroid rule on ``centroids`` (= d times the per-coordinate distortion)."""
    c = np.sort(np.asarray(centroids, dtype=np.float64))
    bounds = np.concatenate([[-1.0], 0.5 * (c[1:] + c[:-1]), [1.0]])
    mass, first, second = _cell_moments(bounds, d)
    per_coord = float(np.sum(second - 2 * c * first + c * c * mass))
    return d * per_coord
