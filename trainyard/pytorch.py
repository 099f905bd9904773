"""SageMaker's `sagemaker.pytorch` import path."""
from trainyard.sdk.frameworks import PyTorch

__all__ = ["PyTorch"]
