"""SageMaker's `sagemaker.pytorch.estimator` import path."""
from trainyard.sdk.frameworks import PyTorch

__all__ = ["PyTorch"]
