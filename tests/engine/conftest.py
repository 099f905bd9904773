"""Fixtures of the engine's tests."""
import pytest


@pytest.fixture
def engine():
    """A one-process engine context, left again after the test."""
    import trainyard.engine as te  # here: conftest stays light for the tests that do not use the engine

    ctx = te.init({})
    yield ctx
    te.finish()
