"""SageMaker's `sagemaker.pytorch` import path (and `sagemaker.pytorch.estimator`, `sagemaker.pytorch.model`)."""
from trainyard.sdk.frameworks import PyTorch
from trainyard.sdk.model import PyTorchModel

__all__ = ["PyTorch", "PyTorchModel"]
