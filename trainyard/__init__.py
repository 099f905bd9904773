"""Trainyard: `Estimator(...).fit()` on emulated hosts, EC2 or Terraform.

SageMaker's import paths work with `sagemaker` replaced by `trainyard`: `trainyard.estimator.Estimator`,
`trainyard.pytorch.PyTorch`, `trainyard.huggingface.HuggingFace`, `trainyard.inputs.TrainingInput`,
`trainyard.Session`, `trainyard.get_execution_role`, `trainyard.local.LocalSession`, `trainyard.debugger`,
`trainyard.analytics.TrainingJobAnalytics`.

The public names are loaded on first use, so `import trainyard.engine` inside a training process
does not pay for the SDK (pydantic, boto3).
"""
import importlib

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    "Estimator": "trainyard.sdk.estimator",
    "TrainingInput": "trainyard.sdk.inputs",
    "FileSystemInput": "trainyard.sdk.inputs",
    "Session": "trainyard.sdk.session",
    "LocalSession": "trainyard.sdk.session",
    "get_execution_role": "trainyard.sdk.session",
    "PyTorch": "trainyard.sdk.frameworks",
    "HuggingFace": "trainyard.sdk.frameworks",
    "TrainingJobAnalytics": "trainyard.sdk.analytics",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainyard' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
