"""Several GPUs (``device`` kind ``nvidia-h200-x2``): CodaLlama on real meshes, every backend.

Loss and every gradient of one bf16 training step on a data-parallel, an FSDP and a
tensor-parallel mesh over all local GPUs equal the same step on one GPU (the same model,
unsharded). The CPU suite checks the same rules on 8 fake devices with a stand-in kernel
(``tests/multi_device_cases.py``); this runs the real kernels, cuDNN attention and NCCL.
An FP8 CodaLlama's step (loss, gradients and the new amax histories) on a data-parallel and
an FSDP mesh equals one GPU's too. Skipped with fewer than 2 GPUs.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

BACKENDS = ["xla", "pallas"] + (["cutedsl"] if importlib.util.find_spec("cutlass") else [])
# one axis over all GPUs (Auto), FSDP and tensor parallelism under an Explicit mesh, data x
# fsdp, and fsdp x tensor (Auto and Explicit; these three need 4+ GPUs, tensor = 2): under FSDP
# the LM head and cross-entropy are split by vocabulary over "fsdp"
MESHES = ["data", "fsdp", "tensor", "fsdp-explicit", "tensor-explicit", "data+fsdp", "fsdp+tensor",
          "fsdp+tensor-explicit"]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _config(n: int, **kw):
    """The 2-layer bf16 CodaLlama these tests step, its heads and MLP features divisible by
    ``n`` GPUs; ``kw``: more config fields (``fp8=...``)."""
    from coda_jax.layers import LlamaConfig

    return LlamaConfig.tiny(vocab_size=32000, hidden_size=1024, intermediate_size=2816 // 64 // n * 64 * n,
                            num_layers=2, num_heads=8 * n, num_kv_heads=2 * n, head_dim=64, dtype=jnp.bfloat16, **kw)


def _check_step_on_mesh(backend: str, mesh, label: str, tokens_per_device: int) -> None:
    """One bf16 training step of a 2-layer CodaLlama on ``mesh`` (loss and every gradient)
    against the same step on one GPU; ``2 * n`` sequences hold ``tokens_per_device`` tokens
    a GPU."""
    from flax import nnx

    from coda_jax.layers import CodaLlama
    from coda_jax.sharding import batch_sharding, shard_state

    n = jax.device_count()
    cfg = _config(n)
    gdef, state = nnx.split(CodaLlama(cfg, rngs=nnx.Rngs(0), backend=backend))
    tokens = jax.random.randint(jax.random.key(1), (2 * n, tokens_per_device // 2 + 1), 0, cfg.vocab_size)
    step = jax.jit(jax.value_and_grad(lambda st, t: nnx.merge(gdef, st).loss(t[:, :-1], t[:, 1:])))
    want = jax.device_get(step(jax.device_put(state, jax.devices()[0]), jax.device_put(tokens, jax.devices()[0])))
    with jax.set_mesh(mesh):
        got = step(shard_state(state, mesh), jax.device_put(tokens, batch_sharding(mesh)))
    loss_err = abs(float(got[0]) - float(want[0])) / abs(float(want[0]))
    assert np.isfinite(float(got[0])) and loss_err < 1e-3, f"{backend} {label}: loss {got[0]} vs {want[0]}"
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
        e = _rel(a, b)
        assert np.isfinite(e) and e < 3e-2, f"{backend} {label}: {jax.tree_util.keystr(path)} rel err {e:.3g}"


def _mesh_over_all_gpus(axis: str):
    """The mesh named by ``axis`` (an entry of :data:`MESHES`) over every local GPU; skips the
    test with fewer than 2 GPUs, or a two-axis mesh without an even number of 4 or more."""
    from coda_jax.sharding import mesh_from_spec

    n = jax.device_count()
    if n < 2:
        pytest.skip("needs 2 or more GPUs")
    axes, _, mode = axis.partition("-")
    if "+" in axes:
        if n < 4 or n % 2:
            pytest.skip(f"{axes.replace('+', ' x ')} needs an even number of 4 or more GPUs")
        # data x fsdp: 2 x n/2; fsdp x tensor: n/2 x 2 (the block's heads split in two)
        first, second = axes.split("+")
        sizes = (2, n // 2) if axes == "data+fsdp" else (n // 2, 2)
        return mesh_from_spec(f"{first}={sizes[0]},{second}={sizes[1]}", explicit=mode == "explicit")
    return mesh_from_spec(f"{axes}={n}", explicit=mode == "explicit")


@pytest.mark.parametrize("axis", MESHES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_model_step_on_gpus_matches_one_gpu(backend, axis):
    mesh = _mesh_over_all_gpus(axis)
    _check_step_on_mesh(backend, mesh, f"{axis}={jax.device_count()}", tokens_per_device=1024)


# The routing rules at the library's defaults (the suite turns them off, tests/conftest.py):
# data parallel at 2048 tokens a GPU hands the GEMMs with [2048, 1024] outputs to XLA per
# device and keeps the wider ones on the kernel; FSDP at 256 tokens a GPU runs every GEMM as
# XLA ops left to the partitioner (coda_jax.partitioning.fsdp_xla_tokens_below), at 2048 on
# the xla backend's lowering split by tokens (fsdp_xla_gemms_below).
@pytest.mark.parametrize("axis,tokens_per_device", [("data", 2048), ("fsdp", 256), ("fsdp", 2048)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_model_step_with_default_routing_matches_one_gpu(backend, axis, tokens_per_device):
    import coda_jax as cj
    from suite_options import SUITE_ROUTING

    mesh = _mesh_over_all_gpus(axis)
    cj.reset_options(*SUITE_ROUTING)  # the library's routing defaults (the suite's fixture restores its own)
    _check_step_on_mesh(backend, mesh, f"{axis}={jax.device_count()}, default routing", tokens_per_device)


# The FSDP split along the weights' features (the option mesh.fsdp_split): the state
# placed along the MLP / attention / vocabulary features and every GEMM left to the
# partitioner (on four H100s the 1B step at 1024 tokens a GPU: 0.899x -> 1.052x plain JAX,
# benchmarks/RESULTS.md run 281). Auto meshes only: fsdp over all GPUs, and data x fsdp.
@pytest.mark.parametrize("axis", ["fsdp", "data+fsdp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_model_step_with_features_split_matches_one_gpu(backend, axis):
    from coda_jax.partitioning import fsdp_split_as

    mesh = _mesh_over_all_gpus(axis)
    with fsdp_split_as("features"):
        _check_step_on_mesh(backend, mesh, f"{axis}={jax.device_count()}, features split", tokens_per_device=1024)


def _check_fp8_step_on_mesh(backend: str, mesh, label: str, tokens_per_device: int) -> None:
    """One training step of an FP8 CodaLlama (``LlamaConfig(fp8=Fp8Recipe())``, bf16, the shape of
    :func:`_check_step_on_mesh`) on ``mesh`` against the same step on one
    GPU: the loss, every gradient and the new amax histories (the ``Fp8Meta`` "gradients"). As
    tests/multi_device_cases.py's case_model_fp8, the histories are first calibrated by one
    step on one GPU, so the compared step quantizes with the scales of a real step (not scale 1).
    Prints ``FP8MESH ...`` lines with the measured errors (pytest -s)."""
    from flax import nnx

    from coda_jax.fp8 import Fp8Meta, Fp8Recipe
    from coda_jax.layers import CodaLlama
    from coda_jax.ops.fp8_llama_block import TENSORS
    from coda_jax.sharding import batch_sharding, shard_state

    n = mesh.size
    cfg = _config(n, fp8=Fp8Recipe())
    one = jax.devices()[0]
    model = CodaLlama(cfg, rngs=nnx.Rngs(0), backend=backend)  # on the default device: ``one``
    tokens = jax.random.randint(jax.random.key(1), (2 * n, tokens_per_device // 2 + 1), 0, cfg.vocab_size)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))

    def grads(m, t):
        return nnx.value_and_grad(lambda mm: mm.loss(t[:, :-1], t[:, 1:]), argnums=wrt)(m)

    _, g = nnx.jit(grads)(model, jax.device_put(tokens, one))  # calibrate: the amaxes of a real step
    nnx.update(model, g.filter(Fp8Meta))
    gdef, state = nnx.split(model)
    step = jax.jit(lambda st, t: grads(nnx.merge(gdef, st), t))
    want = jax.device_get(step(jax.device_put(state, one), jax.device_put(tokens, one)))
    with jax.set_mesh(mesh):
        got = jax.device_get(step(shard_state(state, mesh), jax.device_put(tokens, batch_sharding(mesh))))

    loss_err = abs(float(got[0]) - float(want[0])) / abs(float(want[0]))
    grad_errs = {jax.tree_util.keystr(path): _rel(a, b) for (path, a), b in
                 zip(jax.tree_util.tree_leaves_with_path(got[1].filter(nnx.Param)),
                     jax.tree.leaves(want[1].filter(nnx.Param)))}
    worst = max(grad_errs, key=lambda k: np.nan_to_num(grad_errs[k], nan=np.inf))
    print(f"FP8MESH {backend} {label} loss_err={loss_err:.3g} max_grad_err={grad_errs[worst]:.3g} ({worst})")

    # The new histories: [this step's amax, the calibration's, 0, ...], one row per quantized
    # tensor of a block (coda_jax.ops.fp8_llama_block.TENSORS). Each amax is a max over the whole
    # tensor (every shard's max, reduced over the mesh), so a mesh records one GPU's amax of the
    # same values. A weight's values are the same on every mesh (the state is), and a max does not
    # depend on the order it is taken in: its amax must be exactly one GPU's, in every block. An
    # activation's values differ by bf16 rounding (GEMMs of other shapes, another summation
    # order) and, from the first block's FP8 outputs on, by the e4m3 roundings that moves (a
    # value crossing a rounding boundary moves by a whole 1/8 step): the max element moves by a
    # few bf16 steps (the xla backend on two H200s, data=2 and fsdp=2: the first block's SwiGLU
    # output amax off by 1.15 %, 2.3 bf16 steps; the second block's attention output by 1.3 %),
    # rel err < 3e-2. A gradient's amax comes from values that differ as much as the
    # gradients do (below): the gradients' bound (a small bf16 model on 2 CPU devices, fsdp=2,
    # xla backend: the first block's dz_qkv amax off by 3.3 %, its attn_norm gradient by 14 %).
    amax_errs = {"activation": (0.0, "all equal"), "gradient": (0.0, "all equal")}
    wrong = []
    metas = list(zip(jax.tree_util.tree_leaves_with_path(got[1].filter(Fp8Meta)),
                     jax.tree.leaves(want[1].filter(Fp8Meta))))
    assert len(metas) == cfg.num_layers, [jax.tree_util.keystr(p) for (p, _), _ in metas]
    for (path, a), b in metas:
        a, b = np.asarray(a), np.asarray(b)
        where = f"{backend} {label}: {jax.tree_util.keystr(path)}"
        assert a.shape == b.shape == (len(TENSORS), cfg.fp8.history), (where, a.shape, b.shape)
        np.testing.assert_array_equal(a[:, 1:], b[:, 1:], err_msg=f"{where}: the calibration's amaxes, shifted")
        amaxes = dict(zip(TENSORS, b[:, 0]))
        assert all(amaxes[k] > 0 for k in TENSORS if k.startswith(("w_", "d"))), f"{where}: one GPU's {amaxes}"
        for name, x, y in zip(TENSORS, a[:, 0], b[:, 0]):
            # y == 0: an amax another tensor's row records (a block's input is the previous
            # block's h_out) or a tensor left in bf16 (the last block's output for the bf16 head)
            if name.startswith("w_") or y == 0:
                if x != y:
                    wrong.append(f"{where}: {name}'s amax {x!r}, one GPU's {y!r} (must be equal)")
                continue
            kind = "gradient" if name.startswith("d") else "activation"
            e = abs(float(x) - float(y)) / float(y)
            if not e <= amax_errs[kind][0]:
                amax_errs[kind] = (e, f"{jax.tree_util.keystr(path)} {name}")
            if not (np.isfinite(e) and e < (3e-2 if kind == "activation" else 0.25)):
                wrong.append(f"{where}: {kind} {name}'s amax {x!r}, one GPU's {y!r} (rel err {e:.3g})")
    print(f"FP8MESH-AMAX {backend} {label} max_activation_amax_err={amax_errs['activation'][0]:.3g} "
          f"({amax_errs['activation'][1]}) max_gradient_amax_err={amax_errs['gradient'][0]:.3g} "
          f"({amax_errs['gradient'][1]})")
    assert not wrong, "\n".join(wrong)

    # The forward's values differ only by bf16 rounding and the e4m3 roundings that moves; the
    # loss averages them over every token.
    assert np.isfinite(float(got[0])) and loss_err < 1e-2, f"{backend} {label}: loss {got[0]} vs {want[0]}"
    # bf16 with FP8: a value that another summation order moves by a bf16 step crosses an e5m2
    # boundary (25 % steps) often enough that the first block's gradients differ by ~10 % (the
    # errors compound through the backward; tests/multi_device_cases.py's case_model_fp8): a
    # loose bound, as that case's. A missing or doubled shard's gradient is off by 50 % or more.
    for k, e in grad_errs.items():
        assert np.isfinite(e) and e < 0.25, f"{backend} {label}: {k} rel err {e:.3g}"


# FP8 (the xla backend's FP8 GEMMs through XLA, the Pallas backend's FP8 kernels): data parallel
# and FSDP over all GPUs. The CuTeDSL backend is left out.
@pytest.mark.parametrize("axis", ["data", "fsdp"])
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_fp8_model_step_on_gpus_matches_one_gpu(backend, axis):
    mesh = _mesh_over_all_gpus(axis)
    _check_fp8_step_on_mesh(backend, mesh, f"{axis}={jax.device_count()}", tokens_per_device=1024)
