"""The shape fuzz at GPU scale (tests/shape_fuzz.py): seeded ragged shapes per op and for a
2-layer model, every backend (bf16) against float32 math, forward and gradients, with a
NaN / Inf scan of every output. Run it with ``GPU_TESTS=tests/test_gpu_shape_fuzz.py bash benchmarks/gpu_tests.sh``.

Environment: ``FUZZ_SEED`` (default 0), ``FUZZ_OPS`` (op draws, default 6: each op once),
``FUZZ_MODELS`` (model draws, default 1; each also trained one step in FP8 on the kernel
backends against the ``xla`` backend's FP8 step), ``FUZZ_BACKENDS`` (default xla,pallas and cutedsl
where the cutlass package imports).
"""

import importlib.util
import os

import pytest

import shape_fuzz as F

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("FUZZ_SEED", "0"))
OP_DRAWS = F.draw(SEED, int(os.environ.get("FUZZ_OPS", "6")), "gpu")
MODEL_DRAWS = F.draw(SEED, int(os.environ.get("FUZZ_MODELS", "1")), "gpu", ops=("model",))
_default = "xla,pallas" + (",cutedsl" if importlib.util.find_spec("cutlass") else "")
BACKENDS = [b for b in os.environ.get("FUZZ_BACKENDS", _default).split(",") if b]


def _id(s: F.Shape) -> str:
    if s.op == "model":
        return (f"model-{s.batch}x{s.seq}-d{s.d}-f{s.f}-h{s.heads}kv{s.kv_heads}x{s.head_dim}"
                f"{'-qkn' if s.qk_norm else ''}-v{s.vocab}")
    return f"{s.op}-m{s.m}-d{s.d}-n{s.n}-f{s.f}-h{s.heads}kv{s.kv_heads}x{s.head_dim}-v{s.vocab}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seq", [1000, 77])
def test_issue_20_model_on_gpu(backend, seq):
    # The issue's model: vocab 50257 (NaN on pallas at 1 x 1000) and 1 x 77 (cuDNN refused it).
    # Defined first so that a fuzz cut by its timeout has still run it.
    shape = F.Shape(op="model", m=seq, d=1536, n=1536, f=4096, heads=12, kv_heads=4, head_dim=128, qk_norm=False,
                    vocab=50257, batch=1, layers=2)
    F.run_model(shape, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", OP_DRAWS, ids=[_id(s) for s in OP_DRAWS])
def test_op_shape_fuzz_on_gpu(shape, backend):
    F.run_op(shape, backend, seed=SEED)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", MODEL_DRAWS, ids=[_id(s) for s in MODEL_DRAWS])
def test_model_shape_fuzz_on_gpu(shape, backend):
    errs = F.run_model(shape, backend, seed=SEED)
    print(f"{backend} {_id(shape)}: loss rel err {errs['loss']:.2e}, worst grad {max(errs.values()):.2e}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "xla"])
@pytest.mark.parametrize("shape", MODEL_DRAWS, ids=[_id(s) for s in MODEL_DRAWS])
def test_fp8_model_shape_fuzz_on_gpu(shape, backend):
    F.run_model_fp8(shape, backend, seed=SEED)
