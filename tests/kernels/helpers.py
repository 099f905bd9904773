"""Shared by the kernel tests."""


def count_calls(monkeypatch, module, name: str = "_forward_triton") -> list:
    """Record each call of `module.name` (the wrapped function still runs); returns the list of calls."""
    calls = []
    original = getattr(module, name)

    def counted(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(module, name, counted)
    return calls
