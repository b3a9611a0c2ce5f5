"""Fine-tune a checkpoint on the shipped text and report validation perplexity before and after.

    python examples/finetune_llama.py --from runs/tiny --steps 50                 # a train_llama.py run
    python examples/finetune_llama.py --from path/to/hf_llama_dir --backend pallas --lr 3e-5

The same flags as ``examples/train_llama.py`` (it is that script with ``--init-from``): the
model, its weights and, for a Hugging Face directory with ``tokenizer.json``, its tokenizer
come from ``--from``; the optimizer starts fresh (AdamW, defaults here: ``--lr`` 1e-4 after
``--warmup`` 20 steps, whatever the starting run's preset).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import train_llama  # examples/train_llama.py, beside this script


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", required=True, help="a train_llama.py --out directory or a HF directory")
    p.add_argument("--out", default="runs/finetune")
    p.add_argument("--lr", default="1e-4")
    p.add_argument("--warmup", default="20", help="linear warm-up steps (not the starting run's preset's)")
    p.add_argument("--steps", default="100")
    ours, rest = p.parse_known_args(argv)
    if Path(ours.out).resolve() == Path(ours.source).resolve():
        p.error("--out must differ from --from (the fine-tune writes its own checkpoints)")
    summary = train_llama.main(rest + ["--init-from", ours.source, "--out", ours.out, "--lr", ours.lr,
                                       "--warmup", ours.warmup, "--steps", ours.steps])
    print(f"validation perplexity: before {summary.get('val_perplexity_before', float('nan')):.2f}, "
          f"after {summary.get('val_perplexity', float('nan')):.2f}", flush=True)
    return summary


if __name__ == "__main__":
    main()
