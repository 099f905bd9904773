"""SageMaker's `sagemaker.huggingface.model` import path."""
from trainyard.sdk.model import HuggingFaceModel

__all__ = ["HuggingFaceModel"]
