"""Multi-device checks, run by ``tests/test_partitioning.py`` in a subprocess with 8 CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/multi_device_cases.py CASE

A kernel backend's GEMM is opaque to the SPMD partitioner. On the CPU the Pallas kernels run
in the GPU interpreter, which is ordinary HLO (the partitioner would split it anyway) and
whose shared state is not safe with 8 devices executing at once, so these checks stand in a
**test kernel backend**: the reference epilogue math inside ``jax.pure_callback`` (opaque to
the partitioner, like a custom call), registered as ``"pallas"`` so that the ops, the
layers and :class:`coda_jax.partitioning.PartitionedLowering` run exactly as on the GPU.
Each case prints ``OK <case>`` or raises.
"""

from __future__ import annotations

import math
import os
import re
import sys

import numpy as np

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    raise SystemExit("run with XLA_FLAGS=--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import coda_jax as cj  # noqa: E402
from coda_jax import backend as B  # noqa: E402
from coda_jax import partitioning, programs  # noqa: E402
from coda_jax.reference import REFERENCE  # noqa: E402
from coda_jax.options import DEFAULTS  # noqa: E402
from suite_options import SUITE_ROUTING, apply_suite_options  # noqa: E402  (tests/suite_options.py)

# The suite's routing options (tests/suite_options.py), and the xla backend's exact float32
# accumulators: these cases compare a sharded step with one device's, and bf16-rounded GEMM
# outputs would add reduction-order noise to that comparison.
apply_suite_options()
cj.set_options(xla=cj.XlaOptions(accumulate="float32"))


class OpaqueKernel:
    """The reference lowering's results behind a host callback: an opaque call. Plain GEMMs
    (the identity epilogue) go to XLA's dot, as the kernel backends route them.

    The result is computed by XLA ops and handed through a ``pure_callback`` that takes it
    and every operand of the GEMM and returns it unchanged: the partitioner must place
    ``a``, ``b`` and the loads as for a kernel call and cannot see through it. (Computing the
    result inside the callback dispatched JAX work from the 8 devices' callback threads and
    deadlocked: a bfloat16 tensor-parallel step, ``case_mesh_fuzz`` seed 13.)"""

    name = "pallas"
    plain_gemm = None

    def gemm(self, epilogue, a, b, loads, *, transpose_a=False, transpose_b=False, out_dtypes=None, out_splits=None,
             promote_k=0):
        kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, out_dtypes=out_dtypes, out_splits=out_splits,
                  promote_k=promote_k)
        out = REFERENCE.gemm(epilogue, a, b, loads, **kw)
        if epilogue is programs.IDENTITY:
            return out
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out)
        return jax.pure_callback(lambda a, b, l, o: o, shapes, a, b, loads, out, vmap_method="sequential")


def install_opaque_kernel() -> None:
    B._ensure_registered("xla")
    B._lowerings["pallas"] = lambda: OpaqueKernel()
    B._ops["pallas"] = set(B._ops["xla"])
    B.backend_unavailable_reason = lambda name: None


def allow_backend(name: str) -> None:
    """Lets backend ``name`` trace here (no GPU): the cases that only lower for CUDA."""
    real = B.backend_unavailable_reason
    B.backend_unavailable_reason = lambda n: None if n == name else real(n)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _op_loss(backend):
    def loss(x, g, w_qkv, w_o, w_gu, w_down, gf, w_vocab, t, pos, inv):
        qkv, x2 = cj.rms_norm_matmul_rope(x, g, w_qkv, pos, inv, num_heads=2, num_kv_heads=1,
                                          return_residual=True, backend=backend)
        x1, c1 = cj.matmul_residual_rms(qkv[:, :128], w_o, x2, g, backend=backend)
        x3, c2 = cj.swiglu_mlp(x1, g, w_gu, w_down, gf, carry=c1, backend=backend)
        # A plain normed GEMM wider than d (N=256 > d=64): its backward runs on the [M, d]
        # side (the NORM_DGRAD epilogue and its row partials).
        z = cj.rms_norm_matmul(x1, gf, w_qkv, backend=backend).astype(jnp.float32)
        return (cj.linear_cross_entropy(x3, gf, w_vocab, t, carry=c2, backend=backend)
                + 0.1 * jnp.mean(jnp.square(z)))
    return loss


def _op_inputs(m=512, d=64, f=128, v=200):
    ks = iter(jax.random.split(jax.random.key(0), 12))
    bf = jnp.bfloat16
    nrm = lambda s, sc=1.0: (jax.random.normal(next(ks), s) * sc).astype(bf)  # noqa: E731
    return (nrm((m, d)), (1 + 0.1 * jax.random.normal(next(ks), (d,))).astype(bf), nrm((d, 256), d ** -0.5),
            nrm((128, d), 128 ** -0.5), nrm((d, 2 * f), d ** -0.5), nrm((f, d), f ** -0.5),
            (1 + 0.1 * jax.random.normal(next(ks), (d,))).astype(bf), nrm((v, d), d ** -0.5),
            jax.random.randint(next(ks), (m,), 0, v), jnp.arange(m) % 128,
            jnp.asarray(cj.rope_inv_freq(64, 10000.0)))


def _all_gathers(hlo: str, min_elems: int) -> list[str]:
    """All-gather instructions whose result has at least ``min_elems`` elements."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\][^ ]* all-gather(-start)?\(", line)
        if m and int(np.prod([int(x) for x in m.group(1).split(",") if x] or [1])) >= min_elems:
            out.append(line.strip()[:160])
    return out


def case_ops_data_parallel(mode: str) -> None:
    """Every op, loss and gradients, tokens split 8 ways: equal to one device, and no
    activation-sized all-gather around a kernel call."""
    install_opaque_kernel()
    args = _op_inputs()
    argnums = tuple(range(8))
    fn = jax.jit(jax.value_and_grad(_op_loss("pallas"), argnums=argnums))
    want = jax.jit(jax.value_and_grad(_op_loss("xla"), argnums=argnums))(*args)
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
        tok = NamedSharding(mesh, P("data"))
        sharded = list(args)
        sharded[0] = jax.device_put(args[0], NamedSharding(mesh, P("data", None)))
        sharded[8], sharded[9] = jax.device_put(args[8], tok), jax.device_put(args[9], tok)
        got = fn(*sharded)
        hlo = fn.lower(*sharded).compile().as_text()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        e = rel(a, b)
        assert e < 2e-2, f"sharded result differs from one device: rel err {e:.3g} for shape {np.shape(a)}"
    gathers = _all_gathers(hlo, 512 * 64)  # [tokens, d] activations or larger
    assert not gathers, "activation-sized all-gathers in the data-parallel step:\n" + "\n".join(gathers)
    # Without the partitioning rules, the same step gathers: the check above can fail.
    axes = partitioning.TOKEN_AXES
    partitioning.set_token_axes(())
    try:
        with jax.set_mesh(mesh):
            hlo0 = jax.jit(jax.value_and_grad(_op_loss("pallas"), argnums=argnums)).lower(*sharded).compile().as_text()
    finally:
        partitioning.set_token_axes(axes)
    assert _all_gathers(hlo0, 512 * 64), "expected all-gathers without partitioning rules"
    print(f"OK ops_data_parallel_{mode}")


def _stacked_partials(jaxpr, shards: int) -> list:
    """Avals of the ``shard_map`` outputs stacked along a leading shard axis (the wgrad
    partial sums of :class:`coda_jax.partitioning.PartitionedLowering`), in any sub-jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            found += [v.aval for v in eqn.outvars if v.aval.ndim == 3 and v.aval.shape[0] == shards]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _stacked_partials(sub, shards)
    return found


def _routing(routing: str):
    """The suite's routing options (``"off"``) or the library's defaults (``"default"``) for
    the block."""
    if routing == "default":
        return cj.options(**{g: getattr(DEFAULTS, g) for g in SUITE_ROUTING})
    return cj.options(**SUITE_ROUTING)


def case_wgrad_partials() -> None:
    """The wgrad GEMMs' partial sums cross devices in the dtype of the gradient they make
    (bfloat16 weights: a bfloat16 all-reduce, the bytes plain JAX moves), the reductions
    in float32; the option ``mesh.partial_sums="float32"`` makes them all float32. Both give the
    one-device gradients."""
    install_opaque_kernel()
    args = _op_inputs()
    argnums = tuple(range(8))
    want = jax.jit(jax.value_and_grad(_op_loss("xla"), argnums=argnums))(*args)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    seen = {}
    for choice in ("output", "float32"):
        with cj.options(mesh=cj.MeshOptions(partial_sums=choice)):
            fn = jax.value_and_grad(_op_loss("pallas"), argnums=argnums)
            with jax.set_mesh(mesh):
                sharded = list(args)
                sharded[0] = jax.device_put(args[0], NamedSharding(mesh, P("data", None)))
                avals = _stacked_partials(jax.make_jaxpr(fn)(*sharded).jaxpr, 8)
                got = jax.jit(fn)(*sharded)
        _assert_matches(got, want, 2e-2, f"partials in {choice}")
        weight_sized = [a for a in avals if a.shape[1] * a.shape[2] >= 64 * 128]  # not the d_gamma partials
        assert weight_sized, "no stacked wgrad partials found: the check would pass vacuously"
        seen[choice] = sorted({str(a.dtype) for a in weight_sized})
    assert seen == {"output": ["bfloat16"], "float32": ["float32"]}, seen
    print("OK wgrad_partials")


def _token_dots_outside_shard_map(jaxpr, tokens: int) -> list[str]:
    """2-D ``dot_general``s over a ``tokens``-long dimension that are not inside a
    ``shard_map``: GEMMs on activations left to the partitioner (in any sub-jaxpr)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            continue
        if eqn.primitive.name == "dot_general":
            shapes = [v.aval.shape for v in eqn.invars]
            if all(len(x) == 2 for x in shapes) and any(tokens in x for x in shapes):
                found.append(" x ".join(map(str, shapes)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _token_dots_outside_shard_map(sub, tokens)
    return found


def _example_train_step(cfg, backend: str, mesh, tokens):
    """The example's train step (:func:`coda_jax.training.make_steps`: loss, gradients, AdamW)
    of CodaLlama on ``mesh`` with FSDP-split state, traced, compiled and run once on
    ``tokens [B, S+1]``: ``(loss, compiled HLO text, traced step)``."""
    from flax import nnx

    from coda_jax import training
    from coda_jax.layers import CodaLlama
    from coda_jax.sharding import batch_sharding, shard_state

    with jax.set_mesh(mesh):
        model = CodaLlama(cfg, rngs=nnx.Rngs(0), backend=backend)
        opt = nnx.Optimizer(model, training.adamw_cosine(3e-4, 10, 1000), wrt=nnx.Param)
        state = shard_state(nnx.state((model, opt)), mesh)
        step, _, _ = training.make_steps(model, opt, jax.tree.map(lambda x: x.sharding, state))
        t = jax.device_put(tokens, batch_sharding(mesh))
        traced = step.trace(state, t[:, :-1], t[:, 1:])
        compiled = traced.lower().compile()
        return float(compiled(state, t[:, :-1], t[:, 1:])[1]), compiled.as_text(), traced


def _benchmark_tools_on_path() -> None:
    """``examples/`` importable (``train_llama``); the benchmark tools are the package
    ``benchmarks`` (the repository root is on ``PYTHONPATH``)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _fsdp2_setup(backend: str):
    """The FSDP cases' model and data: ``(cfg, batch, seq, tokens [batch, seq+1], fsdp=2
    mesh)``, a 3-layer bf16 model whose sizes differ from the token count (384); the kernel
    stand-in installed for ``"pallas"``."""
    from coda_jax.layers import LlamaConfig
    from coda_jax.sharding import mesh_from_spec

    if backend == "pallas":
        install_opaque_kernel()
    cfg = LlamaConfig.tiny(vocab_size=1000, hidden_size=256, intermediate_size=640, num_layers=3, num_heads=4,
                           num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    batch, seq = 8, 48
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size)
    return cfg, batch, seq, tokens, mesh_from_spec("fsdp=2", jax.devices()[:2])


def _collectives(hlo: str, kind: str, dims: list[int] | None = None) -> list[str]:
    """The lines of compiled HLO text whose result comes from a ``kind`` collective (e.g.
    ``"all-gather"``, also its ``-start``) shaped ``dims`` (``None``: any shape), each
    stripped and cut to 200 characters."""
    shape = r"\(?\w+\[" + ",".join(map(str, dims)) + r"\]" if dims is not None else ""
    pattern = re.compile(rf"= {shape}.*? {kind}(?:-start)?\(")
    return [line.strip()[:200] for line in hlo.splitlines() if pattern.search(line)]


def _gathered_along_columns(hlo: str, shapes: set[tuple[int, int]]) -> list[str]:
    """The all-gathers in compiled HLO text of a weight shaped as one of ``shapes`` that
    gather along another dimension than the first, each as the start of its line."""
    _benchmark_tools_on_path()
    from benchmarks.train_step_bench import all_gathers

    return [line[:200] for _, dims, _, line in all_gathers(hlo) if tuple(dims) in shapes and "dimensions={0}" not in line]


def case_fsdp_step_gathers(backend: str) -> None:
    """The example's train step (:func:`coda_jax.training.make_steps`: loss, gradients, AdamW)
    of CodaLlama with FSDP-split state on ``fsdp=2``: no activation-shaped all-gather in the
    compiled step but the vocab-parallel LM head's input, on the ``xla`` backend and the
    kernel stand-in. The partitioner, left to
    place the ``xla`` backend's GEMMs (and the kernel backends' plain GEMMs), gathered the
    per-token ``rstd``, the SwiGLU input and the logits instead of the weights, far slower
    than plain JAX (docs/performance.md#multi-gpu). Tokens (384) differ from every weight
    dimension, so no weight gather is counted."""
    _benchmark_tools_on_path()
    from benchmarks.train_step_bench import activation_gathers, all_gathers

    cfg, batch, seq, tokens, mesh = _fsdp2_setup(backend)

    def compiled_step():
        loss, hlo, traced = _example_train_step(cfg, backend, mesh, tokens)
        return loss, hlo, _token_dots_outside_shard_map(traced.jaxpr.jaxpr, batch * seq)

    loss, hlo, dots = compiled_step()
    assert np.isfinite(loss), loss
    # Every GEMM on activations runs in a token-split shard_map (the plain ones routed to XLA's
    # dot too: on the GPU the partitioner gathered around those, 15 per 1B step, run 140).
    assert not dots, f"{backend}: GEMMs on activations left to the partitioner: {dots}"
    gathers = activation_gathers(hlo, batch, seq, floating_only=True)
    # One activation gather is by design: the vocab-parallel LM head (coda_jax/layers/
    # vocab_parallel.py) takes the final hidden states [tokens, d] of the FSDP group's rows in
    # place of the whole head weight [V, d], which is never gathered.
    # A second is the embedding's: its table is split by vocabulary (sharding.rows_first, as
    # plain JAX places it), so the lookup's backward gathers the cotangent [batch, seq, d] of
    # the group's tokens to scatter it into the local vocabulary rows, where the table split
    # along the width was resharded by all-to-alls, V x d / n each way.
    lookup_shape = rf"\[{batch},{seq},{cfg.hidden_size}\]"
    head = [g for g in gathers if re.search(rf"\[{batch * seq},{cfg.hidden_size}\]", g)]
    lookup = [g for g in gathers if re.search(lookup_shape, g)]
    assert len(head) == 1 and len(lookup) <= 1 and len(gathers) == len(head) + len(lookup), \
        f"{backend}: activation-shaped all-gathers under FSDP besides the LM head's input and the lookup's " \
        "cotangent:\n" + "\n".join(gathers)
    whole_head = [line for dtype, dims, _, line in all_gathers(hlo) if dims == [cfg.vocab_size, cfg.hidden_size]]
    assert not whole_head, f"{backend}: the LM head weight gathered whole:\n" + "\n".join(whole_head)
    # Each block weight is gathered after its cast to bfloat16 (half the bytes), not as the
    # float32 parameter (the partitioner's choice before sharding.cast_for_use pinned the
    # cast copy to the parameter's split; on two H100s, runs 143-144).
    weights = {(cfg.hidden_size, cfg.qkv_size), (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
               (cfg.hidden_size, 2 * cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size)}
    raw = _weight_gathers_of_parameters(hlo, weights)
    assert not raw, f"{backend}: float32 parameters gathered before their cast:\n" + "\n".join(raw)
    # ... and along its rows (sharding.rows_first): a gather along the columns of a row-major
    # weight wants a column-major buffer, and its gradient's reduce-scatter made XLA's
    # optimizer update read the parameter and both moments transposed (RESULTS.md runs
    # 284-285, 290).
    across = _gathered_along_columns(hlo, weights)
    assert not across, f"{backend}: weights gathered along their columns:\n" + "\n".join(across)
    if backend == "xla":  # the head's split is the model's choice, the same for every backend
        # With the token-split head (mesh.vocab_parallel_head=False): no activation gather
        # but the lookup's cotangent, the head weight gathered whole instead, and the same loss.
        with cj.options(mesh=cj.MeshOptions(vocab_parallel_head=False)):
            loss_t, hlo_t, _ = compiled_step()
        others = [g for g in activation_gathers(hlo_t, batch, seq, floating_only=True) if not re.search(lookup_shape, g)]
        assert not others, "activation gathers, token-split head:\n" + "\n".join(others)
        assert any(dims == [cfg.vocab_size, cfg.hidden_size] for _, dims, _, _ in all_gathers(hlo_t)), \
            "the token-split head did not gather its weight"
        assert abs(loss_t - loss) <= 1e-3 * abs(loss), (loss_t, loss)
    # With few tokens a device (192 here) every GEMM runs as XLA ops left to the
    # partitioner by default, the kernel backend's too (partitioning.fsdp_xla_tokens_below;
    # the suite's options turn that off), same loss. (Which tensors it gathers is its own
    # choice: with the width split's weights on their rows it gathers them, as on the token
    # split; choose_fsdp_split takes the features split there, case fsdp_features_*.)
    with cj.options(mesh={"fsdp_xla_tokens_below": DEFAULTS.mesh.fsdp_xla_tokens_below}):  # the default bound
        assert partitioning.fsdp_xla_tokens_below() > batch * seq // 2
        loss0, hlo0, dots0 = compiled_step()
    with cj.options(mesh={"fsdp_xla_tokens_below": batch * seq // 2}):  # 192 tokens a device: not below, split again
        assert not compiled_step()[2], "GEMMs left to the partitioner at the bound"
    assert dots0, "expected GEMMs outside shard_map with few tokens a device"
    mlp_gathers = lambda h: [line for _, dims, _, line in all_gathers(h)  # noqa: E731
                             if dims == [cfg.hidden_size, 2 * cfg.intermediate_size]]
    assert mlp_gathers(hlo), "token-split GEMMs: expected the MLP weight gathered (ZeRO-3)"
    assert abs(loss0 - loss) <= 1e-3 * abs(loss), (loss0, loss)
    if backend == "pallas":
        # Below mesh.fsdp_xla_gemms_below tokens a device (above the partitioner's bound)
        # the kernel backend's GEMMs run on the xla backend's lowering, still split by tokens:
        # no kernel call (the stand-in's host callback) in the step but the vocab-parallel LM
        # head's (its own shard_map over the manual fsdp axis, where neither FSDP rule
        # applies), the MLP weight gathered, no GEMM left to the partitioner, the same loss.
        kernel_calls = lambda h: h.count('custom_call_target="xla_ffi_python_cpu_callback"')  # noqa: E731
        assert kernel_calls(hlo) > 10, "expected the stand-in kernels in the token-split step"
        with cj.options(mesh={"fsdp_xla_tokens_below": 0, "fsdp_xla_gemms_below": batch * seq // 2 + 1}):
            loss1, hlo1, dots1 = compiled_step()
        assert kernel_calls(hlo1) <= 1, f"{kernel_calls(hlo1)} kernel calls under FSDP below the xla-GEMMs bound"
        assert not dots1 and mlp_gathers(hlo1), "expected token-split GEMMs with the MLP weight gathered"
        assert abs(loss1 - loss) <= 1e-3 * abs(loss), (loss1, loss)
    print(f"OK fsdp_gathers_{backend}")


def case_fsdp_features_split(backend: str) -> None:
    """The FSDP split along the weights' features (``partitioning.fsdp_split_as("features")``):
    the state is placed along the MLP / attention / vocabulary features, every GEMM on
    activations is left to the partitioner (none inside a ``shard_map``, no stand-in kernel
    call), no weight of the MLP is gathered whole (the partitioner runs the MLP tensor-parallel
    over the FSDP axis), and the example's step has the loss of the width split."""
    _benchmark_tools_on_path()
    from flax import nnx

    from benchmarks.train_step_bench import all_gathers
    from coda_jax.layers import CodaLlama
    from coda_jax.sharding import shard_state

    cfg, batch, seq, tokens, mesh = _fsdp2_setup(backend)
    loss_w, hlo_w, _ = _example_train_step(cfg, backend, mesh, tokens)
    with partitioning.fsdp_split_as("features"):
        assert partitioning.features_split(mesh)
        loss, hlo, traced = _example_train_step(cfg, backend, mesh, tokens)
        with jax.set_mesh(mesh):
            placed = shard_state(nnx.state(CodaLlama(cfg, rngs=nnx.Rngs(0), backend=backend)), mesh)
    blk = placed["blocks"][0]
    spec = lambda v: tuple(v.get_value().sharding.spec) + (None,) * (v.get_value().ndim - len(v.get_value().sharding.spec))  # noqa: E731
    assert spec(blk["w_gu"]) == (None, "fsdp") and spec(blk["w_down"]) == ("fsdp", None), \
        (spec(blk["w_gu"]), spec(blk["w_down"]))
    # w_qkv along its rows, as plain JAX places its separate Q, K, V weights: split along the
    # columns, its gradient's reduce-scatter takes a column-major layout and the optimizer
    # update transposes the parameter and both moments (8B width on two H200s: 1.1 ms a step)
    assert spec(blk["w_qkv"]) == ("fsdp", None) and spec(placed["embed"]) == ("fsdp", None), \
        (spec(blk["w_qkv"]), spec(placed["embed"]))
    assert spec(blk["attn_norm"]) == (None,)
    dots = _token_dots_outside_shard_map(traced.jaxpr.jaxpr, batch * seq)
    assert dots, f"{backend}: expected the GEMMs on activations left to the partitioner"
    kernel_calls = hlo.count('custom_call_target="xla_ffi_python_cpu_callback"')
    assert kernel_calls <= 1, f"{backend}: {kernel_calls} kernel calls with the features split"
    mlp = {(cfg.hidden_size, 2 * cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size)}
    gathered = [line for _, dims, _, line in all_gathers(hlo) if tuple(dims) in mlp]
    assert not gathered, f"{backend}: MLP weights gathered whole with the features split:\n" + "\n".join(gathered)
    # The attention weights it gathers, along their rows (w_qkv split by columns was gathered
    # and reduce-scattered column-major: RESULTS.md runs 284-286)
    attn = {(cfg.hidden_size, cfg.qkv_size), (cfg.num_heads * cfg.head_dim, cfg.hidden_size)}
    across = _gathered_along_columns(hlo, attn)
    assert not across, f"{backend}: attention weights gathered along their columns:\n" + "\n".join(across)
    assert [1 for _, dims, _, _ in all_gathers(hlo_w) if tuple(dims) in mlp], "width split: expected ZeRO-3 gathers"
    assert abs(loss - loss_w) <= 1e-3 * abs(loss_w), (loss, loss_w)
    print(f"OK fsdp_features_{backend}")


def _weight_gathers_of_parameters(hlo: str, shapes) -> list[str]:
    """All-gathers in compiled HLO text whose result has one of the 2-D ``shapes`` and whose
    operand is a step parameter or a bare copy of one (the uncast weight), each as its line."""
    from benchmarks.train_step_bench import all_gathers

    return [line[:160] for _, dims, operand, line in all_gathers(hlo)
            if tuple(dims) in shapes and re.match(r"%(param|Arg_|wrapped_copy|copy)", operand)]


def _model_step(backend: str, cfg):
    """(jitted ``value_and_grad`` of ``CodaLlama(cfg).loss``, its state, tokens ``[8, 33]``,
    the one-device result)."""
    from flax import nnx

    from coda_jax.layers import CodaLlama

    if backend == "pallas":
        install_opaque_kernel()
    gdef, state = nnx.split(CodaLlama(cfg, rngs=nnx.Rngs(0), backend=backend))
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, cfg.vocab_size)
    step = jax.jit(jax.value_and_grad(lambda st, t: nnx.merge(gdef, st).loss(t[:, :-1], t[:, 1:])))
    return step, state, tokens, step(state, tokens)


def _assert_matches(got, want, tol: float, label: str, tol_for=None) -> None:
    """Every leaf of ``got`` within relative error ``tol`` of ``want``'s (``tol_for(path)``:
    a leaf's own bound where it returns one)."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        e, name = rel(a, b), jax.tree_util.keystr(path)
        bound = (tol_for(name) if tol_for else None) or tol
        assert e < bound, f"{label}: {name} rel err {e:.3g}"


def case_model(backend: str, shape: tuple[int, ...], mode: str, replicated_tokens: bool = False) -> None:
    """CodaLlama's loss and every gradient on a ("data", "fsdp") mesh (FSDP-sharded state)
    equal one device's. ``replicated_tokens``: the batch given unsharded; the kernels still
    split it by tokens, and each op's input gradient keeps its input's (replicated) type."""
    from coda_jax.layers import LlamaConfig
    from coda_jax.sharding import batch_sharding, shard_state

    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=32, dtype=jnp.bfloat16)
    step, state, tokens, want = _model_step(backend, cfg)
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    names = ("data", "fsdp")[:len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    with jax.set_mesh(mesh):
        batch = tokens if replicated_tokens else jax.device_put(tokens, batch_sharding(mesh))
        got = step(shard_state(state, mesh), batch)
    _assert_matches(got, want, 2e-2, f"{backend} {shape} {mode}")
    print(f"OK model_{backend}_{'x'.join(map(str, shape))}_{mode}{'_replicated' if replicated_tokens else ''}")


def case_model_fp8(backend: str, shape: tuple[int, ...], mode: str, lm_head: bool = False,
                   swiglu_input: str = "compute", replicated_tokens: bool = False) -> None:
    """An FP8 CodaLlama (``LlamaConfig(fp8=...)``): loss, gradients and the new amax histories
    (the histories' gradients) on a ("data", "fsdp") mesh, or with a third shape entry a
    ("data", "fsdp", "tensor") mesh, equal one device's: each amax is a max over the whole
    tensor, so data parallel, FSDP and tensor parallel give one device's scales. (Under a
    tensor axis the FP8 block's GEMMs are split by XLA's partitioner from the weights' tensor
    splits: heads, MLP features.) ``lm_head``: ``Fp8Recipe(lm_head=True)``; on a mesh whose
    fsdp or tensor axis divides the vocabulary the FP8 head is vocab-parallel (its amaxes
    reduced over the shard_map's axes, its histories returned by one shard). ``swiglu_input``:
    ``Fp8Recipe(swiglu_input=...)`` ("e4m3": z saved in e4m3, its amax row recorded too).
    ``replicated_tokens``: the batch given unsharded (replicated on every device); the blocks'
    input gradients must keep its type (an Explicit mesh checks it while tracing)."""
    from flax import nnx

    from coda_jax.fp8 import Fp8Meta, Fp8Recipe
    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.sharding import batch_sharding, shard_state

    # float32 compute on the xla backend: the mesh's other summation order changes values in
    # their last float32 bits, which almost never moves one across an FP8 rounding boundary,
    # so the comparison is tight. In bfloat16 (the kernel backends' dtype) a value that moves
    # by a bf16 step crosses an e5m2 boundary (25 % steps) often enough that the gradients of
    # the first block differ by ~10 % (errors compound through the backward): a loose bound.
    dtype, tol = (jnp.float32, 1e-3) if backend == "xla" else (jnp.bfloat16, 0.25)
    heads = (8, 4) if len(shape) == 3 else (2, 1)  # a tensor axis splits heads and KV heads
    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=heads[0],
                           num_kv_heads=heads[1], head_dim=32, dtype=dtype,
                           fp8=Fp8Recipe(lm_head=lm_head, swiglu_input=swiglu_input))
    if backend == "pallas":
        install_opaque_kernel()
    model = CodaLlama(cfg, rngs=nnx.Rngs(0), backend=backend)
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, cfg.vocab_size)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))

    def grads(m, t):
        return nnx.value_and_grad(lambda mm: mm.loss(t[:, :-1], t[:, 1:]), argnums=wrt)(m)

    _, g = nnx.jit(grads)(model, tokens)  # calibrate: the scales of a real step, not scale 1
    nnx.update(model, g.filter(Fp8Meta))
    gdef, state = nnx.split(model)
    step = jax.jit(lambda st, t: grads(nnx.merge(gdef, st), t))
    want = step(state, tokens)
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    names = ("data", "fsdp", "tensor")[:len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    with jax.set_mesh(mesh):
        sharded = shard_state(state, mesh)
        if len(shape) == 3:  # the weights on their tensor splits (so the GEMMs split by features)
            blk = sharded["blocks"][0]
            assert "tensor" in str(blk["w_gu"][...].sharding.spec) and "tensor" in str(blk["w_down"][...].sharding.spec)
        got = step(sharded, tokens if replicated_tokens else jax.device_put(tokens, batch_sharding(mesh)))
    if lm_head:
        head = np.asarray(got[1]["fp8_head_meta"][...])
        assert head[1, 0] > 0 and head[2, 0] > 0, head  # the weight's and dlogits' amaxes: recorded once
    # With the FP8 head in float32 compute, dlogits meets e5m2 (2 mantissa bits): a logit that
    # differs from one device's in its last float32 bit can put its dlogits element on the other
    # side of a rounding boundary. Over four draws of weights and tokens that moved the first
    # block's gradients by 2.7 % and 4.7 % in two and by 1e-7 in the others, so the parameters'
    # gradients get a loose bound there; the loss and the amax histories (the scales) keep the
    # tight one.
    if swiglu_input == "e4m3":  # the z row (the last) of each block's histories: recorded
        assert all(float(b["fp8_meta"][...][-1, 0]) > 0 for b in got[1]["blocks"].values()), "z amax not recorded"
    loose = backend == "xla" and lm_head
    _assert_matches(got, want, tol, f"fp8 {backend} {shape} {mode} lm_head={lm_head}",
                    tol_for=lambda name: 0.1 if loose and name.startswith("[1]") and "fp8" not in name else None)
    print(f"OK model_fp8_{'head_' if lm_head else ''}{'zq8_' if swiglu_input == 'e4m3' else ''}{backend}_"
          f"{'x'.join(map(str, shape))}_{mode}{'_replicated' if replicated_tokens else ''}")


def case_fp8_wgrads_split_by_tokens(mode: str) -> None:
    """Data parallel FP8 on a kernel backend: each wgrad contracts its own device's tokens
    (``fp8_gemm(contracts_tokens=True)``: both operands K-major, the tokens their second
    dimension) and the partial sums are reduced after. Taken by their shapes for a row-split
    GEMM, the wgrads had their FP8 operands all-gathered and re-split (all-to-all): on two
    H200s (1B, 8 x 1024 tokens a GPU) 47 ms of a 151 ms step went to those gathers."""
    from flax import nnx

    from coda_jax.fp8 import Fp8Meta, Fp8Recipe
    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.sharding import batch_sharding, shard_state

    install_opaque_kernel()
    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=32, dtype=jnp.bfloat16, fp8=Fp8Recipe())
    gdef, state = nnx.split(CodaLlama(cfg, rngs=nnx.Rngs(0), backend="pallas"))
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, cfg.vocab_size)  # 512 tokens, 64 a device
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))

    def grads(st, t):
        return nnx.value_and_grad(lambda m: m.loss(t[:, :-1], t[:, 1:]), argnums=wrt)(nnx.merge(gdef, st))

    def compiled_hlo() -> str:  # a new jit each time: traced again, under the flag as it is now
        with jax.set_mesh(mesh):
            return jax.jit(lambda st, t: grads(st, t)).lower(shard_state(state, mesh),
                                        jax.device_put(tokens, batch_sharding(mesh))).compile().as_text()

    def moved(hlo: str) -> list[str]:  # activation-sized all-gathers ([512, 64] or larger) and any all-to-all
        return _all_gathers(hlo, 512 * 64) + [ln.strip()[:160] for ln in hlo.splitlines() if " all-to-all" in ln]

    got = moved(compiled_hlo())
    assert not got, f"{mode}: the FP8 data-parallel step moves activations between devices:\n" + "\n".join(got)
    # Nothing in FP8 crosses devices: each device quantizes its replicated weights itself (one
    # epilogue pass each, run whole on every device), as XLA runs plain JAX's casts.
    with jax.set_mesh(mesh):
        part = _partitioned_hlo(jax.jit(grads).lower(shard_state(state, mesh),
                                                     jax.device_put(tokens, batch_sharding(mesh))))
    fp8_moves = [ln.strip()[:160] for ln in part.splitlines()
                 if re.search(r"= f8e\w+\[[^\]]*\]\S* (all-reduce|all-gather|all-to-all|collective-permute)\(", ln)]
    assert not fp8_moves, f"{mode}: FP8 values cross devices under data parallelism:\n" + "\n".join(fp8_moves)
    # The wgrads' partial sums cross devices in the compute dtype (bf16), as plain JAX FP8's and
    # the bf16 block's do: not in float32 (twice the bytes).
    with jax.set_mesh(mesh):
        avals = _stacked_partials(jax.make_jaxpr(grads)(shard_state(state, mesh),
                                                        jax.device_put(tokens, batch_sharding(mesh))).jaxpr, 8)
    weight_sized = sorted({(str(a.dtype), a.shape[1:]) for a in avals if a.shape[1] * a.shape[2] >= 64 * 64})
    assert len(weight_sized) == 4 and {d for d, _ in weight_sized} == {"bfloat16"}, weight_sized
    if mode == "explicit":
        print(f"OK fp8_wgrads_split_by_tokens_{mode}")
        return
    # Without the declaration (the lowering taken for one that cannot split K) the same step
    # gathers: the check above can fail. (Under Explicit axes that step is not even typed
    # right: the wgrad comes out split along its rows.)
    partitioning.PartitionedLowering.splits_tokens = False
    try:
        assert moved(compiled_hlo()), "expected gathered wgrad operands without contracts_tokens"
    finally:
        partitioning.PartitionedLowering.splits_tokens = True
    print(f"OK fp8_wgrads_split_by_tokens_{mode}")


def _partitioned_hlo(lowered) -> str:
    """The HLO of ``lowered`` (a ``jax.stages.Lowered``) as the SPMD partitioner leaves it: its
    collectives move the dtypes the model gave them (the CPU compiler widens 8- and 16-bit
    collectives after it)."""
    import glob
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        (path,) = glob.glob(os.path.join(d, "*after_spmd-partitioning*"))
        with open(path) as f:
            return f.read()


def case_fp8_fsdp_weight_gathers(mode: str) -> None:
    """FSDP in FP8 on a kernel backend (``data=2, fsdp=4``): each device quantizes its own rows
    of a block weight and the e4m3 copy is gathered, one byte an element, where the float32
    parameter (four) was gathered and quantized whole; loss and gradients as one device's are
    :func:`case_model_fp8`'s. Under an Auto mesh the quantized copy must be pinned to the
    parameter's split (``sharding.param_split``): unpinned, the partitioner gathers the float32
    parameter (the control)."""
    from flax import nnx

    from coda_jax.fp8 import Fp8Meta, Fp8Recipe
    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.layers import block as block_module
    from coda_jax.sharding import batch_sharding, shard_state

    install_opaque_kernel()
    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=32, dtype=jnp.bfloat16, fp8=Fp8Recipe())
    gdef, state = nnx.split(CodaLlama(cfg, rngs=nnx.Rngs(0), backend="pallas"))
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, cfg.vocab_size)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
    weights = {(64, cfg.qkv_size), (64, 64), (64, 256), (128, 64)}  # w_qkv, w_o, w_gu, w_down

    def weight_gathers() -> list[tuple[str, tuple[int, ...]]]:
        def grads(st, t):
            return nnx.value_and_grad(lambda m: m.loss(t[:, :-1], t[:, 1:]), argnums=wrt)(nnx.merge(gdef, st))

        with jax.set_mesh(mesh):
            hlo = _partitioned_hlo(jax.jit(grads).lower(shard_state(state, mesh),
                                                        jax.device_put(tokens, batch_sharding(mesh))))
        found = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)
        return [(dt, dims) for dt, d in found if (dims := tuple(int(x) for x in d.split(",") if x)) in weights]

    got = weight_gathers()
    assert len({dims for _, dims in got}) == 4, f"{mode}: expected each block weight gathered: {got}"
    assert {dt for dt, _ in got} == {"f8e4m3fn"}, f"{mode}: block weights gathered wider than e4m3: {got}"
    if mode == "auto":
        split = block_module.param_split
        block_module.param_split = lambda var: None  # the quantized copies left unpinned
        try:
            assert "f32" in {dt for dt, _ in weight_gathers()}, "expected float32 weight gathers unpinned"
        finally:
            block_module.param_split = split
    print(f"OK fp8_fsdp_weight_gathers_{mode}")


def case_model_tensor_parallel(backend: str, shape: tuple[int, int, int], mode: str, dtype: str) -> None:
    """CodaLlama on a ("data", "fsdp", "tensor") mesh (Megatron TP, sequence-parallel residual,
    FSDP-sharded state): loss and every gradient equal one device's. In float32 the bound is
    tight (a shard's missing or doubled partial gradient shows at 1e-1, rounding at 1e-6); QK-norm on."""
    from flax import nnx

    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.sharding import batch_sharding, shard_state

    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=8,
                           num_kv_heads=4, head_dim=32, qk_norm=True, dtype=getattr(jnp, dtype))
    step, state, tokens, want = _model_step(backend, cfg)
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(axis_type,) * 3)
    with jax.set_mesh(mesh):
        s_state = shard_state(state, mesh)
        w_gu = s_state["blocks"][0]["w_gu"][...]
        assert "tensor" in tuple(w_gu.sharding.spec), f"w_gu not split over 'tensor': {w_gu.sharding.spec}"
        s_tokens = jax.device_put(tokens, batch_sharding(mesh))
        got = step(s_state, s_tokens)
        hlo = step.lower(s_state, s_tokens).compile().as_text()
    assert "reduce-scatter" in hlo, "no reduce-scatter in the tensor-parallel step (row-parallel GEMMs)"
    # FSDP gathers each tensor shard's block weights along their rows (sharding.rows_first:
    # w_o and w_down stored P(("tensor", "fsdp"), None)); stored P("tensor", "fsdp"), they were
    # gathered along dimension 1, column-major, as on the FSDP mesh of RESULTS.md runs 284-290.
    t = shape[2]
    weights = {(cfg.hidden_size, 2 * cfg.intermediate_size // t), (cfg.num_heads * cfg.head_dim // t, cfg.hidden_size),
               (cfg.intermediate_size // t, cfg.hidden_size)}
    # (Gathers over "tensor" alone are W_q / W_k / W_v's column groups, which are whole
    # over that axis, and their gradients; at these sizes W_q shares w_gu's shard shape.)
    across = [g for g in _gathered_along_columns(hlo, weights) if "{'tensor'}" not in g]
    assert not across, f"TP {backend} {shape}: weights gathered along their columns:\n" + "\n".join(across)
    # Each device gathers its tensor shard's columns of w_gu over "fsdp", never the whole
    # [d, 2F] (under an Explicit mesh the block gathered every weight whole before).
    whole = _collectives(hlo, "all-gather", [cfg.hidden_size, 2 * cfg.intermediate_size])
    assert not whole, f"TP {backend} {shape} {mode}: w_gu gathered whole:\n" + "\n".join(whole)
    # No all-to-all: the embedding on its rows is not resharded, and W_qkv's Q / K / V column
    # groups go to their tensor shards by a local slice and a gather along the rows
    # (tensor_parallel._columns_over_tensor), not by all-to-alls over "fsdp".
    a2a = _collectives(hlo, "all-to-all")
    assert not a2a, f"TP {backend} {shape} {mode}: all-to-alls in the step:\n" + "\n".join(a2a)
    _assert_matches(got, want, 1e-4 if dtype == "float32" else 2e-2, f"TP {backend} {shape} {mode} {dtype}")
    # A head count the tensor axis does not divide is refused by name (where it does not
    # divide: over a tensor axis of 2 the same model is valid, and would only run eagerly here).
    if shape[2] > 2:
        bad = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=256, num_layers=1, num_heads=6,
                               num_kv_heads=2, head_dim=32)
        with jax.set_mesh(mesh):
            try:
                CodaLlama(bad, rngs=nnx.Rngs(0), backend=backend).loss(tokens[:, :-1], tokens[:, 1:])
            except ValueError as err:
                assert "num_heads" in str(err) and "'tensor'" in str(err), err
            else:
                raise AssertionError("6 heads / 2 KV heads over a tensor axis > 2 ran")
    print(f"OK tp_{backend}_{'x'.join(map(str, shape))}_{mode}_{dtype}")


def case_tensor_step_embedding() -> None:
    """The example's train step (loss, gradients, AdamW) on a ``tensor=2`` mesh and on
    ``fsdp=2 x tensor=2``: the tied embedding is split by vocabulary over ``"tensor"``
    (:data:`coda_jax.sharding.LOGICAL_AXIS_RULES`), as the vocab-parallel head takes it, so
    its gradient is never gathered whole. Stored whole over ``"tensor"``, the head's
    gradient ``[V / T, d]`` was gathered to ``[V, d]`` every step; with FSDP beside it, the
    table went from its FSDP split to the head's tensor split by collective-permutes."""
    _benchmark_tools_on_path()

    from coda_jax.layers import LlamaConfig
    from coda_jax.sharding import mesh_from_spec

    cfg = LlamaConfig.tiny(vocab_size=1000, hidden_size=256, intermediate_size=640, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (8, 49), 0, cfg.vocab_size)
    for spec in ("tensor=2", "fsdp=2,tensor=2"):
        mesh = mesh_from_spec(spec, jax.devices()[:4 if "fsdp" in spec else 2])
        loss, hlo, _ = _example_train_step(cfg, "xla", mesh, tokens)
        assert np.isfinite(loss), (spec, loss)
        whole = _collectives(hlo, "all-gather", [cfg.vocab_size, cfg.hidden_size])
        assert not whole, f"{spec}: the embedding gathered whole:\n" + "\n".join(whole)
        permuted = _collectives(hlo, "collective-permute", [cfg.vocab_size // 2, cfg.hidden_size])
        assert not permuted, f"{spec}: the embedding permuted between splits:\n" + "\n".join(permuted)
    print("OK tp_step_embedding")


MESH_FUZZ_MESHES = (
    ((8,), ("data",)), ((8,), ("fsdp",)), ((2,), ("fsdp",)), ((2, 4), ("data", "fsdp")), ((4, 2), ("data", "fsdp")),
    ((2, 2, 2), ("data", "fsdp", "tensor")), ((1, 2, 4), ("data", "fsdp", "tensor")), ((4, 1, 2), ("data", "fsdp", "tensor")),
)


def case_mesh_fuzz(seed: int, draws: int = 4) -> None:
    """Seeded random models on random meshes: for each draw a mesh (data, FSDP, data x FSDP,
    tensor parallel; Auto or Explicit), a backend (``xla`` or the kernel stand-in), the FSDP
    split (width or features), the routing rules on or off, and a small Llama (width, heads,
    GQA ratio, head_dim, FFN, vocabulary that the axes may or may not divide, QK-norm, tied
    head, 1-2 layers, float32 or bfloat16, sequence lengths that are not powers of two). The
    loss and every gradient equal one device's (float32: within 1e-4; bfloat16: as close to
    float32 math as one device's bfloat16 step, twice its error + 2e-3), or the model refuses
    the mesh with a ``ValueError`` that names its rule; anything else (a crash, NaN, a wrong
    gradient) fails. Prints one line per draw."""
    import random

    _benchmark_tools_on_path()
    from flax import nnx

    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.sharding import batch_sharding, shard_state

    install_opaque_kernel()
    rng = random.Random(seed)
    for i in range(draws):
        shape, names = rng.choice(MESH_FUZZ_MESHES)
        mode = rng.choice(("auto", "explicit"))
        backend, split, routing = rng.choice(("xla", "pallas")), rng.choice(("width", "features")), rng.choice(("off", "default"))
        t = dict(zip(names, shape)).get("tensor", 1)
        fits = t > 1 and rng.random() < 0.7  # mostly a model the tensor axis divides
        kv = t * rng.choice((1, 2)) if fits else rng.choice((1, 2, 4))
        heads = kv * rng.choice((1, 2, 4))
        ffn = 64 * t * rng.choice((1, 2, 3)) if fits else 64 * rng.choice((1, 2, 3, 5))
        dtype = rng.choice(("float32", "bfloat16"))
        cfg = LlamaConfig.tiny(vocab_size=rng.choice((131, 250, 256, 1000)), hidden_size=rng.choice((64, 96, 128, 192)),
                               intermediate_size=ffn, num_layers=rng.choice((1, 2)),
                               num_heads=heads, num_kv_heads=kv, head_dim=rng.choice((16, 32)),
                               qk_norm=rng.random() < 0.5, tie_word_embeddings=rng.random() < 0.5,
                               dtype=getattr(jnp, dtype))
        shards = int(np.prod([n for n, a in zip(shape, names) if a != "tensor"]))
        batch, seq = shards * rng.choice((1, 2)), rng.choice((8, 17, 33, 48))
        label = (f"draw {i}: mesh {dict(zip(names, shape))} {mode}, {backend}, split {split}, routing {routing}, "
                 f"{dtype}, d={cfg.hidden_size} f={cfg.intermediate_size} heads={heads}/{kv}x{cfg.head_dim} "
                 f"vocab={cfg.vocab_size} layers={cfg.num_layers} qk_norm={cfg.qk_norm} tied={cfg.tie_word_embeddings} "
                 f"tokens={batch}x{seq}")
        gdef, state = nnx.split(CodaLlama(cfg, rngs=nnx.Rngs(i), backend=backend))
        tokens = jax.random.randint(jax.random.key(seed * 100 + i), (batch, seq + 1), 0, cfg.vocab_size)
        step = jax.jit(jax.value_and_grad(lambda st, t, g=gdef: nnx.merge(g, st).loss(t[:, :-1], t[:, 1:])))
        with _routing(routing):
            want = step(state, tokens)
            axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
            mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
            try:
                with partitioning.fsdp_split_as(split), jax.set_mesh(mesh):
                    got = step(shard_state(state, mesh), jax.device_put(tokens, batch_sharding(mesh)))
            except ValueError as err:  # a rule of the mesh, named (tensor parallel's divisibility)
                assert "tensor" in str(err) and any(w in str(err) for w in ("multiple", "divide")), f"{label}: {err}"
                print(f"REFUSED {label}: {str(err)[:160]}")
                continue
        assert np.isfinite(float(got[0])), f"{label}: loss {got[0]}"
        if dtype == "float32":
            _assert_matches(got, want, 1e-4, label)
        else:  # as close to float32 math as one device's bfloat16 step (a lost shard's part is O(1))
            g32 = nnx.split(CodaLlama(cfg.replace(dtype=jnp.float32), rngs=nnx.Rngs(i), backend=backend))[0]
            with _routing(routing):
                exact = jax.jit(jax.value_and_grad(lambda st, t: nnx.merge(g32, st).loss(t[:, :-1], t[:, 1:])))(state, tokens)
            for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), jax.tree.leaves(exact)):
                e, e1 = rel(a, c), rel(b, c)
                assert e <= 2 * e1 + 2e-3, f"{label}: {jax.tree_util.keystr(path)} rel err {e:.3g} (one device {e1:.3g})"
        print(f"PASS {label}")
    print(f"OK mesh_fuzz_{seed}")


def case_fsdp_head_explicit() -> None:
    """Under an Explicit FSDP mesh the vocab-parallel LM head takes the head weight on its
    stored split (``CodaLlama.vocab_weight(whole=False)``), and the embedding lookup reads
    the table where its rows lie (``coda_jax.layers.embedding``): no all-gather of the whole
    ``[V, d]`` table in the compiled step (three such gathers before the head's split: the
    lookup's, the head's forward and its backward; one, the lookup's, before the split
    lookup, with a dense ``[V, d]`` reduce-scatter in its backward). The same with tensor
    parallelism beside FSDP (the table split by vocabulary over both)."""
    _benchmark_tools_on_path()

    from coda_jax.layers import LlamaConfig

    cfg = LlamaConfig.tiny(vocab_size=1000, hidden_size=256, intermediate_size=640, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (8, 49), 0, cfg.vocab_size)
    for shape, names in (((2,), ("fsdp",)), ((2, 2), ("fsdp", "tensor"))):
        mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                             devices=jax.devices()[:math.prod(shape)])
        loss, hlo, _ = _example_train_step(cfg, "xla", mesh, tokens)
        assert np.isfinite(loss), loss
        whole = _collectives(hlo, "all-gather", [cfg.vocab_size, cfg.hidden_size])
        assert not whole, f"{names}: the [V, d] table gathered whole under Explicit FSDP:\n" + "\n".join(whole)
        scattered = _collectives(hlo, "reduce-scatter", [cfg.vocab_size, cfg.hidden_size])
        assert not scattered, f"{names}: a dense [V, d] cotangent reduce-scattered:\n" + "\n".join(scattered)
    print("OK fsdp_head_explicit")


def case_embedding_explicit() -> None:
    """``coda_jax.layers.embedding.embedding_lookup`` under Explicit meshes, the table split
    by vocabulary over FSDP, tensor or both (the split lookup) or whole: the rows and the
    table's gradient equal one device's (float32, the first and last rows among the tokens;
    bfloat16 output)."""
    from coda_jax.layers.embedding import embedding_lookup

    v, d = 64 * 8, 16
    table = jax.random.normal(jax.random.key(0), (v, d), jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, v).at[0, :2].set(jnp.array([0, v - 1]))
    ct = jax.random.normal(jax.random.key(2), (8, 12, d), jnp.float32)

    def loss(t, tok, dtype):
        return jnp.sum(embedding_lookup(t, tok, dtype).astype(jnp.float32) * ct)

    for dtype in (jnp.float32, jnp.bfloat16):
        want = (jnp.take(table, tokens, axis=0).astype(dtype), jax.grad(loss)(table, tokens, dtype))
        for shape, names, rows in (((8,), ("fsdp",), "fsdp"), ((2, 4), ("data", "fsdp"), "fsdp"),
                                   ((2, 2, 2), ("data", "fsdp", "tensor"), ("tensor", "fsdp")),
                                   ((2, 4), ("data", "tensor"), "tensor"), ((2, 4), ("data", "fsdp"), None)):
            mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
            tok_axes = tuple(a for a in names if a in ("data", "fsdp"))
            with jax.set_mesh(mesh):
                t = jax.device_put(table, NamedSharding(mesh, P(rows, None)))
                k = jax.device_put(tokens, NamedSharding(mesh, P(tok_axes if len(tok_axes) > 1 else tok_axes[0])))
                got = jax.jit(lambda t, k: (embedding_lookup(t, k, dtype), jax.grad(loss)(t, k, dtype)))(t, k)
            assert got[0].dtype == dtype and got[0].sharding.spec[0] == k.sharding.spec[0], (names, got[0].sharding)
            np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
            np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6, atol=1e-6,
                                       err_msg=f"{names} rows={rows} {dtype.__name__}")
    print("OK embedding_explicit")


def case_plain_explicit() -> None:
    """The plain JAX baseline (``benchmarks/plain_llama.py``) under Explicit meshes, each
    weight gathered where it is used: its loss and every gradient equal one device's (float32),
    and each gradient comes back placed as its parameter (FSDP's reduce-scatter)."""
    from flax import nnx

    from coda_jax.layers import LlamaConfig
    from coda_jax.sharding import batch_sharding, mesh_from_spec

    _benchmark_tools_on_path()
    from benchmarks.plain_llama import PlainLlama, shard_plain_state

    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, dtype=jnp.float32)
    gdef, state = nnx.split(PlainLlama(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, cfg.vocab_size)
    step = jax.jit(jax.value_and_grad(lambda st, t: nnx.merge(gdef, st).loss(t[:, :-1], t[:, 1:])))
    want = step(state, tokens)
    for spec in ("fsdp=8", "data=2,fsdp=4", "fsdp=2,tensor=4"):
        mesh = mesh_from_spec(spec, explicit=True)
        with jax.set_mesh(mesh):
            placed = shard_plain_state(state, mesh)
            got = step(placed, jax.device_put(tokens, batch_sharding(mesh)))
        assert abs(float(got[0]) - float(want[0])) < 1e-5 * abs(float(want[0])), (spec, got[0], want[0])
        _assert_matches(got[1], want[1], 1e-5, f"plain {spec} explicit")
        for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(placed)):
            assert g.sharding.spec == p.sharding.spec, (spec, jax.tree_util.keystr(path), g.sharding, p.sharding)
    print("OK plain_explicit")


def case_plain_tensor() -> None:
    """The plain JAX baseline on Auto meshes with a tensor axis, placed as the benchmarks place
    it (``plain_llama.shard_plain_state``: Megatron's split of the block weights): the loss and
    every gradient equal one device's (float32), each block weight is split over "tensor"
    along its Megatron dimension, and the compiled step gathers no activation (the
    partitioner shards heads and MLP features and all-reduces after ``wo`` and ``w_down``).
    The same step with the embedding split by vocabulary gathers activations, so the check
    can fail."""
    from flax import nnx

    from coda_jax.layers import LlamaConfig
    from coda_jax.sharding import _leaf_name, batch_sharding, mesh_from_spec, shard_state

    _benchmark_tools_on_path()
    from benchmarks.plain_llama import TENSOR_SPLIT_DIM, PlainLlama, shard_plain_state
    from benchmarks.train_step_bench import activation_gathers

    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                           num_kv_heads=4, head_dim=16, dtype=jnp.float32)
    gdef, state = nnx.split(PlainLlama(cfg, rngs=nnx.Rngs(0)))
    b, s = 8, 32
    tokens = jax.random.randint(jax.random.key(1), (b, s + 1), 0, cfg.vocab_size)
    step = jax.jit(jax.value_and_grad(lambda st, t: nnx.merge(gdef, st).loss(t[:, :-1], t[:, 1:])))
    want = step(state, tokens)

    def compiled(placed, mesh):  # (loss and gradients, the compiled step's HLO), one compile
        with jax.set_mesh(mesh):
            t = jax.device_put(tokens, batch_sharding(mesh))
            c = step.lower(placed, t).compile()
            return c(placed, t), c.as_text()

    for spec in ("data=2,tensor=4", "fsdp=2,tensor=4", "data=2,fsdp=2,tensor=2"):
        mesh = mesh_from_spec(spec)
        placed = shard_plain_state(state, mesh)
        for path, x in jax.tree_util.tree_leaves_with_path(placed):
            name = _leaf_name(path)
            if name in TENSOR_SPLIT_DIM:
                assert x.sharding.spec[TENSOR_SPLIT_DIM[name]] == "tensor", (spec, name, x.sharding.spec)
        got, hlo = compiled(placed, mesh)
        assert abs(float(got[0]) - float(want[0])) < 1e-5 * abs(float(want[0])), (spec, got[0], want[0])
        _assert_matches(got[1], want[1], 1e-5, f"plain {spec}")
        gathers = activation_gathers(hlo, b, s)
        assert not gathers, f"plain {spec}: activations gathered: {gathers[:3]}"
    # The embedding split by vocabulary over "tensor" too: the partitioner gathers activations.
    mesh = mesh_from_spec("fsdp=2,tensor=4")
    _, hlo = compiled(shard_state(state, mesh, tensor_split_dims={**TENSOR_SPLIT_DIM, "embed": 0}), mesh)
    assert activation_gathers(hlo, b, s), "the vocab-split embedding gathered no activation: the check cannot fail"
    print("OK plain_tensor")


def case_vocab_parallel_ce(shape: tuple[int, int, int], mode: str, axis: str = "tensor") -> None:
    """The vocab-split cross-entropy (each shard of ``axis``: its LM-head GEMM on V/n vocab
    rows) equals one device's linear_cross_entropy in float32: loss and the gradients of x,
    gamma and W, with ignored rows and z-loss, on both backward paths (saved logits,
    recompute)."""
    from coda_jax.layers.vocab_parallel import vocab_parallel_cross_entropy
    from coda_jax.ops.linear_cross_entropy import linear_cross_entropy

    m, d, v = 64, 64, 512
    k = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(k[0], (m, d), jnp.float32)
    gamma = 1.0 + 0.1 * jax.random.normal(k[1], (d,), jnp.float32)
    w = jax.random.normal(k[2], (v, d), jnp.float32) / d ** 0.5
    targets = jax.random.randint(k[3], (m,), 0, v).at[::7].set(-100)
    want = jax.value_and_grad(lambda x, g, w: linear_cross_entropy(x, g, w, targets, eps=1e-5, z_loss=1e-3,
                                                                   backend="xla"), argnums=(0, 1, 2))(x, gamma, w)
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(axis_type,) * 3)
    n = dict(zip(("data", "fsdp", "tensor"), shape))[axis]
    f = jax.jit(jax.value_and_grad(lambda x, g, w, t: vocab_parallel_cross_entropy(
        x, g, w, t, eps=1e-5, z_loss=1e-3, backend="xla", vocab_axis=axis), argnums=(0, 1, 2)))
    for save in (True, False):
        jax.clear_caches()  # options are read at trace time: trace f again
        with cj.options(cross_entropy=cj.CrossEntropyOptions(save_logits=save)), jax.set_mesh(mesh):
            got = f(x, gamma, w, targets)
            jaxpr = str(jax.make_jaxpr(f)(x, gamma, w, targets))
        _assert_matches(got, want, 1e-5, f"vocab-parallel CE {shape} {mode} {axis} save={save}")
        # Each shard's GEMM sees its V/n vocab rows, and no shard the whole head.
        assert f"f32[{v // n},{d}]" in jaxpr, "no vocab-split LM-head weight inside the shard_map"
    with jax.set_mesh(mesh):
        try:
            f(x, gamma, w[:v - 1], targets)
        except ValueError as err:
            assert f"multiple of the '{axis}' axis size" in str(err), err
        else:
            raise AssertionError(f"a vocabulary the {axis} axis does not divide ran")
    print(f"OK vocab_ce_{'x'.join(map(str, shape))}_{mode}{'' if axis == 'tensor' else '_' + axis}")


def case_vocab_parallel_fp8_ce(shape: tuple[int, int, int], mode: str, axis: str, scaling: str) -> None:
    """The vocab-split FP8 head (``vocab_parallel_cross_entropy(fp8=...)``, no carry: the head
    quantizes ``h`` itself) equals one device's ``fp8_linear_cross_entropy`` in float32: loss,
    the gradients of x, gamma and W, and the histories' gradient (each amax the whole tensor's,
    the histories returned once), on both backward paths."""
    from coda_jax.fp8 import Fp8Recipe
    from coda_jax.layers.vocab_parallel import vocab_parallel_cross_entropy
    from coda_jax.ops.fp8_cross_entropy import fp8_linear_cross_entropy

    m, d, v = 64, 64, 512
    k = jax.random.split(jax.random.key(6), 4)
    x = jax.random.normal(k[0], (m, d), jnp.float32) * 2.0
    gamma = 1.0 + 0.1 * jax.random.normal(k[1], (d,), jnp.float32)
    w = jax.random.normal(k[2], (v, d), jnp.float32) * 3.0 / d ** 0.5
    targets = jax.random.randint(k[3], (m,), 0, v).at[::7].set(-100)
    recipe = Fp8Recipe(scaling=scaling)
    meta = jnp.asarray([[8.0, 6.0], [1.2, 1.0], [0.02, 0.01]], jnp.float32)
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(axis_type,) * 3)
    args = dict(eps=1e-5, z_loss=1e-3, backend="xla")
    with cj.options(xla=dict(accumulate="float32")):
        for save in (True, False):
            jax.clear_caches()
            with cj.options(cross_entropy=cj.CrossEntropyOptions(save_logits=save)):
                want = jax.jit(jax.value_and_grad(lambda x, g, w, mt: fp8_linear_cross_entropy(
                    x, g, w, targets, mt, recipe=recipe, **args), argnums=(0, 1, 2, 3)))(x, gamma, w, meta)
                with jax.set_mesh(mesh):
                    got = jax.jit(jax.value_and_grad(lambda x, g, w, mt: vocab_parallel_cross_entropy(
                        x, g, w, targets, vocab_axis=axis, fp8=(mt, recipe, None), **args),
                        argnums=(0, 1, 2, 3)))(x, gamma, w, meta)
            _assert_matches(got, want, 1e-5, f"vocab-parallel FP8 CE {shape} {mode} {axis} {scaling} save={save}")
            np.testing.assert_array_equal(np.asarray(got[1][3]), np.asarray(want[1][3]))  # the histories, exactly
    print(f"OK vocab_ce_fp8_{'x'.join(map(str, shape))}_{mode}_{axis}_{scaling}")


def case_cutedsl_lowers_under_mesh() -> None:
    """The CuTeDSL ops trace and lower for CUDA under a data-parallel mesh (no GPU needed)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    allow_backend("cutedsl")
    args = _op_inputs()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        f = jax.jit(jax.value_and_grad(_op_loss("cutedsl"), argnums=tuple(range(8))))
        txt = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "CuteDSL" in txt or "cutlass" in txt.lower(), "no CuTeDSL custom call in the lowered step"
    assert "shard_map" in txt or "sdy.manual_computation" in txt, "the kernels are not inside a shard_map"
    # The tensor-parallel block: its fused ops inside the block's shard_map, on the local heads.
    from flax import nnx

    from coda_jax.layers import CodaLlama, LlamaConfig

    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    gdef, state = nnx.split(CodaLlama(cfg, rngs=nnx.Rngs(0), backend="cutedsl"))
    tokens = jnp.zeros((4, 65), jnp.int32)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(lambda st, t: nnx.merge(gdef, st).loss(t[:, :-1], t[:, 1:])))
        txt = step.trace(state, tokens).lower(lowering_platforms=("cuda",)).as_text()
    assert "cutlass" in txt.lower() or "CuteDSL" in txt, "no CuTeDSL custom call in the tensor-parallel step"
    assert "reduce_scatter" in txt, "no reduce-scatter in the tensor-parallel step"
    # The FP8 step under data parallelism: its FP8 GEMMs on the CuTeDSL kernel (the backend's
    # default), inside the shard_map, with e4m3 operands.
    from coda_jax.fp8 import Fp8Meta, Fp8Recipe

    model = CodaLlama(cfg.replace(fp8=Fp8Recipe()), rngs=nnx.Rngs(0), backend="cutedsl")
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))
    tokens = jnp.zeros((8, 65), jnp.int32)
    with jax.set_mesh(jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))):
        step = nnx.jit(lambda m, t: nnx.value_and_grad(lambda mm: mm.loss(t[:, :-1], t[:, 1:]), argnums=wrt)(m))
        txt = step.trace(model, tokens).lower(lowering_platforms=("cuda",)).as_text()
    kernel_lines = [ln for ln in txt.splitlines() if "CuteDSL" in ln or "cutlass" in ln.lower()]
    assert any("f8E4M3FN" in ln for ln in kernel_lines), "no CuTeDSL call on e4m3 operands in the FP8 step"
    print("OK cutedsl_lowers_under_mesh")


def case_kernel_cache_under_mesh(mode: str) -> None:
    """The Pallas kernel cache (coda_jax/pallas/kernel_cache.py) under an 8-way data-parallel
    mesh: the ops' kernels, called per shard inside the partitioning's shard_map, lower for
    CUDA through the cache with the same custom calls as without it, and a second trace
    finds every kernel on disk (no GPU needed)."""
    import tempfile

    from coda_jax.pallas import kernel_cache as KC
    from coda_jax.pallas.interpret import interpret_mode

    allow_backend("pallas")
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _op_inputs()]
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    tok = NamedSharding(mesh, P("data"))
    args[0] = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype, sharding=NamedSharding(mesh, P("data", None)))
    args[8] = jax.ShapeDtypeStruct(args[8].shape, args[8].dtype, sharding=tok)
    args[9] = jax.ShapeDtypeStruct(args[9].shape, args[9].dtype, sharding=tok)

    def lower() -> str:
        jax.clear_caches()  # a fresh trace: the kernels are looked up again
        with interpret_mode(False), jax.set_mesh(mesh):
            f = jax.jit(jax.value_and_grad(_op_loss("pallas"), argnums=tuple(range(8))))
            return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    plain = lower()
    assert "latency_metadata" not in plain
    if mode == "auto":  # (once: the hints do not depend on the mesh's axis types)
        # latency_hints=True: every kernel call inside the shard_map carries its estimate
        from coda_jax.pallas.lowering import PallasLowering

        with B.use_lowering(PallasLowering(latency_hints=True)):
            hinted = [line for line in lower().splitlines() if "@mosaic_gpu_v2" in line]
        assert hinted and all("latency_metadata" in line for line in hinted), "a kernel call without its latency hint"
    with tempfile.TemporaryDirectory() as d:
        # Explicit mode: the missing kernels are generated by a worker process (the step's
        # kernels inside the shard_map wait for it at lowering).
        first_cache = KC.enable_kernel_cache(d, workers=1 if mode == "explicit" else 0)
        first = lower()
        first_cache.wait()
        assert (first_cache._pool is not None) == (mode == "explicit")
        cache = KC.enable_kernel_cache(d)
        second = lower()
        KC.disable_kernel_cache()
    n = first_cache.stats.misses
    assert n >= 4 and first_cache.stats.hits == 0 and first_cache.stats.worker_failures == 0, vars(first_cache.stats)
    assert cache.stats.hits == n and cache.stats.misses == 0, vars(cache.stats)
    calls = [t.count("@mosaic_gpu_v2") for t in (plain, first, second)]
    assert calls[0] > 0 and len(set(calls)) == 1, calls
    assert all("sdy.manual_computation" in t or "shard_map" in t for t in (plain, second))
    print(f"OK kernel_cache_under_mesh_{mode}")


def case_train_example_on_meshes() -> None:
    """examples/train_llama.py on an 8-device data-parallel mesh, checkpointed, resumed on an
    FSDP mesh, then on a data x fsdp x tensor mesh, then on an Explicit data x fsdp mesh:
    prints the history (the driver compares it with one device's)."""
    import json
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "examples"))
    import train_llama

    common = ["--batch", "8", "--seq", "32", "--layers", "1", "--vocab", "512", "--eval-every", "0",
              "--ckpt-every", "2", "--log-every", "2"]
    with tempfile.TemporaryDirectory() as d:
        train_llama.main(common + ["--steps", "4", "--mesh", "data=8", "--out", d])
        # 256 tokens a step: --fsdp-split auto splits the weights along their features.
        assert train_llama.main(common + ["--steps", "6", "--mesh", "fsdp=8", "--out", d])["fsdp_split"] == "features"
        s = train_llama.main(common + ["--steps", "8", "--mesh", "data=2,fsdp=2,tensor=2", "--out", d])
        assert s["fsdp_split"] == "width"  # a tensor axis keeps Megatron's placement
        # and restored onto a mesh of Explicit axes
        s = train_llama.main(common + ["--steps", "10", "--mesh", "data=2,fsdp=4", "--mesh-type", "explicit",
                                       "--out", d])
        hist = json.loads((Path(d) / "history.json").read_text())
    assert s["devices"] == 8
    print("HISTORY " + json.dumps(hist["loss"]))
    print("OK train_example_on_meshes")


def case_step_bench_on_meshes() -> None:
    """benchmarks/train_step_bench.py (the GPU suite's STEP_BENCH) on FSDP and tensor-parallel
    meshes: its ahead-of-time compiled step takes its own output as the next input, so the
    updated state must keep the input's placement (it did not: run failures on fsdp / tensor)."""
    import tempfile

    _benchmark_tools_on_path()
    from benchmarks import train_step_bench

    with tempfile.TemporaryDirectory() as d:
        for mesh, runs, kind in (("fsdp=8", ["xla"], "auto"), ("data=2,fsdp=2,tensor=2", ["plain", "xla"], "auto"),
                                 ("data=2,fsdp=4", ["plain", "xla"], "explicit")):
            rows = train_step_bench.main(["--preset", "tiny", "--layers", "1", "--batch", "8", "--seq", "32",
                                          "--runs", ",".join(runs), "--mesh", mesh, "--mesh-type", kind,
                                          "--steps", "2", "--rounds", "1", "--out", d])
            assert [r["run"] for r in rows] == runs, (mesh, rows)
            assert all(r["devices"] == 8 and r["tokens_per_s"] > 0 for r in rows), rows
    # The example's jitted step compiles once on such a mesh (it compiled again at step 2
    # while the updated state came back placed differently).
    import logging

    import jax
    import train_llama

    compiles = []

    class _Count(logging.Handler):
        def emit(self, record):
            if "Compiling jit(train_step)" in record.getMessage():
                compiles.append(record)

    handler = _Count()
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        with tempfile.TemporaryDirectory() as d:
            train_llama.main(["--batch", "8", "--seq", "32", "--layers", "1", "--vocab", "512", "--eval-every", "0",
                              "--ckpt-every", "0", "--log-every", "2", "--steps", "4", "--mesh", "fsdp=4,tensor=2",
                              "--out", d])
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(handler)
    assert len(compiles) == 1, f"the train step compiled {len(compiles)} times"
    print("OK step_bench_on_meshes")


CASES = {
    "train_mesh": case_train_example_on_meshes,
    "tp_step_embedding": case_tensor_step_embedding,
    "step_bench": case_step_bench_on_meshes,
    "cutedsl_lowers": case_cutedsl_lowers_under_mesh,
    **{f"model_{b}_{'x'.join(map(str, s))}_{m}": (lambda b=b, s=s, m=m: case_model(b, s, m))
       for b in ("xla", "pallas") for s in ((8,), (2, 4)) for m in ("auto", "explicit")},
    **{f"model_fp8_{b}_{'x'.join(map(str, s))}_{m}": (lambda b=b, s=s, m=m: case_model_fp8(b, s, m))
       for b, s, m in (("xla", (8,), "auto"), ("xla", (2, 4), "explicit"), ("pallas", (2, 4), "auto"),
                       ("xla", (2, 2, 2), "auto"), ("xla", (1, 2, 4), "explicit"), ("pallas", (2, 1, 4), "explicit"))},
    "model_pallas_2x4_explicit_replicated": lambda: case_model("pallas", (2, 4), "explicit", replicated_tokens=True),
    "model_fp8_pallas_8_explicit_replicated": lambda: case_model_fp8("pallas", (8,), "explicit",
                                                                     replicated_tokens=True),
    **{f"model_fp8_head_{b}_{'x'.join(map(str, s))}_{m}": (lambda b=b, s=s, m=m: case_model_fp8(b, s, m, True))
       for b, s, m in (("xla", (8,), "auto"), ("xla", (2, 4), "explicit"), ("xla", (2, 2, 2), "auto"))},
    **{f"model_fp8_zq8_{b}_{'x'.join(map(str, s))}_{m}": (lambda b=b, s=s, m=m: case_model_fp8(b, s, m,
                                                                                               swiglu_input="e4m3"))
       for b, s, m in (("xla", (2, 4), "explicit"), ("pallas", (2, 4), "auto"), ("xla", (2, 2, 2), "auto"))},
    **{f"tp_{b}_{'x'.join(map(str, s))}_{m}_{d}": (lambda b=b, s=s, m=m, d=d: case_model_tensor_parallel(b, s, m, d))
       for b, s, m, d in (("xla", (2, 2, 2), "auto", "float32"), ("pallas", (2, 2, 2), "explicit", "bfloat16"),
                          ("pallas", (1, 2, 4), "auto", "float32"), ("xla", (2, 1, 4), "explicit", "float32"))},
    "ops_dp_auto": lambda: case_ops_data_parallel("auto"),
    "fp8_wgrads_auto": lambda: case_fp8_wgrads_split_by_tokens("auto"),
    "fp8_wgrads_explicit": lambda: case_fp8_wgrads_split_by_tokens("explicit"),
    "fp8_fsdp_gathers_auto": lambda: case_fp8_fsdp_weight_gathers("auto"),
    "fp8_fsdp_gathers_explicit": lambda: case_fp8_fsdp_weight_gathers("explicit"),
    "ops_dp_explicit": lambda: case_ops_data_parallel("explicit"),
    "wgrad_partials": case_wgrad_partials,
    "fsdp_gathers_xla": lambda: case_fsdp_step_gathers("xla"),
    "fsdp_gathers_pallas": lambda: case_fsdp_step_gathers("pallas"),
    "fsdp_head_explicit": case_fsdp_head_explicit,
    "embedding_explicit": case_embedding_explicit,
    "plain_explicit": case_plain_explicit,
    "plain_tensor": case_plain_tensor,
    "fsdp_features_xla": lambda: case_fsdp_features_split("xla"),
    "fsdp_features_pallas": lambda: case_fsdp_features_split("pallas"),
    "kernel_cache_auto": lambda: case_kernel_cache_under_mesh("auto"),
    "kernel_cache_explicit": lambda: case_kernel_cache_under_mesh("explicit"),
    "vocab_ce_2x1x4_explicit": lambda: case_vocab_parallel_ce((2, 1, 4), "explicit"),
    "vocab_ce_2x2x2_auto": lambda: case_vocab_parallel_ce((2, 2, 2), "auto"),
    "vocab_ce_2x4x1_auto_fsdp": lambda: case_vocab_parallel_ce((2, 4, 1), "auto", "fsdp"),
    "vocab_ce_1x8x1_explicit_fsdp": lambda: case_vocab_parallel_ce((1, 8, 1), "explicit", "fsdp"),
    "vocab_ce_fp8_2x4x1_explicit_fsdp_delayed": lambda: case_vocab_parallel_fp8_ce((2, 4, 1), "explicit", "fsdp",
                                                                                    "delayed"),
    "vocab_ce_fp8_2x2x2_auto_tensor_current": lambda: case_vocab_parallel_fp8_ce((2, 2, 2), "auto", "tensor",
                                                                                  "current"),
}

if __name__ == "__main__":
    # --reset=PATH[,PATH]: those options back to the library's defaults (cj.reset_options)
    for arg in [a for a in sys.argv[1:] if a.startswith("--reset=")]:
        cj.reset_options(*arg.removeprefix("--reset=").split(","))
    for name in [a for a in sys.argv[1:] if not a.startswith("--")]:
        if name.startswith("mesh_fuzz_"):  # mesh_fuzz_<seed>
            case_mesh_fuzz(int(name.removeprefix("mesh_fuzz_")))
        else:
            CASES[name]()
