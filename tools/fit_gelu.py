#!/usr/bin/env python3
"""Coefficients of spark-tool's vectorised GELU (src/kernels/gelu.rs).

GELU(x) = x·Φ(x) = ½·x·erfc(−x/√2). For z ≥ 0 the kernel writes
    erfc(z) = t·exp(−z² + P(t)),   t = 1 / (1 + z/2),
with P a polynomial in s = (t − 4/7)·7/3, which spans [−1, 1] over the fitted interval (so that
float32 Horner steps do not cancel, as they do in powers of t): P = log(erfcx(z) / t), erfcx(z) = exp(z²)·erfc(z), is smooth on t ∈ (0, 1]
and tends to a constant as z → ∞. A relative error ε of erfc is an absolute error ε of P, so P is
fitted by least squares on Chebyshev nodes of t ∈ [1/7, 1] (z ≤ 12; erfc underflows float32 at
z ≈ 9.2) and its largest error there is printed. Run:

    python3 tools/fit_gelu.py          # prints the Rust constants and the fit's error

Needs numpy and scipy (tools/requirements.txt).
"""
import numpy as np
from scipy.special import erfcx

DEGREE = 10
T_MIN = 1.0 / 7.0
CENTRE = 4.0 / 7.0
HALF_WIDTH = 3.0 / 7.0


def main():
    nodes = 4000
    k = np.arange(nodes)
    # Chebyshev nodes of [T_MIN, 1]
    t = (T_MIN + 1) / 2 + (1 - T_MIN) / 2 * np.cos(np.pi * (k + 0.5) / nodes)
    z = 2.0 * (1.0 / t - 1.0)
    p = np.log(erfcx(z) / t)
    cheb = np.polynomial.chebyshev.Chebyshev.fit(t, p, DEGREE, domain=[T_MIN, 1.0])
    # power basis in s = (t - CENTRE) / HALF_WIDTH, which spans [-1, 1]
    power = cheb.convert(kind=np.polynomial.Polynomial, domain=[T_MIN, 1.0], window=[-1.0, 1.0])
    coef = power.coef
    dense_t = np.linspace(T_MIN, 1.0, 200001)
    dense_z = 2.0 * (1.0 / dense_t - 1.0)
    err = np.abs(power(dense_t) - np.log(erfcx(dense_z) / dense_t))
    print(f"// degree {DEGREE} on t in [{T_MIN:.6f}, 1]: max |P error| (relative error of erfc) {err.max():.3e}")
    print("const P: [f32; %d] = [" % (DEGREE + 1))
    for c in coef:
        print(f"    {c:.9e},")
    print("];")


if __name__ == "__main__":
    main()
