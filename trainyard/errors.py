"""The errors a user sees. Each names what is wrong and how to fix it."""
from __future__ import annotations

import difflib
import functools
import inspect
from typing import Callable, Iterable, TypeVar

T = TypeVar("T", bound=Callable)


class ConfigError(ValueError):
    """Bad input, found before anything is uploaded, provisioned or started.

    `field` is the Estimator/fit argument at fault (dotted for nested values: `inputs.train`).
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class UnknownArgumentError(ConfigError, TypeError):
    """A keyword argument the callee does not take: a `TypeError`, as Python's own is (code that catches
    that keeps working), and a `ConfigError` whose field is the keyword and whose message names the
    closest accepted one: `instance_cout: Estimator() got an unexpected keyword argument; did you mean
    'instance_count'?`."""

    def __init__(self, owner: str, names: list[str], accepted: Iterable[str]):
        accepted = sorted(set(accepted))
        self.owner, self.names = owner, list(names)
        self.suggestions = {n: close_match(n, accepted) for n in self.names}
        several = len(self.names) > 1
        hints = [f"did you mean {m!r}" + (f" for {n!r}" if several else "") + "?"
                 for n, m in self.suggestions.items() if m]
        if not all(self.suggestions.values()):
            hints.append(f"it takes: {', '.join(accepted)}" if len(accepted) <= 12 else
                         "docs/sdk.md lists the arguments it takes")
        what = "unexpected keyword arguments" if several else "an unexpected keyword argument"
        super().__init__(", ".join(self.names), f"{owner} got {what}; {' '.join(hints)}")


def close_match(name: str, accepted: Iterable[str]) -> str | None:
    """The accepted name closest to a mistyped `name` (difflib's ratio >= 0.6), or None."""
    found = difflib.get_close_matches(name, list(accepted), n=1)
    return found[0] if found else None


def check_keywords(owner: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    """Raise UnknownArgumentError for the names of `given` that are not `accepted` (`owner` is how the
    message names the callee: `Estimator()`)."""
    accepted = set(accepted)
    unknown = [name for name in given if name not in accepted]
    if unknown:
        raise UnknownArgumentError(owner, unknown, accepted)


def known_keywords(obj: T) -> T:
    """Decorator for a function, or a class (its `__init__`; above `@dataclass`), without `**kwargs`: an
    unknown keyword raises UnknownArgumentError with the closest accepted name instead of Python's bare
    TypeError. The signature seen by `inspect` and help() stays the function's."""
    if isinstance(obj, type):
        obj.__init__ = known_keywords(obj.__init__)
        return obj
    params = inspect.signature(obj).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        raise TypeError(f"{obj.__qualname__} takes **kwargs: check them with check_keywords instead")
    accepted = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) - {"self"}
    owner = obj.__qualname__.removesuffix(".__init__") + "()"

    @functools.wraps(obj)
    def checked(*args, **kwargs):
        if not accepted.issuperset(kwargs):
            check_keywords(owner, kwargs, accepted)
        return obj(*args, **kwargs)

    return checked  # type: ignore[return-value]


class UnexpectedStatusException(ValueError):
    """SageMaker's `sagemaker.exceptions.UnexpectedStatusException`: a job ended in a status the call did not
    allow. `allowed_statuses` and `actual_status` as SageMaker's."""

    def __init__(self, message: str, allowed_statuses: list[str], actual_status: str):
        self.allowed_statuses, self.actual_status = allowed_statuses, actual_status
        super().__init__(message)


class JobFailedError(UnexpectedStatusException, RuntimeError):
    """A training job ended Failed. `describe()` holds the same FailureReason. An UnexpectedStatusException, so
    that a notebook's `except sagemaker.exceptions.UnexpectedStatusException` (as `trainyard.exceptions`) catches
    it, and a RuntimeError as before."""

    def __init__(self, job_name: str, status: str, reason: str):
        self.job_name = job_name
        self.status = status
        self.reason = reason
        super().__init__(f"training job {job_name} {status}: {reason}", ["Completed", "Stopped"], status)


class ImageError(RuntimeError):
    """Building or pushing the training image failed: no builder, the builder failed, a registry refused."""


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """` (did you mean 'PREFIXbest'?)` for the closest of `known` to `name`, or "" when none is close.
    `prefix` puts the path in front of the suggestion (`mics.`, `--`)."""
    found = close_match(name, known)
    return f" (did you mean '{prefix}{found}'?)" if found else ""
