#!/usr/bin/env python3
"""Independent float64 GPTQ reference (numpy), written from docs/GPTQ_FORMAT.md §11–§13 and the grid of §2.

Deliberately different from the Rust solver where the math allows: float64
throughout, U from Cholesky → inverse → upper Cholesky (not the index-reversal
trick), and the textbook column loop that updates every remaining column after
each step (no lazy 128-column blocks). Group scales are taken from the current
(error-updated) weights when a group's first column is reached. With `act=True` the columns are
visited in descending diag(H) (ties by index) with static groups: groups stay the consecutive runs of
G original columns, a group's scale is chosen when the first of its members is visited, and the codes
are returned in the original column order.

    python3 tools/gptq_ref.py make tests/golden/gptq_case.safetensors
    python3 tools/gptq_ref.py check tests/golden/gptq_case.safetensors

`make` draws the case (W and the Hessian H = 2XᵀX/T of correlated inputs) and stores W and H with
the codes and scales solved from them. `check` never recomputes H: XᵀX is a BLAS product whose last
bits differ between numpy/OpenBLAS builds and CPUs. It re-solves from the *stored* W and H and
requires the same codes and scales, which are discrete outcomes of float64 arithmetic; to show that
this comparison does not hinge on LAPACK's last bits, it also re-solves from H perturbed by a
relative 1e-10 (about a million times float64 rounding; measured: codes first move at 1e-6)
and requires the very same codes and scales again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import st_numpy  # noqa: E402

N, K, T, G, DAMP = 48, 256, 1024, 64, 0.01
S_MIN, S_MAX = 2.0 ** -14, 65280.0


def stored_scale(s: float) -> float:
    """Clamp the magnitude to fp16's normal range, then round to bf16 (nearest even); the sign is kept."""
    s32 = np.array([min(max(abs(s), S_MIN), S_MAX)], dtype=np.float32)
    bits = st_numpy.to_bf16_bits(s32).astype(np.uint32) << 16
    return float(np.copysign(bits.view(np.float32)[0], s))


def codes_for(w: np.ndarray, s: float) -> np.ndarray:
    return np.clip(np.rint(w / s) + 8, 0, 15)


def werr(w, imp, s) -> float:
    return float(np.sum(imp * (w - s * (codes_for(w, s) - 8)) ** 2))


def search(w: np.ndarray, imp: np.ndarray, amax: float, sign: float) -> tuple[float, float]:
    """Every candidate sign·amax/c and its least-squares refit (when the refit keeps the sign);
    the least (error, scale) of those and of the base sign·amax/7.5."""
    base = stored_scale(sign * amax / 7.5)
    best_e, best_s = werr(w, imp, base), base
    for i in range(41):
        s = sign * amax / (6.5 + 2.0 * i / 40)
        cands = [stored_scale(s)]
        L = codes_for(w, cands[0]) - 8
        num, den = float(np.sum(imp * w * L)), float(np.sum(imp * L * L))
        if den > 0 and num * sign > 0:
            cands.append(stored_scale(num / den))
        for c in cands:
            e = werr(w, imp, c)
            if e < best_e or (e == best_e and c < best_s):
                best_e, best_s = e, c
    return best_e, best_s


def group_scale(w: np.ndarray, imp: np.ndarray, search_rule: str) -> float:
    """`search_rule`: "max" (amax/7.5), "search" (positive scales) or "signed" (the positive and the
    negative search, the lower error winning, ties to the positive)."""
    amax = float(np.max(np.abs(w)))
    if amax == 0.0:
        return stored_scale(2.0 / 15.0)
    if search_rule == "max":
        return stored_scale(amax / 7.5)
    pos = search(w, imp, amax, 1.0)
    if search_rule == "search":
        return pos[1]
    neg = search(w, imp, amax, -1.0)
    return neg[1] if neg[0] < pos[0] else pos[1]


def gptq(W: np.ndarray, H: np.ndarray, search: str, act: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """W [N, K], H [K, K] → codes [K, N] (uint8), scales [K/G, N]."""
    W = W.astype(np.float64).copy()
    H = H.copy()
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = np.argsort(-np.diag(H), kind="stable") if act else np.arange(K)
    W, H = W[:, perm], H[np.ix_(perm, perm)]
    H[np.diag_indices(K)] += DAMP * np.mean(np.diag(H))
    Hinv = np.linalg.inv(np.linalg.cholesky(H))
    Hinv = Hinv.T @ Hinv  # (H + λI)^-1
    U = np.linalg.cholesky(Hinv).T  # upper, Hinv = UᵀU
    imp = 1.0 / np.diag(U) ** 2
    codes = np.zeros((K, N), dtype=np.uint8)
    scales = np.zeros((K // G, N))
    group = perm // G  # group of each visited position
    scaled = np.zeros(K // G, dtype=bool)
    for i in range(K):
        g = group[i]
        if not scaled[g]:
            members = np.flatnonzero(group == g)  # positions, ascending; all still ahead
            for n in range(N):
                scales[g, n] = group_scale(W[n, members], imp[members], search)
            scaled[g] = True
        s = scales[g]
        q = codes_for(W[:, i], s)
        codes[perm[i]] = q
        err = (W[:, i] - s * (q - 8)) / U[i, i]
        W[:, i + 1:] -= np.outer(err, U[i, i + 1:])
    return codes, scales


def make_case(seed: int = 11):
    rng = np.random.default_rng(seed)
    W = (rng.standard_t(4, size=(N, K)) * 0.05).astype(np.float32)
    base = rng.standard_normal((T, 8))
    X = base @ rng.standard_normal((8, K)) + 0.3 * rng.standard_normal((T, K))
    X[:, 7] = 0.0  # one dead input
    H = 2.0 * X.T @ X / T
    return W, H


PERTURB = 1e-10


def solve_all(W: np.ndarray, H: np.ndarray) -> dict[str, tuple[str, np.ndarray]]:
    out = {}
    for name, search, act in (("plain", "max", False), ("search", "search", False),
                              ("act.plain", "max", True), ("act.search", "search", True),
                              ("signed", "signed", False), ("act.signed", "signed", True)):
        c, s = gptq(W, H, search, act)
        out[f"{name}.codes"] = ("U8", c)
        out[f"{name}.scales"] = ("F32", s.astype(np.float32))
    return out


def differences(old: dict, new: dict) -> list[str]:
    bad = []
    for k, (_, v) in new.items():
        if k not in old:
            bad.append(f"{k}: missing")
            continue
        o = np.asarray(old[k])
        v = v.astype(o.dtype)
        if o.shape != v.shape:
            bad.append(f"{k}: shape {list(o.shape)} vs {list(v.shape)}")
        elif not np.array_equal(o, v):
            bad.append(f"{k}: {int(np.sum(o != v))} of {o.size} differ")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["make", "check"])
    ap.add_argument("path", type=Path)
    a = ap.parse_args()
    if a.cmd == "make":
        W, H = make_case()
        out = {"w": ("F32", W), "h": ("F64", H), **solve_all(W, H)}
        st_numpy.write_file(a.path, out, {"generator": "tools/gptq_ref.py", "group_size": G, "damp": DAMP})
        print(f"wrote {a.path}")
        return
    old = st_numpy.read_file(a.path)
    for k in ("w", "h"):
        if k not in old:
            sys.exit(f"{a.path}: no tensor `{k}` (regenerate with `gptq_ref.py make`)")
    W, H = np.asarray(old["w"], dtype=np.float32), np.asarray(old["h"], dtype=np.float64)
    if W.shape != (N, K) or H.shape != (K, K):
        sys.exit(f"{a.path}: w {list(W.shape)} / h {list(H.shape)}, expected [{N}, {K}] / [{K}, {K}]")
    bad = differences(old, solve_all(W, H))
    if bad:
        sys.exit(f"{a.path} is stale (regenerate with `gptq_ref.py make`): {bad}")
    rng = np.random.default_rng(0)
    noise = 1.0 + PERTURB * rng.uniform(-1.0, 1.0, size=H.shape)
    Hp = H * np.sqrt(noise * noise.T)  # symmetric, relative error <= PERTURB
    bad = differences(old, solve_all(W, Hp))
    if bad:
        sys.exit(f"{a.path}: codes change when H moves by a relative {PERTURB:g}, so this case is too close "
                 f"to a rounding tie to compare exactly across LAPACK builds; draw another case: {bad}")
    print(f"{a.path}: committed GPTQ case matches the reference (and is stable under a {PERTURB:g} relative change of H)")


if __name__ == "__main__":
    main()
