"""Several GPUs (``device`` kind ``nvidia-h200-x2``): CodaLlama on real meshes, every backend.

Loss and every gradient of one bf16 training step on a data-parallel, an FSDP and a
tensor-parallel mesh over all local GPUs equal the same step on one GPU (the same model,
unsharded). The CPU suite checks the same rules on 8 fake devices with a stand-in kernel
(``tests/multi_device_cases.py``); this runs the real kernels, cuDNN attention and NCCL.
Skipped with fewer than 2 GPUs.
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


def _check_step_on_mesh(backend: str, mesh, label: str, tokens_per_device: int) -> None:
    """One bf16 training step of a 2-layer CodaLlama on ``mesh`` (loss and every gradient)
    against the same step on one GPU; ``2 * n`` sequences hold ``tokens_per_device`` tokens
    a GPU."""
    from flax import nnx

    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.sharding import batch_sharding, shard_state

    n = jax.device_count()
    cfg = LlamaConfig.tiny(vocab_size=32000, hidden_size=1024, intermediate_size=2816 // 64 // n * 64 * n,
                           num_layers=2, num_heads=8 * n, num_kv_heads=2 * n, head_dim=64, dtype=jnp.bfloat16)
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
