"""The package's logger, and the messages it logs once per run.

Every coda-jax message goes to the ``"coda_jax"`` logger (configure it as any Python logger).
A message about a decision that is the same wherever it is made (a backend's fallback to XLA,
a GEMM routed to XLA, attention's padding) is logged once per process, on the first call with
its key, and in a multi-process run (:func:`jax.distributed.initialize`) at its level only by
process 0: the other processes log it at ``DEBUG``, so an N-process run prints it once, not N
times.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import jax

logger = logging.getLogger("coda_jax")
_logged: set[Hashable] = set()


def _is_first_process() -> bool:
    try:
        return jax.process_index() == 0
    except RuntimeError:  # no backend can start: there is one process
        return True


def log_once(key: Hashable, level: int, msg: str, *args) -> bool:
    """Logs ``msg % args`` at ``level`` (``DEBUG`` on processes other than 0) the first time
    ``key`` is seen in this process; returns whether it logged."""
    if key in _logged:
        return False
    _logged.add(key)
    logger.log(level if _is_first_process() else logging.DEBUG, msg, *args)
    return True


def forget_logged() -> None:
    """Forgets which messages were logged, so that each is logged again (tests)."""
    _logged.clear()
