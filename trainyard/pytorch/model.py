"""SageMaker's `sagemaker.pytorch.model` import path."""
from trainyard.sdk.model import PyTorchModel

__all__ = ["PyTorchModel"]
