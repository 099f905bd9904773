"""`PollThread`: a look taken every `poll` seconds on a thread of its own, until one look says done or the
owner stops it (the driver's first-step watch, its hang watch)."""
from __future__ import annotations

import threading


class PollThread:
    """Subclasses implement `look()`: True ends the thread. `start()` returns self; `stop()` joins."""

    def __init__(self, name: str, poll: float):
        self.poll = poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def look(self) -> bool:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.look():
                return
            self._stop.wait(self.poll)
