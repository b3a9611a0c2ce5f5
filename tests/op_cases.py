"""Op test cases shared by the reference-backend and kernel-backend test modules.

Each case builds fresh random inputs (never zeros), runs a fused op on a backend and
the naive unfused definition (:mod:`coda_jax.naive`, float32), and compares the forward
output and the gradients of ``sum(out * R)`` (``R`` a random cotangent) with
``jax.grad`` of the naive version, by relative error.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import coda_jax as cj
from coda_jax import naive
from coda_jax.epilogue import OutputKind

TOL = {  # dtype: (forward, gradient) relative-error bounds
    jnp.float32: (2e-5, 2e-4),
    jnp.bfloat16: (2e-2, 3e-2),
}


def abstract_loads(epi, m, n) -> dict:
    """``jax.ShapeDtypeStruct`` of each of ``epi``'s loads for an ``[m, n]`` output (to lower,
    not run): bf16 tiles, float32 vectors, blocks and the ``prev`` accumulator, int32 targets."""
    from coda_jax.epilogue import LoadKind

    out = {}
    for l in epi.loads:
        w = epi.width(n, l.half)
        shape = {LoadKind.ROW: (m,), LoadKind.COL: (w,), LoadKind.TILE: (m, w), LoadKind.SCALAR: (),
                 LoadKind.ROW_BLOCK: (m, epi.pair_block)}[l.kind]
        dt = (jnp.int32 if l.name == "target" else
              jnp.float32 if l.name == "prev" or l.kind is not LoadKind.TILE else jnp.bfloat16)
        out[l.name] = jax.ShapeDtypeStruct(shape, dt)
    if "z_scale_inv" in out:  # z saved in e4m3 (programs.SWIGLU_DGRAD_ZQ8)
        out["z"] = jax.ShapeDtypeStruct(out["z"].shape, jnp.float8_e4m3fn)
    return out


def kernel_probes():
    """Epilogues outside the op set that steer a kernel onto its less common paths:

    * ``odd_pair_rows``: pair block 12 (not a multiple of 8: the CuTeDSL pair exchange goes
      through SMEM) with a half-width output, a lo-only row sum and a (lo, hi) row sum;
    * ``wide_f32_outputs``: four float32 tile outputs, too many to stage in SMEM beside a
      3-stage ring (the CuTeDSL kernel stores them element by element).
    """
    from coda_jax import epilogue as E

    odd = E.Epilogue(
        name="odd_pair_rows", loads=(E.row("rstd"),),
        outputs=(E.tile_out("y", half=True), E.row_sum("s"), E.row_sum("t")),
        body=lambda acc, ctx, rstd: {"y": acc[0] * acc[1] * rstd, "s": acc[0] * acc[1],
                                     "t": (acc[0], 2.0 * acc[1])},
        pair_block=12)
    wide = E.Epilogue(
        name="wide_f32_outputs", loads=(E.col("gamma"),),
        outputs=tuple(E.tile_out(n, jnp.float32) for n in ("a", "b", "c", "d")),
        body=lambda acc, ctx, gamma: {"a": acc, "b": acc * gamma, "c": acc + 1.0, "d": -acc})
    return odd, wide


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "non-finite values in the output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def poison_allocator(shapes) -> None:
    """Fills the device allocator's free list with NaN buffers of the given shapes, so an
    output element a kernel fails to write keeps a NaN and fails :func:`rel_err`."""
    bufs = [jnp.full(s, jnp.nan, jnp.float32) for s in shapes]
    jax.block_until_ready(bufs)
    del bufs


@dataclasses.dataclass
class Inputs:
    key: jax.Array

    def normal(self, shape, dtype, scale=1.0, offset=0.0):
        self.key, k = jax.random.split(self.key)
        return (offset + scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    def ints(self, shape, hi):
        self.key, k = jax.random.split(self.key)
        return jax.random.randint(k, shape, 0, hi)


def check_fwd_grad(fused, reference, args, dtype, argnums):
    """Compares ``fused(*args)`` with ``reference(*args)`` and their gradients."""
    fwd_tol, grad_tol = TOL[dtype]
    out = jax.jit(fused)(*args)
    ref = reference(*[a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args])
    assert out.shape == ref.shape, (out.shape, ref.shape)
    e = rel_err(out, ref)
    assert e <= fwd_tol, f"forward rel err {e:.3g} > {fwd_tol}"
    r = jax.random.normal(jax.random.key(7), ref.shape, jnp.float32)

    def scalar(f, cast):
        def g(*a):
            if cast:
                a = [x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in a]
            return jnp.sum(f(*a).astype(jnp.float32) * r)
        return g

    got = jax.jit(jax.grad(scalar(fused, False), argnums))(*args)
    want = jax.grad(scalar(reference, True), argnums)(*args)
    for i, (a, b) in zip(argnums, zip(got, want)):
        assert a.dtype == args[i].dtype, f"grad of arg {i} has dtype {a.dtype}, want {args[i].dtype}"
        e = rel_err(a, b)
        assert e <= grad_tol, f"grad of arg {i}: rel err {e:.3g} > {grad_tol}"


def case_rms_norm_matmul(backend, m, d, n, dtype, seed=0):
    r = Inputs(jax.random.key(seed))
    x, g, w = r.normal((m, d), dtype), r.normal((d,), dtype, 0.1, 1.0), r.normal((d, n), dtype, d ** -0.5)
    check_fwd_grad(lambda x, g, w: cj.rms_norm_matmul(x, g, w, backend=backend), naive.rms_norm_matmul,
                   (x, g, w), dtype, (0, 1, 2))


def case_swiglu(backend, m, d, f, dtype, seed=0):
    r = Inputs(jax.random.key(seed))
    x, g, w = r.normal((m, d), dtype), r.normal((d,), dtype, 0.1, 1.0), r.normal((d, 2 * f), dtype, d ** -0.5)
    check_fwd_grad(lambda x, g, w: cj.rms_norm_matmul_swiglu(x, g, w, backend=backend),
                   naive.rms_norm_matmul_swiglu, (x, g, w), dtype, (0, 1, 2))


def case_swiglu_mlp(backend, m, d, f, dtype, next_norm=True, seed=0):
    """The whole MLP op (SwiGLU backward in the down projection's dgrad epilogue); with
    ``next_norm`` the output's carry feeds a following norm-GEMM, so the carry is checked."""
    r = Inputs(jax.random.key(seed))
    x, g, wgu = r.normal((m, d), dtype), r.normal((d,), dtype, 0.1, 1.0), r.normal((d, 2 * f), dtype, d ** -0.5)
    wd, g2, w2 = r.normal((f, d), dtype, f ** -0.5), r.normal((d,), dtype, 0.1, 1.0), r.normal((d, 64), dtype, d ** -0.5)
    if not next_norm:
        check_fwd_grad(lambda x, g, wgu, wd: cj.swiglu_mlp(x, g, wgu, wd, backend=backend)[0],
                       naive.swiglu_mlp, (x, g, wgu, wd), dtype, (0, 1, 2, 3))
        return

    def fused(x, g, wgu, wd, g2, w2):
        out, carry = cj.swiglu_mlp(x, g, wgu, wd, g2, backend=backend)
        z, out = cj.rms_norm_matmul(out, g2, w2, carry=carry, return_residual=True, backend=backend)
        return jnp.concatenate([z.astype(jnp.float32), out.astype(jnp.float32)], axis=1)

    def ref(x, g, wgu, wd, g2, w2):
        out = naive.swiglu_mlp(x, g, wgu, wd)
        return jnp.concatenate([naive.rms_norm_matmul(out, g2, w2), out], axis=1)

    check_fwd_grad(fused, ref, (x, g, wgu, wd, g2, w2), dtype, (0, 1, 2, 3, 4, 5))


def case_rope(backend, m, d, heads, kv_heads, head_dim, dtype, qk_norm=False, seed=0, split_qkv=False):
    """``split_qkv``: the op returns (q, k, v); compared side by side (and each part's own
    random cotangent reaches the backward) with the naive op's qkv."""
    r = Inputs(jax.random.key(seed))
    n = (heads + 2 * kv_heads) * head_dim
    x, g, w = r.normal((m, d), dtype), r.normal((d,), dtype, 0.1, 1.0), r.normal((d, n), dtype, d ** -0.5)
    pos = r.ints((m,), 4096)
    inv = jnp.asarray(cj.rope_inv_freq(head_dim, 500000.0, cj.Llama3RopeScaling()))
    kw = dict(num_heads=heads, num_kv_heads=kv_heads)
    if split_qkv:
        q_cols, kv_cols = heads * head_dim, kv_heads * head_dim

        def op(*args, **kw2):
            q, k, v = cj.rms_norm_matmul_rope(*args, split_qkv=True, **kw2)
            assert (q.shape, k.shape, v.shape) == ((m, q_cols), (m, kv_cols), (m, kv_cols)), (q.shape, k.shape)
            return jnp.concatenate([q, k, v], axis=1)
    else:
        op = cj.rms_norm_matmul_rope
    if qk_norm:
        qn, kn = r.normal((head_dim,), dtype, 0.1, 1.0), r.normal((head_dim,), dtype, 0.1, 1.0)
        check_fwd_grad(
            lambda x, g, w, qn, kn: op(x, g, w, pos, inv, q_norm=qn, k_norm=kn, backend=backend, **kw),
            lambda x, g, w, qn, kn: naive.rms_norm_matmul_rope(x, g, w, pos, inv, q_norm=qn, k_norm=kn, **kw),
            (x, g, w, qn, kn), dtype, (0, 1, 2, 3, 4))
    else:
        check_fwd_grad(lambda x, g, w: op(x, g, w, pos, inv, backend=backend, **kw),
                       lambda x, g, w: naive.rms_norm_matmul_rope(x, g, w, pos, inv, **kw), (x, g, w), dtype, (0, 1, 2))


def spy_unscaled_backward(monkeypatch) -> list:
    """Records each call of the ``[M, d]``-side norm backward
    (:func:`coda_jax.ops.normed_gemm.norm_gemm_backward_unscaled`) made while tracing."""
    from coda_jax.ops import normed_gemm

    calls, real = [], normed_gemm.norm_gemm_backward_unscaled

    def spy(*args, **kwargs):
        calls.append(args[1].shape)  # x [M, d]
        return real(*args, **kwargs)

    monkeypatch.setattr(normed_gemm, "norm_gemm_backward_unscaled", spy)
    return calls


def case_residual_chain(backend, m, k, d, n, dtype, seed=0):
    """GEMM + residual + partial RMS feeding the next norm-GEMM through the carry."""
    r = Inputs(jax.random.key(seed))
    y, w1, res = r.normal((m, k), dtype), r.normal((k, d), dtype, k ** -0.5), r.normal((m, d), dtype)
    g, w2 = r.normal((d,), dtype, 0.1, 1.0), r.normal((d, n), dtype, d ** -0.5)

    def fused(y, w1, res, g, w2):
        x, carry = cj.matmul_residual_rms(y, w1, res, g, backend=backend)
        z, x = cj.rms_norm_matmul(x, g, w2, carry=carry, return_residual=True, backend=backend)
        return jnp.concatenate([z.astype(jnp.float32), x.astype(jnp.float32)], axis=1)

    def ref(y, w1, res, g, w2):
        x = naive.matmul_residual(y, w1, res)
        return jnp.concatenate([naive.rms_norm_matmul(x, g, w2), x], axis=1)

    check_fwd_grad(fused, ref, (y, w1, res, g, w2), dtype, (0, 1, 2, 3, 4))


def case_cross_entropy(backend, m, d, v, dtype, reduction="mean", z_loss=0.0, seed=0, **op_kw):
    r = Inputs(jax.random.key(seed))
    x, g, w = r.normal((m, d), dtype), r.normal((d,), dtype, 0.1, 1.0), r.normal((v, d), dtype, d ** -0.5 * 2)
    t = r.ints((m,), v).at[1].set(-100)
    kw = dict(reduction=reduction, z_loss=z_loss)
    fused = lambda x, g, w: cj.linear_cross_entropy(x, g, w, t, backend=backend, **kw, **op_kw)
    ref = lambda x, g, w: naive.linear_cross_entropy(x, g, w, t, **kw)
    if reduction == "none":
        check_fwd_grad(fused, ref, (x, g, w), dtype, (0, 1, 2))
        return
    fwd_tol, grad_tol = TOL[dtype]
    f32 = lambda a: a.astype(jnp.float32)
    e = rel_err(jax.jit(fused)(x, g, w), ref(f32(x), f32(g), f32(w)))
    assert e <= fwd_tol, f"loss rel err {e:.3g}"
    got = jax.jit(jax.grad(fused, (0, 1, 2)))(x, g, w)
    want = jax.grad(lambda x, g, w: ref(f32(x), f32(g), f32(w)), (0, 1, 2))(x, g, w)
    for i, (a, b) in enumerate(zip(got, want)):
        e = rel_err(a, b)
        assert e <= grad_tol, f"grad of arg {i}: rel err {e:.3g} > {grad_tol}"


def reduced_output(kind, x):
    """An output as the op sees it: reduction partials combined over their first axis (sums,
    or the log-sum-exp of ``row_logsumexp`` partials); tiles unchanged."""
    if kind in (OutputKind.ROW_SUM, OutputKind.COL_SUM):
        return x.sum(0)
    if kind is OutputKind.ROW_LOGSUMEXP:
        return jax.nn.logsumexp(x, axis=0)
    return x


def pallas_kernel_eqn(fn, *args):
    """The one Pallas kernel call in ``fn``'s jaxpr (interpret mode: a ``pallas_call``, or
    ``mpmd_map`` in jax 0.11), found through the jit / custom_vmap calls that wrap it: its
    ``invars`` and ``outvars`` are the kernel's inputs and outputs."""
    import jax

    found, todo = [], [jax.make_jaxpr(fn)(*args).jaxpr]
    while todo:
        for e in todo.pop().eqns:
            if e.primitive.name in ("pallas_call", "mpmd_map"):
                found.append(e)
            for v in e.params.values():
                v = getattr(v, "jaxpr", v)
                if hasattr(v, "eqns"):
                    todo.append(v)
    assert len(found) == 1, [e.primitive.name for e in found]
    return found[0]


# The FP8 epilogue passes (K of 64, identity-free: each reads its tile loads), whose shipped
# tuned configurations their own checks in test_pallas_fp8.py and test_gpu_pallas_fp8.py run:
# the QKV gradient, the LM head's gradient, the standalone quantizing passes, the first
# block's norm input.
PASS_PROGRAMS = ("rope_grad_q8", "ce_grad_q8", "quantize_e4m3", "quantize_e5m2", "rms_input_q8")
