"""torch._dynamo imported when something may compile, not when an optimizer, FSDP2 or DTensor runs eagerly.

Torch's eager paths reach into `torch._dynamo` only to turn it off or to read its config:
- functions decorated with `torch._disable_dynamo` (the optimizers' `add_param_group`, `state_dict`,
  `zero_grad` and functional steps, activation checkpointing, DCP) import it at their first call, only to wrap
  themselves in `torch._dynamo.disable`;
- every optimizer `step` runs `import torch._dynamo; torch._dynamo.graph_break()`;
- every FSDP2 hook calls `torch._dynamo.disable(hook)(...)`, and each activation-checkpoint recompute disables
  the pack hook it makes for itself;
- `init_process_group` clears `torch._dynamo.trace_rules`' caches where the module is loaded;
- DTensor's sharding propagation makes a `FakeTensorMode`, which imports `torch._dynamo.config`;
- DCP's `get_state_dict` asks of every module whether it is a `torch._dynamo.eval_frame.OptimizedModule`.
Importing the package is 0.9 s of CPU and about 900 modules in every training process, whether or not it ever
compiles (the slow tests start a few hundred such processes on 2 cores). Yet `disable(fn)(...)` is `fn(...)`
and `graph_break()` does nothing while no frame is being compiled, there is nothing to clear before anything
was traced, and nothing can be compiled before the package itself is imported.

`defer()` puts a stand-in module at `torch._dynamo` that answers exactly those calls, and only from those torch
call sites (the caller's file and function, torch 2.13's), as the real package does outside compilation;
`torch._dynamo.config` is the real config module, imported alone (8 ms). It also fills the `torch._disable_dynamo`
wrappers' cache (their `__dynamo_disable`) with the plain function. Anything else asked of `torch._dynamo`
(`torch.compile`, another submodule, any other name, the same names from anywhere else: a user's
`@torch.compiler.disable` stays a real disable for a later compile) first imports the real package and takes the
stand-in and every filled cache back, so from then on torch's own path runs unchanged, before anything can
compile. A thread that meets the package half imported by another waits for it. `TRAINYARD_EAGER_DYNAMO=1` leaves
torch alone.

Relies on `torch._compile._disable_dynamo` caching on `fn.__dynamo_disable` and on the call sites' names (torch
2.13; named in tests/engine/test_private_torch.py, and tests/engine/test_lazy_dynamo.py fails if a call site moves
and the package is imported after all); on a torch whose wrapper looks otherwise, `defer()` changes nothing.
"""
from __future__ import annotations

import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

NAME = "torch._dynamo"
ALONE = (NAME + ".config",)  # submodules imported without the package: they import nothing else of it
_ATTR = "__dynamo_disable"
_deferred: list = []   # the functions whose `torch._disable_dynamo` cache this module filled
_state: dict = {}      # "decorator" (torch's own) while deferred; "finder" once installed


def _real():
    """The real package where it is imported, else None; one that another thread is still importing is waited for
    (the import system's lock), not handed out half made."""
    module = sys.modules.get(NAME)
    if module is None or isinstance(module, _StandIn):
        return None
    return importlib.import_module(NAME)


def _called_from(*where: tuple[str, str]) -> bool:
    """Whether the caller of the stand-in's caller is one of the torch functions (file suffix, function name) whose
    use of the package it answers; from anywhere else the real package answers."""
    code = sys._getframe(2).f_code
    for suffix, name in where:  # a loop, not any() over a generator: DCP's state dict asks ~14 times a parameter
        if code.co_name == name and code.co_filename.endswith(suffix):
            return True
    return False


# The torch call sites the stand-in answers (torch 2.13), each with what it does there:
# every FSDP2 hook: `torch._dynamo.disable(hook)(...)`, called at once and dropped
_FSDP_HOOK = ("torch/distributed/fsdp/_fully_shard/_fsdp_common.py", "wrapper")
# activation checkpointing's recompute: `@torch._dynamo.disable` on the pack hook it makes for that recompute alone
_RECOMPUTE_HOOK = ("torch/utils/checkpoint.py", "__init__")
# a `torch._disable_dynamo` wrapper's first call: caches `disable(fn)` on fn (the cache is emptied at the load)
_DISABLE_DYNAMO = ("torch/_compile.py", "inner")
# init_process_group: `torch._dynamo.trace_rules.clear_lru_cache()`
_INIT_PROCESS_GROUP = ("torch/distributed/distributed_c10d.py", "init_process_group")
# DCP's state dict: `isinstance(module, torch._dynamo.eval_frame.OptimizedModule)`
_STATE_DICT_FQNS = ("torch/distributed/checkpoint/state_dict.py", "_get_fqns")


class _TraceRules:
    """`torch._dynamo.trace_rules` as `init_process_group` asks it: nothing was traced, so nothing to clear."""

    def clear_lru_cache(self) -> None:
        pass


class _EvalFrame:
    """`torch._dynamo.eval_frame` as DCP's state dict asks it: no module is a compiled one before the package is
    imported (`torch.compile` imports it first)."""

    class OptimizedModule:
        pass


class _StandIn(types.ModuleType):
    """`torch._dynamo` until something needs the real package: `graph_break()` as outside compilation anywhere;
    `disable(fn)`, `trace_rules.clear_lru_cache()` and `eval_frame.OptimizedModule` as outside compilation for the
    torch call sites above only; `config` the real module. Any other name, or those from anywhere else (a
    `@torch.compiler.disable` must stay a disable for a later compile), loads the real package and is read from it."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name != "__all__":
            raise AttributeError(name)  # copy, pickle and inspect probe dunders: no reason to load the package
        if f"{NAME}.{name}" in ALONE:
            return importlib.import_module(f"{NAME}.{name}")
        if name == "trace_rules" and _called_from(_INIT_PROCESS_GROUP):
            return _TraceRules()
        if name == "eval_frame" and _called_from(_STATE_DICT_FQNS):
            return _EvalFrame()
        return getattr(_load(), name)

    def graph_break(self, msg: str = "") -> None:
        real = _real()
        if real is not None:  # a reference to the stand-in kept after the real package was loaded
            real.graph_break(msg)

    def disable(self, fn=None, recursive=True, **kwargs):
        if _real() is None and fn is not None and callable(fn):
            if _called_from(_FSDP_HOOK, _RECOMPUTE_HOOK):
                return fn
            if _called_from(_DISABLE_DYNAMO):
                _deferred.append(fn)  # the wrapper caches the answer on fn: emptied when the package loads
                return fn
        return _load().disable(fn, recursive, **kwargs)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import torch._dynamo.<child>` while the stand-in stands: the real package first (but for ALONE), and the
    child as that import left it. The import system asks finders after its own look in sys.modules, and a module
    that appears there meanwhile it would execute again from its `__spec__` (a second `torch._dynamo.utils`, whose
    `counters` nobody counts in): so the child is taken out of sys.modules and handed over as it is, its own
    `__spec__` put back once the import system has set this one's. A bare `importlib.util.find_spec` (no import
    follows) gets the real package loaded and the child's own spec."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(NAME + ".") or name in ALONE or not deferred():
            return None
        importing = sys._getframe(2).f_code.co_name == "_find_and_load_unlocked"  # (via _find_spec)
        _load()
        if not importing:
            return None  # the next finders find the child; the import system returns its loaded module's spec
        if name not in sys.modules:
            importlib.import_module(name)
        module = sys.modules.pop(name)
        return importlib.machinery.ModuleSpec(name, self, loader_state=(module, module.__spec__))

    def create_module(self, spec):
        return spec.loader_state[0]

    def exec_module(self, module) -> None:
        module.__spec__ = module.__spec__.loader_state[1]


def _load() -> types.ModuleType:
    """The real `torch._dynamo`, imported now if need be, with torch's own path restored first."""
    real = _real()
    if real is not None:
        return real
    _restore()
    return importlib.import_module(NAME)


def _restore() -> None:
    import torch
    import torch._compile

    standin = sys.modules.get(NAME)
    if isinstance(standin, _StandIn):
        del sys.modules[NAME]
        if torch.__dict__.get("_dynamo") is standin:
            del torch._dynamo
    decorator = _state.pop("decorator", None)
    if decorator is not None:
        torch._compile._disable_dynamo = decorator
        torch._disable_dynamo = decorator
    for fn in _deferred:
        if getattr(fn, _ATTR, None) is fn:
            delattr(fn, _ATTR)
    _deferred.clear()


def _inner_code(decorator) -> types.CodeType | None:
    """The code of the wrapper `torch._disable_dynamo(fn)` returns (a constant of the decorator's code)."""
    for const in decorator.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "inner" and "fn" in const.co_freevars:
            return const
    return None


def _defer_one(fn) -> None:
    if getattr(fn, _ATTR, None) is None:
        setattr(fn, _ATTR, fn)
        _deferred.append(fn)


def deferred() -> bool:
    """Whether `torch._dynamo` is the stand-in now."""
    return isinstance(sys.modules.get(NAME), _StandIn)


def defer() -> int:
    """Put the stand-in in place; returns how many `torch._disable_dynamo` functions it covers (0 and nothing
    changed when the real package is imported already, with `TRAINYARD_EAGER_DYNAMO=1`, or on a torch whose
    wrapper this does not know). It finds the wrappers with `gc.get_objects()`, which leaves out frozen objects: it
    runs while the engine is imported, before the preload server, the trainer and the tests freeze what their
    imports made (`gc.freeze()`); called after such a freeze it would cover none of torch's."""
    if NAME in sys.modules or os.environ.get("TRAINYARD_EAGER_DYNAMO") == "1":
        return 0
    import torch
    import torch._compile

    decorator = torch._compile._disable_dynamo
    code = _inner_code(decorator)
    spec = importlib.util.find_spec(NAME)
    if code is None or getattr(torch, "_disable_dynamo", None) is not decorator or spec is None:
        return 0
    for obj in gc.get_objects():
        # type(), not isinstance(): some of torch's module-level objects warn when their __class__ is read
        if type(obj) is types.FunctionType and obj.__code__ is code:
            _defer_one(obj.__closure__[code.co_freevars.index("fn")].cell_contents)

    def deferring(fn=None, recursive=True):
        out = decorator(fn, recursive)
        if fn is not None and deferred():
            _defer_one(fn)
        return out

    standin = _StandIn(NAME, __doc__)
    standin.__path__ = list(spec.submodule_search_locations)  # where its ALONE submodules are found
    standin.__spec__ = spec
    standin.__file__ = spec.origin
    if "finder" not in _state:
        _state["finder"] = _Finder()
        sys.meta_path.insert(0, _state["finder"])
    _state["decorator"] = decorator
    sys.modules[NAME] = standin
    torch._dynamo = standin
    torch._compile._disable_dynamo = deferring
    torch._disable_dynamo = deferring
    return len(_deferred)
