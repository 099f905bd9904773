"""`DelegatingWork`: an async collective's handle that wraps another, for code that must see its `wait()`
(the comm meter times it, the heartbeat marks the rank as inside the collective). It subclasses
`dist.Work`, so callers that check the type still accept it, and hands every other call to the work it
wraps."""
from __future__ import annotations

import torch.distributed as dist


class DelegatingWork(dist.Work):
    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout=None) -> bool:
        return self._work.wait() if timeout is None else self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def get_future(self):
        return self._work.get_future()

    def synchronize(self) -> None:
        self._work.synchronize()
