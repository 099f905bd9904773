"""`sagemaker.debugger`'s configuration classes, accepted so that copied launch code runs.

SageMaker Debugger and Profiler run as SageMaker services (rule containers, the profiler agent); Trainyard
runs neither, so an Estimator given these names them once as having no effect (sdk/estimator.py). They
keep the values they were given, as SageMaker's do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
