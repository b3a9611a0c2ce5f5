"""One process of tests/test_multi_process.py's library checks, started by
``scripts/launch_local.sh --script tests/multi_process_probe.py --cpu-devices 2 2 CASE``
(which appends ``--coordinator``, ``--num-processes`` and ``--process-id``).

CASE ``library`` (``library DIR``): joins the run, then over a ``data=2,fsdp=2`` mesh of both
processes' four CPU devices builds a batch with :func:`coda_jax.sharding.batch_from_rows`
(recording the rows this process was asked for), places a whole array with
:func:`coda_jax.sharding.place_whole`, and writes a model split over ``fsdp=4`` to ``DIR`` with
``save_pretrained``; prints one JSON line: the process, its rows, the gathered values and
whether the model's Hugging Face state dict (gathered, and as written) is the unsplit one's. CASE ``fail``: process 1 exits with status 3 at once, the others sleep (the
launcher must stop them).
"""

import argparse
import json
import sys
import time

import numpy as np


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=["library", "fail"])
    p.add_argument("save_to", nargs="?", help="library: where save_pretrained writes")
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    args = p.parse_args(argv)
    if args.case == "fail":
        if args.process_id == 1:
            return 3
        time.sleep(300)
        return 0

    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    from coda_jax.sharding import batch_from_rows, mesh_from_spec, place_whole

    mesh = mesh_from_spec("data=2,fsdp=2")
    whole = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
    asked = []

    def rows(lo: int, hi: int) -> np.ndarray:
        asked.append([lo, hi])
        return whole[lo:hi]

    batch = batch_from_rows(rows, whole.shape, mesh)
    placed = place_whole(whole.astype(np.float32) * 2, NamedSharding(mesh, P("fsdp", "data")))
    # A model split over both processes (fsdp=4: each process holds half of each split weight):
    # to_hf_state_dict gathers every parameter whole, and save_pretrained writes from process 0.
    from flax import nnx

    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.layers.hf_llama import to_hf_state_dict
    from coda_jax.layers.pretrained import SafetensorsDirectory
    from coda_jax.sharding import shard_state

    model = CodaLlama(LlamaConfig.tiny(vocab_size=512).replace(num_layers=1), rngs=nnx.Rngs(0))
    before = to_hf_state_dict(model)
    nnx.update(model, shard_state(nnx.state(model), mesh_from_spec("fsdp=4")))
    split = sum(not p.is_fully_replicated for p in jax.tree.leaves(nnx.state(model)))
    after = to_hf_state_dict(model)
    model.save_pretrained(args.save_to)
    multihost_utils.sync_global_devices("saved")  # process 0 has written
    written = dict(SafetensorsDirectory(args.save_to))
    print(json.dumps({
        "hf_split_params": split, "hf_equal": sorted(before) == sorted(after) == sorted(written) and all(
            np.array_equal(before[k], after[k]) and np.array_equal(before[k], written[k]) for k in before),
        "process": jax.process_index(), "processes": jax.process_count(), "devices": len(jax.devices()),
        "rows": sorted(asked), "batch_spec": str(batch.sharding.spec),
        "batch": multihost_utils.process_allgather(batch, tiled=True).tolist(),
        "placed": multihost_utils.process_allgather(placed, tiled=True).tolist(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
