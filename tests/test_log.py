"""coda_jax.log: a decision's message is logged once per process, and in a multi-process run
at its level only by process 0 (DEBUG on the others), so N processes print it once."""

import logging

import jax

from coda_jax import log as coda_log


def test_logged_once_per_key(monkeypatch, caplog):
    monkeypatch.setattr(coda_log, "_logged", set())
    with caplog.at_level(logging.INFO, logger="coda_jax"):
        assert coda_log.log_once(("k", 1), logging.WARNING, "decision %s", "a")
        assert not coda_log.log_once(("k", 1), logging.WARNING, "decision %s", "b")
        assert coda_log.log_once(("k", 2), logging.INFO, "other")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, "decision a"),
                                                                      (logging.INFO, "other")]
    coda_log.forget_logged()
    assert coda_log.log_once(("k", 1), logging.WARNING, "again")


def test_other_processes_log_at_debug(monkeypatch, caplog):
    monkeypatch.setattr(coda_log, "_logged", set())
    monkeypatch.setattr(jax, "process_index", lambda *a: 1)
    with caplog.at_level(logging.DEBUG, logger="coda_jax"):
        coda_log.log_once("fallback", logging.WARNING, "falls back")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.DEBUG, "falls back")]
    with caplog.at_level(logging.INFO, logger="coda_jax"):
        caplog.clear()
        coda_log.log_once("route", logging.WARNING, "routed")
    assert not caplog.records  # a WARNING-level handler on process 1 sees nothing
