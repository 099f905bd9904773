"""SageMaker's `sagemaker.huggingface` import path."""
from trainyard.sdk.frameworks import HuggingFace

__all__ = ["HuggingFace"]
