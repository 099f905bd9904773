import os
import pty
import select
import subprocess
import sys
import time

import pytest


@pytest.fixture
def src(tmp_path):
    """A source folder holding a one-line `train.py`."""
    d = tmp_path / "src"
    d.mkdir()
    (d / "train.py").write_text("print('hi')\n")
    return str(d)


def _on_a_tty(argv: list[str], env: dict) -> str:
    """`trainyard ARGV` with its stdout on a pseudo-terminal, as a person sees it; its output once it exits."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "trainyard.sdk.cli", *argv], stdout=slave,
                            stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    return out.decode()


@pytest.fixture
def on_a_tty():
    """Runs the `trainyard` command on a pseudo-terminal: `on_a_tty(argv, env) -> its output`."""
    return _on_a_tty
