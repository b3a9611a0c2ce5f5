"""GPU suite (Hopper): the Pallas kernel's FP8 path compiled for the GPU, against the reference
lowering: the checks of ``test_pallas_fp8.py`` (which runs the same cases in the interpreter)
on real wgmma, TMA and swizzles, at sizes that exercise the persistent grid.

FP8 operands under :func:`coda_jax.epilogue.dequantized` programs and quantizing outputs (the
FP8 tile, its transposed copy and amax partials) on the table's kernel configurations. Bounds
as ``test_pallas_fp8.py``'s: every FP8 element within one code of the reference's and >= 99.9 %
bit-equal; float32 outputs 1e-5, bf16 1e-2. Outputs are poisoned (NaN-filled buffers of the
output sizes are allocated and freed first), so an unwritten element fails the finiteness check.
"""

import dataclasses

import jax
import pytest

import coda_jax as cj
from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.epilogue import OutputKind
from coda_jax.pallas.lowering import PallasLowering
from coda_jax.pallas.tuning import CONFIG_TABLE, for_fp8_operands
from op_cases import poison_allocator
from test_pallas_fp8 import (_NO_GEMM_CANDIDATES, _WIDE_CANDIDATES, AMAX_PROBE, BF16, E4M3, E5M2, F32, PAIR_PROBE, TWO_PROBE, _compare,
                             _shipped_fp8_configs, check_ce_grad_pass, check_fp8_lm_head, check_input_norm_pass,
                             check_quantize_pass, check_rope_grad_pass, shipped_pass_configs,
                             shipped_rope_grad_configs)

pytestmark = pytest.mark.gpu

_DEFAULT = CONFIG_TABLE["default"]
CONFIGS = {
    "lowering_default": None,
    "cooperative": for_fp8_operands(_DEFAULT),
    "pingpong": for_fp8_operands(dataclasses.replace(_DEFAULT, schedule="pingpong", cluster_dimension=None)),
    "ring": for_fp8_operands(dataclasses.replace(_DEFAULT, delay_release=1)),
    "direct_stores": for_fp8_operands(dataclasses.replace(_DEFAULT, direct_loads=True, direct_stores=True)),
    # Staged chunks synchronized by hand (TuningConfig.manual_barriers).
    "manual": for_fp8_operands(dataclasses.replace(_DEFAULT, manual_barriers=True)),
    "pingpong_manual": for_fp8_operands(dataclasses.replace(_DEFAULT, schedule="pingpong", cluster_dimension=None,
                                                            manual_barriers=True)),
    # Transposed copies relaid from the FP8 values (TuningConfig.fp8_byte_transpose), alone and
    # with the barriers by hand.
    "cooperative_bytes": for_fp8_operands(dataclasses.replace(_DEFAULT, fp8_byte_transpose=True)),
    "pingpong_manual_bytes": for_fp8_operands(dataclasses.replace(_DEFAULT, schedule="pingpong", cluster_dimension=None,
                                                                  manual_barriers=True, fp8_byte_transpose=True)),
    # ... and the row reductions (amax, row sums) folded across chunks.
    "pingpong_lean": for_fp8_operands(dataclasses.replace(_DEFAULT, schedule="pingpong", cluster_dimension=None,
                                                          manual_barriers=True, fp8_byte_transpose=True,
                                                          fold_row_reductions=True)),
    # Swizzled staging, the transposed copy's included.
    "pingpong_swizzled": for_fp8_operands(dataclasses.replace(_DEFAULT, schedule="pingpong", cluster_dimension=None,
                                                              swizzle_epilogue=True)),
}


def _run(epi, m, n, k, **kw):
    poison_allocator([(m, n)] * (3 * len(epi.outputs)))
    _compare(epi, m, n, k, **kw)


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3xe4m3", "e5m2xe4m3"])
def test_fp8_operands_on_gpu(config, dtypes):
    # Ragged M and N, several K steps, more tiles than SMs.
    _run(E.dequantized(programs.ROW_SCALE), 2000, 3000, 1000, dtypes=dtypes, config=CONFIGS[config],
         out_dtypes={"z": BF16}, seed=21)


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_residual_rms_q8_on_gpu(config):
    # The block's O projection: residual + RMS row sums, h in e4m3 with copy and amax.
    _run(E.dequantized(programs.RESIDUAL_RMS_Q8), 2048, 2048, 1024, config=CONFIGS[config],
         out_dtypes={"x": BF16}, seed=22)


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_amax_probe_on_gpu(config):
    # Padding far from zero must reach neither the amax nor the copy.
    _run(AMAX_PROBE, 1000, 1500, 700, config=CONFIGS[config], seed=23)


@pytest.mark.parametrize("config", ["lowering_default", "cooperative"])
def test_pair_outputs_on_gpu(config):
    _run(PAIR_PROBE, 1000, 1536, 700, config=CONFIGS[config], seed=24)
    _run(TWO_PROBE, 1024, 1024, 512, config=CONFIGS[config], seed=25)


def test_swiglu_q8_programs_on_gpu():
    _run(E.dequantized(programs.rms_swiglu_q8(True)), 2048, 4096, 1024, out_dtypes={"z": BF16}, seed=26)
    _run(programs.SWIGLU_DGRAD_Q8, 2048, 2048, 1024, transpose_b=True, dtypes=(BF16, BF16), seed=27)
    # Fp8Recipe(swiglu_input="e4m3"): z written and read back in e4m3
    _run(E.dequantized(programs.rms_swiglu_q8(True, True)), 2048, 4096, 1024, seed=29)
    _run(E.dequantized(programs.SWIGLU_DGRAD_ZQ8), 2048, 2048, 1024, dtypes=(E5M2, E4M3), seed=30)
    _run(E.dequantized(programs.rms_dgrad_q8(True)), 2048, 2048, 1024, out_dtypes=None, seed=28)


@pytest.mark.parametrize("epi,layout,cfg,promote_k", _shipped_fp8_configs(),
                         ids=lambda x: getattr(x, "name", None) or (x if isinstance(x, str) else None))
def test_shipped_fp8_tuned_configs_on_gpu(epi, layout, cfg, promote_k):
    # Each FP8 configuration of the shipped tables, compiled, on its program (ragged M and N).
    # A promoted entry runs promoted (K = 2560: five groups of 512) against the default
    # configuration promoted alike, whose groups run the same MMAs in the same order: the same
    # accumulator bits, so the FP8 codes match. (XLA's reference at HIGHEST promotes every 128:
    # its codes differ after rms_dgrad's cancellation; test_promoted_accumulation_on_gpu checks
    # promotion against exact math.)
    out = {o.name: BF16 for o in epi.outputs if o.kind is OutputKind.TILE and o.quantize is None}
    ref = PallasLowering(for_fp8_operands(CONFIG_TABLE["default"]), plain_gemm="kernel") if promote_k else None
    _run(epi, 2000, 2944, 2560 if promote_k else 1024, config=cfg, out_dtypes=out, seed=31, promote_k=promote_k,
         reference=ref)


@pytest.mark.parametrize("config", [*CONFIGS, "single_warpgroup_sum"])
@pytest.mark.parametrize("seed", [41, 42])
def test_dgamma_beside_a_quantizing_dgrad_on_gpu(config, seed):
    # The FP8 norm backward with dgamma: on the warp-specialized kernels written as its summand
    # tile (col_sum_tiles), else (the default) summed in the single-warpgroup kernel; ragged M and N, two
    # seeds (the in-kernel sum in two consumers at once was intermittently wrong on the H100).
    if config == "single_warpgroup_sum":
        cfg = CONFIGS["cooperative"]
    else:  # the lowering's own configuration (None) keeps its default
        cfg = CONFIGS[config] and dataclasses.replace(CONFIGS[config], col_sum_tiles=True)
    _run(E.dequantized(programs.rms_dgrad_q8(True)), 2000, 1984, 1024, config=cfg, out_dtypes={"dx": BF16}, seed=seed)


@pytest.mark.parametrize("config", ["cooperative", "pingpong", "pingpong_lean"])
@pytest.mark.parametrize("seed", [41, 42, 43, 44])
def test_consumer_col_sums_on_gpu(config, seed):
    # The FP8 norm backward with dgamma summed in the kernel by both consumers, each with its
    # own scratch (TuningConfig.consumer_col_sums): ragged M and N, four seeds (the shared
    # scratch's race was intermittent), then the QKV dgrad's 1B shape (K = 3072) against the same
    # kernel with dgamma written as summand tiles (col_sum_tiles): the same MMAs in the same
    # order, so the same FP8 codes. (Against the reference at HIGHEST one code in 16 M after the
    # norm backward's cancellation was two codes off, seed 52, every configuration alike:
    # the FP8 MMA's accumulation, not the sum.)
    cfg = dataclasses.replace(CONFIGS[config], consumer_col_sums=True)
    epi = E.dequantized(programs.rms_dgrad_q8(True))
    _run(epi, 2000, 1984, 1024, config=cfg, out_dtypes={"dx": BF16}, seed=seed)
    tiles = PallasLowering(dataclasses.replace(cfg, consumer_col_sums=False, col_sum_tiles=True), plain_gemm="kernel")
    _run(epi, 8192, 2048, 3072, config=cfg, out_dtypes={"dx": BF16}, seed=seed + 10, reference=tiles)


_ROPE_GRAD = {**CONFIGS, **{f"shipped{i}": c for i, c in enumerate(shipped_rope_grad_configs())}}


@pytest.mark.parametrize("config", ["lowering_default", "cooperative", "pingpong", "pingpong_manual",
                                    "pingpong_manual_bytes", "pingpong_lean",
                                    *(c for c in _ROPE_GRAD if c.startswith("shipped"))])
def test_rope_grad_pass_on_gpu(config):
    # The FP8 block's QKV gradient pass at 1B shapes (32 Q, 8 K, 8 V heads of 64; ragged M).
    check_rope_grad_pass(_ROPE_GRAD[config], 8000, 32, 8, 32, 40,
                         before_kernel=lambda m, n: poison_allocator([(m, n)] * 3))


_QUANTIZE = {"lowering_default": None, "cooperative": CONFIGS["cooperative"], "pingpong": CONFIGS["pingpong"],
             "pingpong_manual": CONFIGS["pingpong_manual"], "pingpong_manual_bytes": CONFIGS["pingpong_manual_bytes"],
             "pingpong_lean": CONFIGS["pingpong_lean"],
             **{f"shipped_{fp8}{i}": c for fp8 in ("e4m3", "e5m2")
                for i, c in enumerate(shipped_pass_configs(f"quantize_{fp8}"))}}


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("config", _QUANTIZE, ids=list(_QUANTIZE))
def test_quantize_pass_on_gpu(config, fp8):
    # The attention output's pass at 1B shapes (ragged M), and the last block's gradient's.
    check_quantize_pass(_QUANTIZE[config], fp8, 8000, 2048, 42, before_kernel=lambda m, n: poison_allocator([(m, n)] * 3))


_INPUT_NORM = {"lowering_default": None, "cooperative": CONFIGS["cooperative"], "pingpong": CONFIGS["pingpong"],
               **{f"shipped{i}": c for i, c in enumerate(shipped_pass_configs("rms_input_q8"))}}


@pytest.mark.parametrize("config", _INPUT_NORM, ids=list(_INPUT_NORM))
def test_input_norm_pass_on_gpu(config):
    # The first FP8 block's norm input at 1B shapes (ragged M): h = x * gamma in e4m3, sum(x^2).
    check_input_norm_pass(_INPUT_NORM[config], 8000, 2048, 43,
                          before_kernel=lambda m, n: poison_allocator([(m, n)] * 3))


def test_fp8_model_step_on_gpu():
    # One FP8 step of a 2-layer model, every FP8 GEMM and pass on the Pallas kernels (the tuned
    # table's or the heuristics' configurations), against the xla backend on the GPU: the
    # blocks' output gradients written by the QKV dgrads' epilogues and handed back through
    # the carry, the quantizing passes; test_fp8.fp8_model_step_against_xla's bounds.
    from coda_jax.fp8 import Fp8Recipe
    from coda_jax.layers import LlamaConfig
    from test_fp8 import fp8_model_step_against_xla

    cfg = LlamaConfig.tiny(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                           num_kv_heads=2, head_dim=64, dtype=BF16, fp8=Fp8Recipe(promote_min_k=1024))
    tokens = jax.random.randint(jax.random.key(3), (4, 513), 0, cfg.vocab_size)
    with cj.options(routing=dict(xla_output_below=0)):  # every GEMM on the kernel
        fp8_model_step_against_xla("pallas", cfg, tokens)


@pytest.mark.parametrize("save", [True, False], ids=["saved_logits", "recompute"])
def test_fp8_lm_head_on_gpu(save, monkeypatch):
    # The FP8 LM head at a real vocabulary (ragged V: not a tile multiple; two vocab chunks when
    # recomputed), every GEMM on the kernel, against the xla backend on the GPU.
    poison_allocator([(2048, 32000)] * 4)
    check_fp8_lm_head(2048, 2048, 32000, save, monkeypatch)


_CE_GRAD = {"lowering_default": None, "cooperative": CONFIGS["cooperative"], "pingpong": CONFIGS["pingpong"],
            **{f"shipped{i}": c for i, c in enumerate(shipped_pass_configs("ce_grad_q8"))}}


@pytest.mark.parametrize("config", _CE_GRAD, ids=list(_CE_GRAD))
def test_ce_grad_pass_on_gpu(config):
    # The FP8 LM head's gradient pass over float32 logits, ragged M and V, more tiles than SMs.
    check_ce_grad_pass(_CE_GRAD[config], 4000, 32000, 41, before_kernel=lambda m, n: poison_allocator([(m, n)] * 3))


_PROMOTING = {"lowering_default": None, "cooperative": CONFIGS["cooperative"], "pingpong": CONFIGS["pingpong"],
              "single": for_fp8_operands(CONFIG_TABLE["small"]),
              # the autotuner's K steps of 256 for promoting GEMMs (autotune.PROMOTED_CANDIDATES)
              "cooperative_k256": dataclasses.replace(CONFIGS["cooperative"], tile_k=256),
              "pingpong_k256": dataclasses.replace(CONFIGS["pingpong"], tile_k=256)}


@pytest.mark.parametrize("config", _PROMOTING, ids=list(_PROMOTING))
def test_promoted_accumulation_on_gpu(config):
    """Promotion against the tensor core's own FP8 accumulation, on all-positive e4m3 inputs
    (every product adds: the worst case for an accumulator that drops its addends' low bits)
    with K = 32768, against the exact (float64) product: the unpromoted kernel loses percents
    (37 %, run 335), the promoted one (every 512) must be ten times closer and within 1e-2
    (6.1e-3 in run 335, docs/fp8.md#accumulation). (A fused program under promotion is checked in
    the interpreter, ``test_pallas_fp8.py``: on the GPU the reference, cuBLASLt at HIGHEST,
    promotes every 128 and differs from the kernel by more FP8 codes than its bounds allow.)"""
    import jax
    import jax.numpy as jnp

    from benchmarks.fp8_accumulation import errors, exact_product, fp8_inputs
    from coda_jax.fp8 import Fp8Tensor
    from coda_jax.ops.fp8_gemm import fp8_gemm
    from coda_jax.pallas.lowering import PallasLowering

    a8, b8 = fp8_inputs(256, 384, 32768, "positive", seed=5)
    ref = exact_product(a8, b8)
    low = PallasLowering(_PROMOTING[config], plain_gemm="kernel")
    one = jnp.ones((), jnp.float32)

    def product(pk):
        return jax.jit(lambda a, b: fp8_gemm(low, programs.IDENTITY, Fp8Tensor(a, None, one), Fp8Tensor(None, b, one),
                                             {}, out_dtypes={"out": jnp.float32}, promote_k=pk)["out"])(a8, b8)

    plain, promoted = errors(product(0), ref)["rel"], errors(product(512), ref)["rel"]
    assert promoted < 1e-2 and promoted < plain / 10, (plain, promoted)


# The autotuner's candidates for epilogue passes: without the zero GEMM
# (TuningConfig.skip_pass_gemm), on 64 x 128 ping-pong tiles, and the wide ones (one output
# slot past the register budget), which won the 8B-width weights' passes in a tuning run whose
# step then trained wrongly (benchmarks/HISTORY.md, run 379).
_PASS_CANDIDATES = (*_NO_GEMM_CANDIDATES, "pingpong_minor_m_lean_m64", "pingpong_lean_m64",
                    "pingpong_minor_m_bytes_m64", *_WIDE_CANDIDATES)


@pytest.mark.parametrize("name", _PASS_CANDIDATES)
def test_pass_candidates_on_gpu(name):
    # The quantizing pass (ragged M), the QKV gradient's and the first block's norm input on the
    # autotuner's pass candidates, each against the reference with poisoned outputs.
    from coda_jax.pallas.autotune import known_candidates

    cfg = known_candidates()[name]
    poison = lambda m, n: poison_allocator([(m, n)] * 3)  # noqa: E731
    check_quantize_pass(cfg, "e4m3", 8000, 2048, 44, before_kernel=poison)
    check_quantize_pass(cfg, "e4m3", 4096, 6144, 47, before_kernel=poison, dtype=F32)  # a weight's pass
    check_rope_grad_pass(cfg, 8000, 32, 8, 32, 45, before_kernel=poison)
    check_input_norm_pass(cfg, 8000, 2048, 46, before_kernel=poison)


@pytest.mark.parametrize("name", ["pingpong_minor_m_bytes_m64", "pingpong_minor_m_lean_m64", "pingpong_lean_m64",
                                  *_WIDE_CANDIDATES])
def test_swiglu_programs_on_pingpong_candidates_on_gpu(name):
    # The autotuner's candidates for the spilling FP8 SwiGLU GEMMs on both: 64 x 128 ping-pong
    # tiles (half the accumulator registers) and 32-column pair chunks past the register
    # budget with one output slot. Ragged M.
    from coda_jax.pallas.autotune import known_candidates

    cfg = for_fp8_operands(known_candidates()[name])
    _run(E.dequantized(programs.SWIGLU_DGRAD_Q8), 2000, 2048, 1024, dtypes=(E5M2, E4M3), config=cfg, seed=47)
    _run(E.dequantized(programs.rms_swiglu_q8(True)), 2000, 4096, 1024, config=cfg, out_dtypes={"z": BF16}, seed=48)


@pytest.mark.parametrize("promote_k", [0, 512])
def test_plain_fp8_gemm_routed_to_xla_is_one_cublaslt_call(promote_k):
    """``routing.plain_gemm="xla"`` (the default) on an FP8 plain GEMM: the compiled program is
    one cuBLASLt FP8 GEMM that applies the scale itself (no fusion writes the ``[M, N]``
    output), within bf16 rounding of the exact scaled product."""
    import re

    import jax.numpy as jnp

    from test_pallas_fp8 import _operands
    from op_cases import rel_err

    m, n, k = 1024, 2048, 8192
    a, b = _operands(m, n, k, False, True, (E4M3, E5M2), seed=9)
    scale = jnp.float32(0.37)
    f = jax.jit(lambda a, b, s: PallasLowering().gemm(E.dequantized(programs.IDENTITY), a, b, {"acc_scale": s},
                                                      transpose_b=True, out_dtypes={"out": BF16},
                                                      promote_k=promote_k)["out"])
    hlo = f.lower(a, b, scale).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    assert targets == ["__cublas$lt$matmul$f8"], targets
    wide = [ln for ln in hlo.splitlines() if " fusion(" in ln and f"[{m},{n}]" in ln.split("=")[1].split("fusion(")[0]]
    assert not wide, wide  # no pass over the output: the scale is cuBLASLt's alpha
    exact = jnp.dot(a.astype(F32), b.astype(F32).T, precision="highest") * scale
    assert rel_err(f(a, b, scale), exact) < 1e-2
