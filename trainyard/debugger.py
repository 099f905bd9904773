"""SageMaker's `sagemaker.debugger` import path: configuration accepted with no effect (see trainyard/sdk/debugger.py)."""
from trainyard.sdk.debugger import (CollectionConfig, DebuggerHookConfig, FrameworkProfile, ProfilerConfig, ProfilerRule,
                                   Rule, TensorBoardOutputConfig, rule_configs)

__all__ = ["CollectionConfig", "DebuggerHookConfig", "FrameworkProfile", "ProfilerConfig", "ProfilerRule", "Rule",
           "TensorBoardOutputConfig", "rule_configs"]
