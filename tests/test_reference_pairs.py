"""The reference lowering's pair mode against the pair layout written out by hand in NumPy.

The reference (``xla``) lowering runs pair-mode bodies in the joined ``[M, C, 2, b]`` space
(halves as selects of the pair view and its reverse, outputs joined by a select on the pair
index, row sums reduced over that space). This checks every load and output kind of pair
mode, with and without ``half_acc``, against a direct float64 evaluation on the split halves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import epilogue as E
from coda_jax.reference import REFERENCE

M, K, B, C = 24, 40, 8, 3  # rows, contraction, pair block, pairs: N = 2*C*B = 48


def _halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[..., 2*C*B] -> (lo, hi)`` each ``[..., C*B]`` in pair order."""
    y = x.reshape(x.shape[:-1] + (C, 2, B))
    return y[..., 0, :].reshape(x.shape[:-1] + (-1,)), y[..., 1, :].reshape(x.shape[:-1] + (-1,))


def _join(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    s = lo.shape[:-1]
    return np.stack([lo.reshape(s + (C, B)), hi.reshape(s + (C, B))], axis=-2).reshape(s + (-1,))


def _per_pair_block(v: np.ndarray) -> np.ndarray:
    """``[M, C*B]`` -> sum over each pair block's b columns, broadcast back (``ctx.row_sum``)."""
    s = v.reshape(v.shape[0], C, B).sum(-1, keepdims=True)
    return np.broadcast_to(s, (v.shape[0], C, B)).reshape(v.shape[0], -1)


def _body(acc, ctx, rstd, blk, rot, w, x, t):
    lo, hi = acc
    w_lo, w_hi = w
    x_lo, x_hi = x
    a = lo * rstd * w_lo + x_lo
    b = hi * blk - x_hi * rot
    g = jax.nn.sigmoid(a) * b + t
    norm = ctx.row_sum(a * a) + ctx.row_sum(b * b)
    return {"out": (a * g, b - g / (1.0 + norm)), "y": g, "rs_pair": (a, 2.0 * b), "rs_one": a * b,
            "cs_pair": (g, w_hi * b), "cs_one": g * rot}


PAIRED = E.Epilogue(
    name="pair_probe",
    loads=(E.row("rstd"), E.row_block("blk"), E.col("rot", half=True), E.col("w"), E.tile("x"),
           E.tile("t", half=True)),
    outputs=(E.tile_out("out", jnp.float32), E.tile_out("y", jnp.float32, half=True), E.row_sum("rs_pair"),
             E.row_sum("rs_one"), E.col_sum("cs_pair"), E.col_sum("cs_one")),
    body=_body,
    pair_block=B,
)


def _expected_paired(acc, rstd, blk, rot, w, x, t):
    lo, hi = _halves(acc)
    w_lo, w_hi = _halves(w)
    x_lo, x_hi = _halves(x)
    blk_w = np.tile(blk, (1, C))  # [M, b] -> the same rotation block for every pair
    a = lo * rstd[:, None] * w_lo + x_lo
    b = hi * blk_w - x_hi * rot
    g = 1.0 / (1.0 + np.exp(-a)) * b + t
    norm = _per_pair_block(a * a) + _per_pair_block(b * b)
    return {"out": _join(a * g, b - g / (1.0 + norm)), "y": g,
            "rs_pair": (a + 2.0 * b).sum(1), "rs_one": (a * b).sum(1),
            "cs_pair": _join(g, w_hi * b).sum(0), "cs_one": (g * rot).sum(0)}


def _half_acc_body(acc, ctx, z, s):
    gate, up = z
    d_gate, d_up = acc * up * jax.nn.sigmoid(gate), acc * gate + s
    return {"dz": (d_gate, d_up), "zdz": gate * d_gate + up * d_up, "h": acc * s}


HALF_ACC = E.Epilogue(
    name="half_acc_probe",
    loads=(E.tile("z"), E.col("s", half=True)),
    outputs=(E.tile_out("dz", jnp.float32), E.row_sum("zdz"), E.tile_out("h", jnp.float32, half=True)),
    body=_half_acc_body,
    pair_block=B,
    half_acc=True,
)


def _rand(key, i, shape):
    return jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_pair_mode_matches_the_split_halves(seed):
    key = jax.random.PRNGKey(seed)
    n, f = 2 * C * B, C * B
    a, wmat = _rand(key, 0, (M, K)), _rand(key, 1, (K, n))
    loads = {"rstd": jnp.abs(_rand(key, 2, (M,))) + 0.5, "blk": _rand(key, 3, (M, B)),
             "rot": (jax.random.uniform(jax.random.fold_in(key, 4), (f,)) > 0.5).astype(jnp.float32),
             "w": _rand(key, 5, (n,)), "x": _rand(key, 6, (M, n)), "t": _rand(key, 7, (M, f))}
    got = REFERENCE.gemm(PAIRED, a, wmat, loads)
    acc = np.asarray(a, np.float64) @ np.asarray(wmat, np.float64)
    want = _expected_paired(acc, *(np.asarray(loads[k], np.float64) for k in ("rstd", "blk", "rot", "w", "x", "t")))
    for name, ref in want.items():
        out = np.asarray(got[name], np.float64).reshape(ref.shape)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert err < 1e-5, (name, err)


@pytest.mark.parametrize("seed", [0, 1])
def test_half_acc_pair_mode_matches_the_split_halves(seed):
    key = jax.random.PRNGKey(seed)
    n, f = 2 * C * B, C * B
    a, wmat = _rand(key, 0, (M, K)), _rand(key, 1, (K, f))  # the accumulator has one column per pair
    loads = {"z": _rand(key, 2, (M, n)), "s": _rand(key, 3, (f,))}
    got = REFERENCE.gemm(HALF_ACC, a, wmat, loads)
    acc = np.asarray(a, np.float64) @ np.asarray(wmat, np.float64)
    gate, up = _halves(np.asarray(loads["z"], np.float64))
    s = np.asarray(loads["s"], np.float64)
    d_gate, d_up = acc * up / (1.0 + np.exp(-gate)), acc * gate + s
    want = {"dz": _join(d_gate, d_up), "zdz": (gate * d_gate + up * d_up).sum(1), "h": acc * s}
    for name, ref in want.items():
        out = np.asarray(got[name], np.float64).reshape(ref.shape)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert err < 1e-5, (name, err)
