"""README.md's Python blocks marked ``<!-- readme-test -->`` run as written (CPU, the ``xla``
backend), and the ``CodaLlamaBlock`` snippet keeps the carry contract it documents: its loss and
every gradient equal those of the same blocks run without carries (each block computing its
input norm's statistics from ``x``), with norm weights that differ from block to block.

A snippet that handed a block the wrong ``next_norm`` would still run and train; the contract
check catches it (``test_contract_check_catches_a_wrong_next_norm`` breaks the snippet on
purpose and expects the check to see it)."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import coda_jax as cj

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- readme-test -->"
# The line of the snippet that picks the next block's input norm (the negative control edits it).
NEXT_NORM = "self.blocks[i + 1].attn_norm[...]"


def readme_blocks() -> list[str]:
    """The ```python blocks that directly follow the marker line."""
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^" + re.escape(MARK) + r"\n```python\n(.*?)^```", text, flags=re.M | re.S)


def run_block(src: str) -> dict:
    namespace = {"__name__": "readme_snippet"}
    with cj.use_backend("xla"):
        exec(compile(src, "README.md", "exec"), namespace)
    return namespace


def block_snippet() -> str:
    found = [b for b in readme_blocks() if "CodaLlamaBlock" in b]
    assert len(found) == 1, f"README.md needs one {MARK} block using CodaLlamaBlock, found {len(found)}"
    return found[0]


def no_carry_loss(model, tokens, targets):
    """The snippet's model, every block called without carry and next_norm."""
    x = model.embed(tokens).astype(model.cfg.dtype)
    for block in model.blocks:
        x, carry = block(x)
        assert carry is None
    b, s, d = x.shape
    w_vocab = model.embed.embedding[...].astype(model.cfg.dtype)
    return cj.linear_cross_entropy(x.reshape(b * s, d), model.final_norm[...], w_vocab, targets.reshape(-1),
                                   eps=model.cfg.rms_norm_eps)


def randomize_norms(model, seed: int = 0):
    """Norm weights unlike each other (at their initial ones, any norm's carry fits any other's)."""
    norms = [model.final_norm] + [getattr(b, n) for b in model.blocks for n in ("attn_norm", "mlp_norm")]
    for i, p in enumerate(norms):
        p[...] = 1.0 + 0.5 * jax.random.normal(jax.random.key(seed + i), p[...].shape, p[...].dtype)


def contract_errors(ns: dict) -> tuple[float, float]:
    """(relative loss difference, largest relative gradient difference) between the snippet's
    loss and :func:`no_carry_loss`, on the snippet's model with randomized norms."""
    model, tokens = ns["model"], ns["tokens"]
    randomize_norms(model)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with cj.use_backend("xla"):
        got, g_got = nnx.jit(nnx.value_and_grad(lambda m: m.loss(inputs, targets)))(model)
        want, g_want = nnx.jit(nnx.value_and_grad(lambda m: no_carry_loss(m, inputs, targets)))(model)
    leaves_got, leaves_want = jax.tree.leaves(g_got), jax.tree.leaves(g_want)
    assert len(leaves_got) == len(leaves_want) > 0
    for g in leaves_want:
        assert float(jnp.max(jnp.abs(g))) > 0, "a parameter gets no gradient"
    grad_err = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(leaves_got, leaves_want))
    return abs(float(got) - float(want)) / abs(float(want)), grad_err


def test_readme_has_tested_blocks():
    assert readme_blocks(), f"no {MARK} python block in README.md"
    assert NEXT_NORM in block_snippet()


def test_readme_blocks_run_in_order():
    """Every marked block, in one namespace as a reader runs them (the options block uses the
    snippet's model), with the process-wide option it sets cleared afterwards."""
    ns = {"__name__": "readme_snippet"}
    try:
        for src in readme_blocks():
            with cj.use_backend("xla"):
                exec(compile(src, "README.md", "exec"), ns)
            assert np.isfinite(float(ns["loss"])) and float(ns["loss"]) > 0
    finally:
        cj.reset_options("mesh.fsdp_split")
    assert cj.current_options().mesh.fsdp_split == "width"


def test_block_snippet_trains_and_keeps_the_carry_contract():
    ns = run_block(block_snippet())
    first = float(ns["loss"])
    with cj.use_backend("xla"):
        later = [float(ns["train_step"](ns["model"], ns["optimizer"], ns["tokens"])) for _ in range(3)]
    assert np.isfinite(first) and later[-1] < first, (first, later)  # it learns the batch
    loss_err, grad_err = contract_errors(ns)
    assert loss_err < 1e-5 and grad_err < 1e-4, (loss_err, grad_err)


def test_contract_check_catches_a_wrong_next_norm():
    """The snippet with each block's carry made for its own input norm instead of the next
    block's: it runs, and the check above sees the difference."""
    broken = block_snippet().replace(NEXT_NORM, "self.blocks[i].attn_norm[...]")
    loss_err, grad_err = contract_errors(run_block(broken))
    assert loss_err > 1e-3 or grad_err > 1e-2, (loss_err, grad_err)
