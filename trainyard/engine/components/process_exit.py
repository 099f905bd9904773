"""The end of a process of ours (a rank of the built-in trainer, a host's driver) without the interpreter's teardown.

After the exit handlers, an interpreter that imported torch spends 0.5 s (torch alone) to 1 s (with dynamo, which
every training process imports: the optimizers call it) of CPU freeing modules one by one, which nobody needs
when the process ends. Each rank and each driver of a job pays it, in the job's critical path: the host's
launcher waits for its ranks to be gone before it reports, and the job waits for every host.

`exit_now(code)` does what the interpreter does before that teardown, in its order: it joins the threads that
are not daemons and runs their exit hooks (`threading._shutdown`: concurrent.futures' executors finish
their work there), runs the `atexit` handlers (the worker site's process-group cleanup among them), flushes
stdout and stderr, and then ends the process with `code`. Only for code whose files are closed by its own
end: a user's script keeps the interpreter's full exit.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    code = 0 if code is None else int(code)
    shutdown = getattr(threading, "_shutdown", None)
    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_handlers is None or threading.current_thread() is not threading.main_thread():
        sys.exit(code)  # an interpreter without these hooks (or a call off the main thread): the normal way
    shutdown()
    run_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said anyway
            pass
    os._exit(code)
