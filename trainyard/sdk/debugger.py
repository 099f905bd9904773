"""`sagemaker.debugger`'s configuration classes, accepted so that copied launch code runs, and what Trainyard
makes of them.

SageMaker Debugger (rules, the debugger hook) runs as SageMaker services that Trainyard does not run: an
Estimator given them names them once as having no effect (sdk/estimator.py). Two of them mean something here:

- `TensorBoardOutputConfig(s3_output_path, container_local_output_path)`: the job's TensorBoard folder is synced to
  S3 while it runs, and the engine writes its metrics there (`tensorboard_output`);
- `ProfilerConfig(framework_profile_params=FrameworkProfile(start_step=5, num_steps=2))`: torch.profiler traces of
  those steps (`profiler_request`, which also reads Trainyard's own `profiler={"steps": [5, 6], "ranks": [0]}`).
  A ProfilerConfig without `framework_profile_params` asks for SageMaker's system monitor only, which Trainyard
  does not run: it is named as having no effect.

The classes keep the values they were given, as SageMaker's do. What they ask for becomes one typed value of the
JobSpec here (trainyard/job/observability.py), with errors naming the argument.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from trainyard.errors import ConfigError, close_match
from trainyard.job.observability import Profiler, TensorBoardOutput


@dataclass
class TensorBoardOutputConfig:
    s3_output_path: str
    container_local_output_path: str | None = None


@dataclass
class CollectionConfig:
    name: str
    parameters: dict[str, Any] | None = None


@dataclass
class DebuggerHookConfig:
    s3_output_path: str | None = None
    container_local_output_path: str | None = None
    hook_parameters: dict[str, Any] | None = None
    collection_configs: list[CollectionConfig] | None = None


@dataclass
class FrameworkProfile:
    local_path: str | None = None
    file_max_size: int | None = None
    file_close_interval: float | None = None
    file_open_fail_threshold: int | None = None
    detailed_profiling_config: Any = None
    dataloader_profiling_config: Any = None
    python_profiling_config: Any = None
    horovod_profiling_config: Any = None
    smdataparallel_profiling_config: Any = None
    start_step: int | None = None
    num_steps: int | None = None
    start_unix_time: int | None = None
    duration: float | None = None


@dataclass
class ProfilerConfig:
    s3_output_path: str | None = None
    system_monitor_interval_millis: int | None = None
    framework_profile_params: FrameworkProfile | None = None
    disable_profiler: bool = False


@dataclass
class Rule:
    """A Debugger rule; `Rule.sagemaker(rule_configs.vanishing_gradient())` as in SageMaker's examples."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    actions: Any = None

    @classmethod
    def sagemaker(cls, base_config: dict[str, Any], name: str | None = None, container_local_output_path=None,
                  s3_output_path=None, other_trials_s3_input_paths=None, rule_parameters=None,
                  collections_to_save=None, actions=None) -> "Rule":
        return cls(name=name or base_config.get("name", "rule"), config=dict(base_config), actions=actions)

    @classmethod
    def custom(cls, name: str, image_uri: str, instance_type: str, volume_size_in_gb: int, **kwargs) -> "Rule":
        return cls(name=name, config={"image_uri": image_uri, **kwargs})


class ProfilerRule(Rule):
    pass


class _RuleConfigs:
    """`rule_configs.<name>()` for any of SageMaker's built-in rules: a config naming the rule."""

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda **params: {"name": name, **params}


rule_configs = _RuleConfigs()


# SageMaker's FrameworkProfile without a step range profiles its detailed metrics at step 5 for 1 step
# (sagemaker.debugger.profiler_constants: DETAILED_PROFILING_START_STEP_DEFAULT, PROFILING_NUM_STEPS_DEFAULT)
DEFAULT_START_STEP = 5
DEFAULT_NUM_STEPS = 1
_PER_METRIC = ("detailed_profiling_config", "dataloader_profiling_config", "python_profiling_config",
               "horovod_profiling_config", "smdataparallel_profiling_config")


class ProfilerRequest(NamedTuple):
    """What the profiler arguments of an Estimator ask for."""

    profiler: Profiler | None
    """The profiler the job runs, or None."""
    inert: bool
    """profiler_config asks only for what Trainyard does not run (SageMaker's system monitor)."""
    note: str
    """A line for stderr when disable_profiler=True turned a profiler request off, else ""."""


def tensorboard_output(value: object) -> TensorBoardOutput | None:
    """`tensorboard_output_config` as the JobSpec carries it: a `TensorBoardOutputConfig`, or a dict with its keyword
    names (`s3_output_path`, optional `container_local_output_path`)."""
    if value is None:
        return None
    if isinstance(value, TensorBoardOutputConfig):
        value = {"s3_output_path": value.s3_output_path, "container_local_output_path": value.container_local_output_path}
    if not isinstance(value, dict):
        raise ConfigError("tensorboard_output_config", "expected TensorBoardOutputConfig(s3_output_path='s3://bucket/"
                                                       f"tensorboard') or {{'s3_output_path': ...}}, got {value!r}")
    if value.get("s3_output_path") is None:
        raise ConfigError("tensorboard_output_config", "s3_output_path is required: the S3 prefix the event files are "
                                                       "synced to, such as 's3://bucket/tensorboard'")
    return _typed(TensorBoardOutput, value, "tensorboard_output_config")


def profiler_request(profiler: object, profiler_config: object, disable_profiler: bool) -> ProfilerRequest:
    """The profiler of Trainyard's `profiler={"steps": [...], "ranks": [...]}` or SageMaker's `profiler_config`
    (steps `start_step` .. `start_step + num_steps - 1`, rank 0); `disable_profiler=True` (or a ProfilerConfig with
    `disable_profiler=True`) turns either off."""
    if profiler is not None and not isinstance(profiler, dict):
        raise ConfigError("profiler", f"expected a dict such as {{'steps': [5, 6], 'ranks': [0]}}, got {profiler!r}")
    if profiler_config is not None and not isinstance(profiler_config, ProfilerConfig):
        raise ConfigError("profiler_config", "expected ProfilerConfig(framework_profile_params=FrameworkProfile("
                                             f"start_step=5, num_steps=2)) (trainyard.debugger), got {profiler_config!r}")
    framework = profiler_config.framework_profile_params if profiler_config is not None else None
    if profiler is not None and framework is not None:
        raise ConfigError("profiler", "give either profiler={'steps': [...]} or profiler_config=ProfilerConfig("
                                      "framework_profile_params=...), not both")
    asked = None  # checked even when turned off: switching disable_profiler never hides a mistake
    if profiler is not None:
        asked = _typed(Profiler, profiler, "profiler")
    elif framework is not None:
        asked = _from_framework_profile(framework, profiler_config.s3_output_path)
    if disable_profiler or (profiler_config is not None and profiler_config.disable_profiler):
        note = "disable_profiler=True: no profiler runs (the profiler request is not used)" if asked else ""
        return ProfilerRequest(None, False, note)
    # without framework_profile_params a ProfilerConfig asks for SageMaker's system monitor only
    return ProfilerRequest(asked, asked is None and profiler_config is not None, "")


def _from_framework_profile(fp: object, s3_output_path: str | None) -> Profiler:
    field = "profiler_config.framework_profile_params"
    if not isinstance(fp, FrameworkProfile):
        raise ConfigError(field, f"expected FrameworkProfile(start_step=5, num_steps=2), got {fp!r}")
    if fp.start_unix_time is not None or fp.duration is not None:
        raise ConfigError(field, "Trainyard profiles steps, not a time range: give start_step and num_steps instead "
                                 "of start_unix_time and duration")
    given = [name for name in _PER_METRIC if getattr(fp, name) is not None]
    if given:
        raise ConfigError(field, f"{given[0]} is not supported: torch.profiler records everything of the steps "
                                 "FrameworkProfile(start_step=..., num_steps=...) names")
    start, count = fp.start_step, fp.num_steps
    if start is None and count is None:
        start, count = DEFAULT_START_STEP, DEFAULT_NUM_STEPS
    start = 1 if start is None else start
    count = DEFAULT_NUM_STEPS if count is None else count
    for name, v, low in (("start_step", start, 1), ("num_steps", count, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{field}.{name}", f"must be a whole number >= {low} (the first step is 1), got {v!r}")
    fields = {"steps": list(range(start, start + count)), "s3_output_path": s3_output_path,
              "local_path": fp.local_path}
    return _typed(Profiler, fields, "profiler_config")


def _typed(model: type[BaseModel], fields: dict, argument: str):
    """`model` from `fields`, errors named after the argument and its key: `profiler.steps: ...`."""
    unknown = [k for k in fields if k not in model.model_fields]
    if unknown:
        hint = close_match(str(unknown[0]), model.model_fields)
        raise ConfigError(argument, f"unknown key {unknown[0]!r}" + (f"; did you mean {hint!r}?" if hint else
                                    f"; it takes {', '.join(model.model_fields)}"))
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, ConfigError):  # a shared URI check: its message without its own field name
            msg = str(cause).split(": ", 1)[1]
        raise ConfigError(".".join([argument, *(str(p) for p in err["loc"])]), msg) from None
