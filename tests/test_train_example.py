"""A short run of examples/train_llama.py: the loss falls, files are written, resume works."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tokenizers")

import train_llama  # noqa: E402


def test_short_training_run_learns_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--batch", "8", "--seq", "64", "--layers", "2", "--vocab", "1024", "--lr", "3e-3", "--warmup", "5",
              "--eval-every", "20", "--ckpt-every", "20", "--out", str(out)]
    s1 = train_llama.main(common + ["--steps", "80"])
    printed = capsys.readouterr().out
    written = json.loads((out / "summary.json").read_text())
    assert s1["last_loss"] < s1["first_loss"] - 1.3, s1
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "checkpoints").is_dir()
    # Resume: continues from step 80, keeps the history, and the loss goes on from where it was.
    s2 = train_llama.main(common + ["--steps", "90"])
    hist = json.loads((out / "history.json").read_text())
    assert hist["step"] == list(range(90))
    assert s2["last_loss"] < s1["first_loss"] - 1.3
    # The summary leads with one steady-state rate (the timed steps after the compiling one);
    # the loop's wall rate with its evaluation and checkpoint pauses is named for what it
    # holds, and is lower.
    assert list(written)[0] == "tokens_per_s" and written["tokens_per_s"] == s1["tokens_per_s"] > 0
    assert s1["timed_steps"] == 79
    assert 0 < s1["wall_tokens_per_s_with_eval_and_checkpoints"] < s1["tokens_per_s"]
    assert "mfu" not in s1  # only on a GPU
    assert f"steady state: {s1['tokens_per_s']:,.0f} tokens/s over 79 timed steps" in printed


def test_learning_rate_schedule_defaults_by_preset():
    """The tiny preset's schedule (no loss spike in the default run), the others' as before;
    a flag wins over the preset."""
    tiny, big = train_llama.parse_args([]), train_llama.parse_args(["--preset", "1b"])
    assert (tiny.lr, tiny.warmup) == train_llama.PRESET_SCHEDULES["tiny"] == (2e-3, 40)
    assert (big.lr, big.warmup) == train_llama.DEFAULT_SCHEDULE == (3e-3, 20)
    mine = train_llama.parse_args(["--lr", "1e-4", "--warmup", "7"])
    assert (mine.lr, mine.warmup) == (1e-4, 7)
    # --init-from: the starting run's preset decides, once main() has read it (a Hugging Face
    # model is no preset: the default schedule).
    later = train_llama.parse_args(["--init-from", "elsewhere", "--warmup", "7"])
    assert (later.lr, later.warmup) == (None, 7)
    train_llama.fill_schedule(later, None)
    assert (later.lr, later.warmup) == (3e-3, 7)


def test_eval_every_zero_evaluates_after_the_last_step_only(tmp_path):
    out = tmp_path / "run"
    train_llama.main(["--batch", "2", "--seq", "32", "--layers", "1", "--vocab", "512", "--steps", "3",
                      "--eval-every", "0", "--ckpt-every", "0", "--no-resume", "--out", str(out)])
    assert json.loads((out / "history.json").read_text())["val_step"] == [3]


@pytest.mark.parametrize("flag", ["--eval-every", "--ckpt-every"])
def test_negative_periods_are_rejected(flag, capsys):
    with pytest.raises(SystemExit):
        train_llama.parse_args([flag, "-1"])
    assert f"{flag} must be >= 0" in capsys.readouterr().err


def test_log_every_only_changes_when_the_host_waits(tmp_path):
    """Losses stay on the device between synchronizations: every step's loss still reaches the
    history, the same as with a synchronization after every step."""
    common = ["--batch", "2", "--seq", "32", "--layers", "1", "--vocab", "512", "--steps", "9",
              "--eval-every", "0", "--ckpt-every", "0", "--no-resume"]
    train_llama.main(common + ["--log-every", "1", "--out", str(tmp_path / "a")])
    s = train_llama.main(common + ["--log-every", "4", "--out", str(tmp_path / "b")])
    a, b = (json.loads((tmp_path / r / "history.json").read_text()) for r in "ab")
    assert b["step"] == list(range(9))
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert s["first_step_s"] > 0 and s["tokens_per_s"] > 0


def test_log_every_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        train_llama.parse_args(["--log-every", "0"])
    assert "--log-every must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,rule", [("--batch", "0", "--batch must be >= 1"),
                                             ("--seq", "0", "--seq must be >= 1"),
                                             ("--steps", "0", "--steps must be >= 1"),
                                             ("--layers", "0", "--layers must be >= 1"),
                                             ("--vocab", "100", "--vocab must be >= 260"),
                                             ("--lr", "0", "--lr must be a finite number > 0"),
                                             ("--lr", "nan", "--lr must be a finite number > 0")])
def test_flags_are_validated_up_front(flag, value, rule, capsys):
    with pytest.raises(SystemExit):
        train_llama.parse_args([flag, value])
    assert rule in capsys.readouterr().err


def test_sequence_and_memory_checked_against_corpus_and_device():
    from coda_jax.layers import LlamaConfig

    args = train_llama.parse_args(["--seq", "100000"])
    cfg = LlamaConfig.tiny(vocab_size=4096)
    errs = train_llama.run_errors(args, cfg, train_tokens=10**6, val_tokens=50_000, memory_bytes=24 * 2**30,
                                  platform="cpu")
    assert "--seq must be <= 49998" in errs[0] and "validation split" in errs[0]
    assert "--batch 16 x --seq 100000 needs at least" in errs[1] and "lower --seq or --batch" in errs[1]
    ok = train_llama.parse_args(["--seq", "128"])
    assert train_llama.run_errors(ok, cfg, 10**6, 50_000, 24 * 2**30, "cpu") == []
    # cuDNN's attention keeps no [B, H, S, S] scores: the 1B model at 8 x 4096 fits an H100.
    one_b = LlamaConfig.llama_3_2_1b()
    gpu = train_llama.estimate_step_bytes(one_b, 8, 4096, "gpu", "9.0")
    assert gpu < 80 * 2**30
    assert train_llama.estimate_step_bytes(one_b, 8, 4096, "cpu") - gpu == 8 * 32 * 4096 * 4096 * 4
    # --remat block: each of the 16 blocks keeps [tokens, 2d] instead of [tokens, qkv + 4d + 2f],
    # and one block's activations are alive at a time.
    m, layer = 8 * 4096, 8 * 4096 * (one_b.qkv_size + 4 * 2048 + 2 * 8192) * 2
    blk = train_llama.estimate_step_bytes(one_b.replace(remat="block"), 8, 4096, "gpu", "9.0")
    assert gpu - blk == 15 * layer - 16 * 2 * m * 2048 * 2
    assert train_llama.parse_args(["--remat", "block"]).remat == "block"


def test_sample_from_a_training_run(tmp_path):
    """examples/sample.py restores a train_llama.py run and continues a prompt, greedy
    (deterministic) and sampled."""
    import sample

    out = tmp_path / "run"
    train_llama.main(["--batch", "4", "--seq", "32", "--layers", "1", "--vocab", "512", "--steps", "3",
                      "--eval-every", "0", "--ckpt-every", "3", "--out", str(out)])
    a = sample.main(["--from", str(out), "--prompt", "It was", "--tokens", "5"])
    b = sample.main(["--from", str(out), "--prompt", "It was", "--tokens", "5"])
    assert a == b and a[0].startswith("It was") and len(a[0]) > len("It was")
    c = sample.main(["--from", str(out), "--prompt", "It was", "--tokens", "5", "--temperature", "1.0",
                     "--top-k", "20", "--samples", "2"])
    assert len(c) == 2
    with pytest.raises(SystemExit):
        sample.parse_args(["--from", str(out), "--top-k", "-1"])


def test_fp8_run_with_current_scaling_and_its_samples(tmp_path, capsys):
    """``--fp8 --fp8-scaling current --fp8-lm-head`` trains (finite, recorded in args.json), its
    fresh model calibrated on the first batch before the three steps, and sample.py restores
    the FP8 run (its blocks' and its head's amax histories included) and continues a prompt."""
    import sample

    out = tmp_path / "fp8"
    s = train_llama.main(["--fp8", "--fp8-scaling", "current", "--fp8-lm-head", "--batch", "4", "--seq", "32",
                          "--layers", "1", "--vocab", "512", "--steps", "3", "--eval-every", "0", "--ckpt-every", "3", "--out", str(out)])
    assert np.isfinite(s["last_loss"])
    assert "FP8: scales calibrated on the first batch" in capsys.readouterr().out
    run = json.loads((out / "args.json").read_text())
    assert run["fp8"] and run["fp8_scaling"] == "current" and run["fp8_lm_head"]
    recipe = train_llama.fp8_recipe(train_llama.parse_args(["--fp8", "--fp8-scaling", "current", "--fp8-lm-head"]))
    assert recipe.scaling == "current" and recipe.lm_head
    assert train_llama.fp8_recipe(train_llama.parse_args([])) is None
    a = sample.main(["--from", str(out), "--prompt", "It was", "--tokens", "3"])
    assert a[0].startswith("It was") and len(a[0]) > len("It was")


def test_finetune_continues_from_a_run_and_reports_perplexity(tmp_path):
    """examples/finetune_llama.py starts from a run's weights (not from scratch) and lowers
    the validation perplexity."""
    import finetune_llama

    base = tmp_path / "base"
    s0 = train_llama.main(["--batch", "8", "--seq", "32", "--layers", "1", "--vocab", "512", "--steps", "30",
                           "--eval-every", "0", "--ckpt-every", "30", "--lr", "3e-3", "--out", str(base)])
    ft = tmp_path / "ft"
    s = finetune_llama.main(["--from", str(base), "--out", str(ft), "--steps", "10", "--lr", "1e-3",
                             "--batch", "8", "--seq", "32", "--eval-every", "0", "--ckpt-every", "10"])
    assert s["val_loss_before"] == pytest.approx(s0["val_loss"], rel=1e-5)  # the run's weights, evaluated
    assert s["val_perplexity"] < s["val_perplexity_before"]
    # args.json records the model the fine-tune trained (the base run's one layer, not the
    # preset's four) and its own schedule (the fine-tune's warm-up, not the tiny preset's),
    # so examples/sample.py rebuilds and restores it.
    run = json.loads((ft / "args.json").read_text())
    assert (run["preset"], run["layers"], run["vocab"], run["lr"], run["warmup"]) == ("tiny", 1, 512, 1e-3, 20)
    import sample

    assert sample.main(["--from", str(ft), "--prompt", "It was", "--tokens", "3"])[0].startswith("It was")
