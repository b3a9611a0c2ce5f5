"""One process of tests/test_multi_process.py's library checks, started by
``scripts/launch_local.sh --script tests/multi_process_probe.py --cpu-devices 2 2 CASE``
(which appends ``--coordinator``, ``--num-processes`` and ``--process-id``).

CASE ``library``: joins the run, then over a ``data=2,fsdp=2`` mesh of both processes' four
CPU devices builds a batch with :func:`coda_jax.sharding.batch_from_rows` (recording the rows
this process was asked for) and places a whole array with
:func:`coda_jax.sharding.place_whole`; prints one JSON line: the process, its rows and the
gathered values. CASE ``fail``: process 1 exits with status 3 at once, the others sleep (the
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
    print(json.dumps({
        "process": jax.process_index(), "processes": jax.process_count(), "devices": len(jax.devices()),
        "rows": sorted(asked), "batch_spec": str(batch.sharding.spec),
        "batch": multihost_utils.process_allgather(batch, tiled=True).tolist(),
        "placed": multihost_utils.process_allgather(placed, tiled=True).tolist(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
