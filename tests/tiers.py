"""The CPU suite's two tiers: which tests the default run leaves to the full one.

The default tier (``bash scripts/run.sh test``, the README's command, and CI) runs every
kernel, op, layer, backend and mesh kind at least once, within the project's ~25 minutes on two cores. The
full tier (``bash scripts/run.sh test --full``, or ``CODA_JAX_TESTS=full``) adds what repeats
that coverage in another combination: the rest of each sweep's cross product (every program
on every schedule, every shipped tuned configuration), the same model on more meshes, more
processes and more recipes, the seeded fuzzers, and the tests of the benchmark tools. Run it
before landing a change to a kernel, the partitioner or a tool; ``--full -m slow`` runs only
what the default tier leaves out (conftest.py marks those tests ``slow``).

A test is named by its node id under ``tests/`` (``file.py::test`` for every parameter, or
``file.py::test[id]`` for one). The GPU tests (marker ``gpu``) are not tiered.
"""

from __future__ import annotations

from collections.abc import Iterable

# Whole tests, or single parameters, that only the full tier runs, with what the default tier
# keeps of the same coverage.
FULL_ONLY: dict[str, str] = {
    # Meshes: the default tier keeps one group of each kind (ops, FSDP gathers, bf16 and FP8
    # models, FP8 wgrads, tensor and vocab parallel), under Explicit meshes where both run.
    "test_partitioning.py::test_on_eight_devices[step_bench]": "the benchmark tool on meshes",
    "test_partitioning.py::test_on_eight_devices[model_auto]": "model_explicit runs the same models",
    "test_partitioning.py::test_on_eight_devices[model_fp8_zq8]": "model_fp8 runs the default recipe",
    "test_partitioning.py::test_on_eight_devices[model_fp8_tensor]": "tensor_parallel splits the block",
    "test_partitioning.py::test_on_eight_devices[model_fp8_head]": "vocab_parallel splits the head",
    "test_partitioning.py::test_on_eight_devices[kernel_cache]": "test_kernel_cache.py on one device",
    "test_partitioning.py::test_on_eight_devices[fp8_wgrads_auto]": "fp8_wgrads under Explicit meshes",
    "test_partitioning.py::test_on_eight_devices[ops_auto]": "ops under Explicit meshes",
    "test_partitioning.py::test_on_eight_devices[tensor_parallel_auto]": "tensor_parallel under Explicit meshes",
    "test_partitioning.py::test_on_eight_devices[fsdp_gathers_more]": "vocab_parallel's FSDP head, models' embedding",
    "test_partitioning.py::test_on_eight_devices[fsdp_features]": "fsdp_gathers on XLA and Pallas",
    "test_partitioning.py::test_train_example_on_meshes_matches_one_device": "the example on one device",
    "test_partitioning.py::test_mesh_fuzz": "a fuzzer over the mesh groups' meshes",
    # Two processes: the default tier keeps one training run and the library's calls.
    "test_multi_process.py::test_two_processes_train_as_one_process[data=2,fsdp=2]": "[data=4]",
    "test_multi_process.py::test_the_two_processes_see_the_batches_of_one_device": "[data=4]'s loss",
    "test_multi_process.py::test_a_checkpoint_of_two_processes_resumes_in_one_on_another_mesh":
        "test_train_example.py resumes on one process",
    "test_multi_process.py::test_sample_reads_a_checkpoint_of_two_processes": "the same on one process",
    # The seeded fuzzers: the fixed-shape tests cover each op, kernel and model.
    "test_shape_fuzz.py::test_op_draws_on_a_warp_specialized_tile": "test_pallas_kernels.py's ragged shapes",
    "test_shape_fuzz.py::test_op_draws_on_xla": "test_ops_reference.py's random shapes",
    "test_shape_fuzz.py::test_model_draw_on_pallas": "test_ops_pallas.py's block and model",
    "test_shape_fuzz.py::test_fp8_model_draw_on_pallas": "test_fp8.py's FP8 model step",
    "test_pallas_kernels.py::test_one_out_slot_ragged_on_every_schedule": "test_one_out_slot, ragged shapes elsewhere",
    "test_train_example.py::test_finetune_continues_from_a_run_and_reports_perplexity":
        "test_short_training_run_learns_and_resumes",
    "test_compile_time.py::test_compile_time_second_process_hits_the_persistent_cache": "test_kernel_cache.py",
    "test_kernel_cache.py::test_a_cached_kernel_is_the_generated_kernel_byte_for_byte_in_a_new_process[in_a_worker]":
        "[here]",
    # The benchmarks' plain JAX baselines: the default tier keeps their FP8 dot and one step.
    "test_plain_llama.py::test_plain_llama_block_remat_gives_the_same_gradients": "a baseline",
    "test_plain_fp8_llama.py::test_plain_fp8_lm_head_is_one_more_fp8_dot": "a baseline",
    "test_plain_fp8_llama.py::test_train_step_bench_runs_plain_fp8": "a baseline",
    "test_plain_fp8_llama.py::test_a_few_fp8_train_steps_decrease_the_loss": "a baseline",
    "test_plain_fp8_llama.py::test_one_train_step_writes_each_tensors_amax_into_its_history[False]": "[True]",
    # The benchmark tools (the library's users do not run them; the GPU runs do).
    "test_bench_tools.py::test_train_step_bench_runs_plain_and_coda_under_each_runs_options": "a tool",
    "test_bench_tools.py::test_fp8_accuracy_over_seeds_and_recipes": "a tool",
    "test_adamw_copies.py::test_optimizer_copies_probe_checks_and_times_each_variant": "a tool",
    "test_bench_tools.py::test_fp8_accuracy_counts_saturated_tensors": "a tool",
    "test_bench_tools.py::test_fp8_block_gemms_time_each_fp8_call_against_the_bare_gemm": "a tool",
    "test_bench_tools.py::test_gpu_bench_script_runs_step_op_bench_and_summary_and_packs_its_files": "a tool",
    "test_bench_tools.py::test_grad_error_probe_measures_the_bf16_rounding_of_a_training_step": "a tool",
    "test_bench_tools.py::test_model_profile_on_a_mesh_runs_on_cpu_devices": "a tool",
    "test_fp8.py::test_fp8_first_step_tool_reports_scale_one_against_calibrated": "a tool",
    # FP8 models: the default tier keeps the e4m3-z recipe's step (the same kernels and more).
    "test_fp8.py::test_fp8_model_step_on_pallas_matches_xla[compute]": "[e4m3]",
    "test_kernel_cache.py::test_a_training_step_lowers_through_the_cache[vmap_remat_here]": "the other case",
    # The RoPE op on the kernel: one case each of QK-norm and of the split Q, K, V outputs.
    "test_ops_pallas.py::test_rope[True]": "test_rope_split_qkv[True] (QK-norm), test_rope[False]",
    "test_ops_pallas.py::test_rope_split_qkv[False]": "test_rope_split_qkv[True], test_rope[False]",
    # CUDA compiles of whole candidate sets and register-spill checks (perf guards; the GPU
    # runs compile the same kernels).
    "test_autotune.py::test_extended_candidates_lower_for_cuda": "the base candidates in test_autotune.py",
    "test_cutedsl_lowering.py::test_kernels_do_not_spill": "a perf guard",
    "test_cutedsl_fp8.py::test_quantizing_kernels_do_not_spill": "a perf guard",
}

# Parametrized sweeps the default tier thins, by the parameter ids it keeps:
# - a tuple of positions in the id (split at "-"): the first parameter, in collection order,
#   that brings a value at one of those positions not yet kept (every program and every
#   schedule runs, not every pair);
# - a frozenset of ids: those (a kernel variant's test on its heaviest epilogue and a light one,
#   and the passes' production schedules: no GEMM, the shipped tuned configurations). The
#   programs themselves run on every schedule in test_program_warp_specialized and
#   test_program_matches_reference.
SWEEPS: dict[str, tuple[int, ...] | frozenset[str]] = {
    "test_pallas_lowering.py::test_kernel_lowers_for_cuda": (0, 1),
    "test_cutedsl_lowering.py::test_program_lowers": (0, 1, 2),
    "test_cutedsl_lowering.py::test_pingpong_schedule_lowers": (0, 1),
    "test_cutedsl_fp8.py::test_quantizing_programs_lower": (0, 1, 2),
    "test_cutedsl_fp8.py::test_dequantized_programs_lower": (0, 1),
    "test_cutedsl_fp8.py::test_quantizing_probes_lower": (0, 1),
    "test_pallas_kernels.py::test_shipped_tuned_configs": (0,),
    "test_pallas_fp8.py::test_shipped_fp8_tuned_configs": (0,),
    "test_pallas_fp8.py::test_unquantized_programs": (0, 1),
    "test_pallas_kernels.py::test_direct_tiles": (1, 2),
    "test_pallas_kernels.py::test_tiles_per_cta_grid": (0,),
    "test_pallas_kernels.py::test_prefetch_next_tile": frozenset({"swiglu_dgrad-pingpong"}),  # no ring ships it
    "test_pallas_kernels.py::test_manual_barriers": frozenset({"identity", "swiglu_dgrad"}),
    "test_pallas_kernels.py::test_folded_row_reductions": frozenset({"rms_lse", "swiglu_dgrad"}),
    "test_pallas_kernels.py::test_one_out_slot": frozenset({"identity", "swiglu_dgrad", "col_sum_probe"}),
    "test_pallas_kernels.py::test_load_ring_with_in_place_outputs": frozenset({"swiglu_dgrad--3"}),
    "test_pallas_kernels.py::test_pingpong_schedule": frozenset({"rms_swiglu_train-", "rms_rope-1", "rms_dgrad_res-"}),
    "test_pallas_kernels.py::test_program_warp_specialized_split_n":
        frozenset({"rms_swiglu_train-", "rms_dgrad_res-", "swiglu_dgrad-"}),
    "test_pallas_kernels.py::test_column_sums_as_summand_tiles": frozenset({"cooperative", "pingpong"}),
    "test_pallas_kernels.py::test_pingpong_turns": frozenset({"2"}),
    "test_pallas_kernels.py::test_cooperative_stage_ring_variants": frozenset({"split_m", "cluster_n_3_stages"}),
    "test_pallas_fp8.py::test_promoted_accumulation":
        frozenset({"128-cooperative", "128-pingpong_k256", "512-pingpong"}),
    "test_pallas_fp8.py::test_swiglu_fp8_programs_on_pingpong_candidates":
        frozenset({"pingpong_lean_wide_s3"}),  # shipped; the m64 consumer tiles ship for passes only
    "test_pallas_fp8.py::test_dgamma_beside_a_quantizing_dgrad": frozenset({"cooperative", "pingpong"}),
    "test_pallas_fp8.py::test_fp8_byte_transpose_lowers_for_cuda": frozenset({"pingpong", "cooperative"}),
    "test_pallas_fp8.py::test_rope_grad_pass": frozenset({"single", "pingpong_no_gemm", "shipped0", "shipped1"}),
    "test_pallas_fp8.py::test_quantize_pass":
        frozenset({"e4m3_single", "e5m2_pingpong_no_gemm", "e4m3_shipped0", "e5m2_shipped0"}),
    "test_pallas_fp8.py::test_amax_and_copy_mask_padding":
        frozenset({"single", "pingpong", "one_out_slot", "folded_rows"}),
    "test_pallas_fp8.py::test_ce_grad_pass": frozenset({"pingpong_no_gemm", "shipped0", "shipped1"}),
    "test_pallas_fp8.py::test_input_norm_pass": frozenset({"pingpong_no_gemm", "shipped0"}),
}


def _base(nodeid: str) -> tuple[str, str | None]:
    """``file.py::test[id]`` -> (``file.py::test``, ``id``)."""
    if nodeid.endswith("]") and "[" in nodeid:
        base, pid = nodeid[:-1].split("[", 1)
        return base, pid
    return nodeid, None


def _full_only(nodeid: str) -> bool:
    base, _ = _base(nodeid)
    return any(k in (nodeid, base) or nodeid.startswith(k + "::") for k in FULL_ONLY)


def default_tier(nodeids: Iterable[str]) -> set[str]:
    """The node ids (relative to ``tests/``, in collection order) the default tier runs."""
    keep: set[str] = set()
    seen: dict[str, set[tuple[int, str]]] = {}
    for nodeid in nodeids:
        if _full_only(nodeid):
            continue
        base, pid = _base(nodeid)
        rule = SWEEPS.get(base)
        if rule is None or pid is None:
            keep.add(nodeid)
        elif isinstance(rule, frozenset):
            if pid in rule:
                keep.add(nodeid)
        else:
            parts = pid.split("-")
            values = {(p, parts[p]) for p in rule if p < len(parts)}
            if not values <= seen.setdefault(base, set()):
                seen[base] |= values
                keep.add(nodeid)
    return keep


def check_tables(nodeids: Iterable[str]) -> list[str]:
    """The entries of :data:`FULL_ONLY` and :data:`SWEEPS` that name no collected test (a renamed
    test would otherwise quietly move back to the default tier, or out of it)."""
    ids = list(nodeids)
    pids = {_base(n) for n in ids}
    bases = {base for base, _ in pids}
    stale = [k for k in FULL_ONLY if not any(n.startswith(k) for n in ids)]
    stale += [k for k in SWEEPS if k not in bases]
    stale += [f"{k}[{p}]" for k, rule in SWEEPS.items() if isinstance(rule, frozenset)
              for p in sorted(rule) if (k, p) not in pids]
    return stale
