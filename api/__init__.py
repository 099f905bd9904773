"""Trainyard: `Estimator(...).fit()` on emulated hosts, EC2 or Terraform.

The public names are loaded on first use, so `import trainyard.engine` inside a training process
does not pay for the SDK (pydantic, boto3).
"""
__version__ = "0.1.0"
__all__ = ["Estimator", "FileSystemInput", "TrainingInput"]


def __getattr__(name: str):
    if name == "Estimator":
        from trainyard.sdk.estimator import Estimator

        return Estimator
    if name in ("TrainingInput", "FileSystemInput"):
        from trainyard.sdk import inputs

        return getattr(inputs, name)
    raise AttributeError(f"module 'trainyard' has no attribute {name!r}")
