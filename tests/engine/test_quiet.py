"""Torch's harmless notes are hidden by one list (trainyard/engine/quiet.py); nothing else is, and
TRAINYARD_VERBOSE=1 shows everything."""
import logging
import re
import warnings

import pytest

from trainyard.engine import quiet as q


@pytest.fixture
def fresh_logger_filters():
    loggers = [logging.getLogger(h.logger) for h in q.HARMLESS if h.logger]
    saved = [list(log.filters) for log in loggers]
    for log in loggers:  # an earlier te.init() in this process may have quieted them already
        log.filters[:] = [f for f in log.filters if not isinstance(f, q._DropHarmless)]
    yield
    for log, filters in zip(loggers, saved):
        log.filters[:] = filters


def _example(h: q.Harmless) -> str:
    """A message of the shape torch writes, from the entry's regex."""
    return {
        "Slicing": "Slicing a flattened dim from root mesh will be deprecated in PT 2.11. Users need to ...",
        "While": "While redistributing from (Shard(dim=0),) to (Replicate(),), 2 sequential all_gather operations",
        "torch\\": "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in "
                   "a single process.",
        "`is_gradient": "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                        "`is_activation_checkpointing` instead.",
    }[next(k for k in ("Slicing", "While", "torch\\", "`is_gradient") if h.message.startswith(k))]


def _shown(show_all, caplog) -> tuple[list[str], list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        q.quiet(show_all)
        for h in q.HARMLESS:
            if h.category is not None:
                warnings.warn(_example(h), h.category)
        warnings.warn("my own warning: Slicing is fine", UserWarning)  # the user's: never hidden
        warnings.warn("a torch warning nobody listed", UserWarning)
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        for h in q.HARMLESS:
            if h.logger:
                logging.getLogger(h.logger).warning(_example(h))
                logging.getLogger(h.logger).warning("a different note of the same logger")
    return [str(w.message) for w in seen], [r.getMessage() for r in caplog.records]


def test_the_listed_notes_are_hidden_and_nothing_else(caplog, fresh_logger_filters, monkeypatch):
    monkeypatch.delenv(q.VERBOSE_ENV, raising=False)
    shown, logged = _shown(None, caplog)
    assert shown == ["my own warning: Slicing is fine", "a torch warning nobody listed"]
    assert logged == ["a different note of the same logger"]


def test_verbose_shows_everything(caplog, fresh_logger_filters, monkeypatch):
    monkeypatch.setenv(q.VERBOSE_ENV, "1")
    shown, logged = _shown(None, caplog)
    assert len(shown) == sum(h.category is not None for h in q.HARMLESS) + 2
    assert len(logged) == 2 * sum(h.logger is not None for h in q.HARMLESS)


def test_every_entry_says_why_and_compiles():
    for h in q.HARMLESS:
        re.compile(h.message)
        assert (h.category is None) != (h.logger is None)
        assert len(h.why) > 40
