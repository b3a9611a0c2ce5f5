"""Measured per-GEMM configurations: the autotuner's table and its lookup.

The heuristics of :mod:`coda_jax.pallas.tuning` (one table per shape class, the ping-pong
programs, the wave fit) pick one configuration for a whole class of GEMMs. The best one
differs between GEMMs of the same class (an epilogue's traffic, the grid's waves), so the
autotuner measures each GEMM of a model (docs/performance.md#tuned-tables).

``benchmarks/tune.py --model 1b:8:1024`` traces a model's training step, collects every
Pallas kernel call (:mod:`coda_jax.pallas.kernel_calls`), times each under a set of
candidate configurations on the GPU, checks each candidate's outputs against the
heuristic configuration's, and writes the winners as a table (JSON)::

    {"device_kinds": ["NVIDIA H100 80GB HBM3"], "num_sms": 132, "jax": "0.11.2", "commit": "...",
     "entries": [{"program": "rms_rope", "layout": "nn", "m": 8192, "n": 3072, "k": 2048,
                  "config": {"grid_minor_dim": "m"}, "ms": 0.230, "heuristic_ms": 0.245}, ...]}

``layout`` is ``"n"``/``"t"`` for A then B (``"tn"``: the wgrad's transposed A). ``config``
holds the :class:`TuningConfig` fields that differ from ``CONFIG_TABLE["default"]``, or is
``null`` where no candidate beat the heuristics' choice (the GEMM keeps it, and borrows no
neighbouring entry). ``promote_k`` (absent: 0) marks an FP8 GEMM measured with its accumulator
promoted every that many K elements (:class:`coda_jax.lowering.GemmLowering`): the promoting
kernel runs another plan (halved consumer tiles, the ring's mainloop), so its entries serve
only GEMMs promoted alike, and an unpromoted entry never serves a promoted GEMM. ``loads``
(absent: any) names the dtypes of the epilogue's tile loads it was measured with
(:func:`loads_signature`, e.g. ``"x:float32"``): a pass over a float32 weight and one over a
bf16 activation of the same shape move different bytes, and may want different configurations.
The autotuner writes it for programs with tile loads; entries without it (tables written
before) serve GEMMs of any load dtypes.

Lookup (:func:`tuned_config`): the tables shipped with the package, one per GPU kind
(``tuned_<gpu>.json``, :func:`table_file_name`: ``tuned_h100.json``, ``tuned_h200.json``), or
the files the option ``pallas.tuned_tables`` names (``"none"`` turns tables off).
A table applies only on a GPU whose ``device_kind`` it lists and whose SM count it was
measured with (wave quantization depends on it); the first shipped table that applies is
used. The H200 has the H100's SMs and more memory bandwidth, and its own table: the
winners differ where an epilogue's traffic matters. An entry matches a GEMM of the same
program and layout whose (m, n, k) are each within a factor of 2 of the entry's; the
nearest (in log distance) wins; the promotion interval must match exactly, and so must the
tile loads' signature where the entry has one (at equal distance, an entry with the GEMM's
signature wins over one without). Otherwise the heuristics decide.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from coda_jax.epilogue import Epilogue, LoadKind
from coda_jax.lowering import check_promote_k
from coda_jax.options import PallasOptions, current_options, options
from coda_jax.pallas.tuning import CONFIG_TABLE, TuningConfig

# The tables shipped with the package, one per GPU kind (package data, pyproject.toml).
SHIPPED_TABLES: tuple[Path, ...] = tuple(sorted(Path(__file__).parent.glob("tuned_*.json")))
# An entry serves GEMMs whose every dimension is within this factor of its own.
MATCH_FACTOR = 2.0
_FIELDS = {f.name for f in dataclasses.fields(TuningConfig)}


def layout_name(transpose_a: bool, transpose_b: bool) -> str:
    """``"nn"``, ``"nt"``, ``"tn"`` or ``"tt"``: A's then B's layout."""
    return ("t" if transpose_a else "n") + ("t" if transpose_b else "n")


def loads_signature(epilogue: Epilogue, loads: Mapping[str, Any]) -> str:
    """The dtypes of ``epilogue``'s tile loads, as a table entry's ``"loads"``: ``"name:dtype"``
    in load-name order, comma-separated (``"x:float32"``; ``""``: no tile loads). Only tile loads
    (``[M, N]``) change an epilogue's traffic much; row, column and scalar loads are small.
    ``loads``: each load's dtype, or a value with a ``dtype`` (an array, a ``ShapeDtypeStruct``),
    or a tuple of its column parts. The lookup at lowering time and the autotuner's entries both
    come from here, so that they name a GEMM alike."""
    def dtype(v: Any) -> str:
        v = v[0] if isinstance(v, (tuple, list)) else v
        return jnp.dtype(getattr(v, "dtype", v)).name

    tiles = sorted(l.name for l in epilogue.loads if l.kind is LoadKind.TILE)
    missing = [name for name in tiles if name not in loads]
    if missing:
        raise ValueError(f"epilogue {epilogue.name!r}: no dtype for its tile loads {missing}")
    return ",".join(f"{name}:{dtype(loads[name])}" for name in tiles)


def _is_dtype(name: str) -> bool:
    try:
        return jnp.dtype(name).name == name
    except TypeError:
        return False


def _check_signature(loads: Any, where: str) -> None:
    """A ``"loads"`` value a table may hold: a :func:`loads_signature` string (else a
    ``ValueError``: a misspelt one would silently match no GEMM)."""
    parts = [p.partition(":") for p in loads.split(",")] if isinstance(loads, str) and loads else []
    names = [name for name, _, _ in parts]
    if (not isinstance(loads, str) or names != sorted(names)
            or not all(re.fullmatch(r"[A-Za-z_]\w*", name) and sep and _is_dtype(dt) for name, sep, dt in parts)):
        raise ValueError(f"{where}: 'loads' must be the tile loads' dtypes as 'name:dtype' in name order, "
                         f"comma-separated (e.g. 'x:float32'), got {loads!r}")


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """One measured GEMM: its program, layout and (m, n, k), and the winning configuration."""

    program: str
    layout: str
    m: int
    n: int
    k: int
    config: TuningConfig | None  # None: measured, and the heuristics' choice won
    promote_k: int = 0  # the FP8 accumulator's promotion interval it was measured with (0: none)
    loads: str | None = None  # its tile loads' dtypes (loads_signature); None: serves any

    def distance(self, m: int, n: int, k: int) -> float | None:
        """Log distance to an ``(m, n, k)`` GEMM, or None if a dimension is off by more
        than :data:`MATCH_FACTOR`."""
        logs = [abs(math.log(x / y)) for x, y in ((m, self.m), (n, self.n), (k, self.k))]
        return None if max(logs) > math.log(MATCH_FACTOR) else sum(logs)


@dataclasses.dataclass(frozen=True)
class TunedTable:
    device_kinds: tuple[str, ...]
    num_sms: int
    entries: tuple[TunedEntry, ...]

    def applies_to(self, device_kind: str, num_sms: int) -> bool:
        return device_kind in self.device_kinds and num_sms == self.num_sms

    def lookup(self, program: str, layout: str, m: int, n: int, k: int, promote_k: int = 0,
               loads: str | None = None) -> TunedEntry | None:
        """The nearest entry for this GEMM, or None. ``loads``: the GEMM's :func:`loads_signature`
        (None: unknown, only entries without one serve it); an entry with a signature serves only
        GEMMs with the same one, and wins over one without at equal distance (else the first wins)."""
        best, best_rank = None, None
        for e in self.entries:
            if (e.program != program or e.layout != layout or e.promote_k != promote_k
                    or (e.loads is not None and e.loads != loads)):
                continue
            d = e.distance(m, n, k)
            rank = None if d is None else (d, e.loads is None)
            if rank is not None and (best_rank is None or rank < best_rank):
                best, best_rank = e, rank
        return best


def config_from_fields(fields: dict[str, Any], source: str) -> TuningConfig:
    """``CONFIG_TABLE["default"]`` with ``fields`` replaced; a clear error for unknown fields."""
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise ValueError(f"{source}: unknown TuningConfig fields {unknown}; known: {sorted(_FIELDS)}")
    try:
        return dataclasses.replace(CONFIG_TABLE["default"], **fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: invalid configuration {fields}: {e}") from e


def config_fields(cfg: TuningConfig) -> dict[str, Any]:
    """The fields of ``cfg`` that differ from ``CONFIG_TABLE["default"]`` (what a table stores)."""
    base = CONFIG_TABLE["default"]
    return {f: getattr(cfg, f) for f in sorted(_FIELDS) if getattr(cfg, f) != getattr(base, f)}


def parse_table(data: dict, source: str) -> TunedTable:
    """A :class:`TunedTable` from its JSON object; ``ValueError`` naming ``source`` and the
    rule a malformed table breaks."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{source}: a tuned table is a JSON object with an 'entries' list")
    kinds = data.get("device_kinds")
    if not isinstance(kinds, list) or not all(isinstance(x, str) for x in kinds):
        raise ValueError(f"{source}: 'device_kinds' must be a list of GPU device kinds")
    if not isinstance(data.get("num_sms"), int):
        raise ValueError(f"{source}: 'num_sms' must be an integer")
    entries = []
    for i, e in enumerate(data["entries"]):
        where = f"{source}, entry {i}"
        try:
            layout = e["layout"]
            dims = [int(e[d]) for d in ("m", "n", "k")]
            program, fields = str(e["program"]), e["config"]
            fields = None if fields is None else dict(fields)
            promote_k, loads = e.get("promote_k", 0), e.get("loads")
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{where}: needs program, layout, m, n, k and config ({err})") from err
        if layout not in ("nn", "nt", "tn", "tt") or min(dims) < 1:
            raise ValueError(f"{where}: layout must be nn/nt/tn/tt and m, n, k positive, got {layout!r} {dims}")
        try:
            check_promote_k(promote_k)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        if loads is not None:
            _check_signature(loads, where)
        entries.append(TunedEntry(program, layout, *dims, None if fields is None else config_from_fields(fields, where),
                                  promote_k, loads))
    return TunedTable(tuple(kinds), data["num_sms"], tuple(entries))


@functools.lru_cache(maxsize=8)
def load_table(path: str) -> TunedTable | None:
    """The table in ``path`` (None if the file does not exist)."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    return parse_table(data, str(path))


def tables_disabled():
    """No tuned table applies inside the block (the autotuner's heuristic baseline): the option
    ``pallas.tuned_tables="none"`` for the block."""
    return options(pallas=PallasOptions(tuned_tables="none"))


def table_file_name(device_kind: str) -> str:
    """The file a tuned table for GPUs of ``device_kind`` is shipped as: ``"NVIDIA H100 80GB
    HBM3"`` -> ``"tuned_h100.json"``, ``"NVIDIA H200"`` -> ``"tuned_h200.json"`` (the model
    name, lower case; the whole kind made a file name where it has none)."""
    m = re.search(r"\b([A-Z]+\d{2,4}[A-Za-z]?)\b", device_kind)
    slug = m.group(1) if m else re.sub(r"[^0-9A-Za-z]+", "_", device_kind).strip("_")
    return f"tuned_{slug.lower() or 'gpu'}.json"


def active_table_paths() -> tuple[str, ...]:
    """The table files in use, in lookup order, by the option ``pallas.tuned_tables``:
    ``"shipped"`` (the default): :data:`SHIPPED_TABLES`; ``"none"``: none; else its paths,
    each of which must exist."""
    tables = current_options().pallas.tuned_tables
    if tables == "none":
        return ()
    if tables == "shipped":
        return tuple(str(p) for p in SHIPPED_TABLES)
    missing = [p for p in tables if not Path(p).exists()]
    if missing:
        raise ValueError(f"coda_jax option pallas.tuned_tables: {missing[0]!r}: no such file (give tuned table "
                         f"paths, 'shipped' or 'none')")
    return tuple(tables)


def table_for(device_kind: str, num_sms: int) -> TunedTable | None:
    """The first table in use (:func:`active_table_paths`) measured on this GPU kind and SM
    count, or None."""
    for path in active_table_paths():
        table = load_table(path)
        if table is not None and table.applies_to(device_kind, num_sms):
            return table
    return None


def tuned_config(program: str, m: int, n: int, k: int, transpose_a: bool, transpose_b: bool,
                 device_kind: str, num_sms: int, pair_width: int | None = None,
                 promote_k: int = 0, loads: str | None = None) -> TuningConfig | None:
    """The measured configuration for this GEMM on this GPU, or None (the heuristics decide).

    An entry whose tile cannot hold the epilogue's pair block (``pair_width``) is skipped;
    ``promote_k``: the GEMM's FP8 promotion interval, which an entry must have been measured with;
    ``loads``: the GEMM's :func:`loads_signature`, which an entry with one must have been measured
    with (None: unknown, only entries without one apply).
    """
    table = table_for(device_kind, num_sms)
    if table is None:
        return None
    entry = table.lookup(program, layout_name(transpose_a, transpose_b), m, n, k, promote_k, loads)
    if entry is None or entry.config is None or (pair_width is not None and entry.config.tile_n % pair_width):
        return None
    return entry.config
