"""Fixtures of the kernel tests."""
import pytest


@pytest.fixture
def interpret(monkeypatch):
    """Triton's interpreter for CPU tensors (the ops jit their kernels per mode, at first use); monkeypatched,
    so a test that switches it off gets it back afterwards and nothing leaks into the processes it starts."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
